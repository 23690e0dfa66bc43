"""The one-process trainer, ``smelt-train`` (``python -m smelt_model.train``; the command
line is :mod:`.cli`): the CPU or one GPU, runs that resume bitwise, and the harness that
``bench/time_to_loss.py`` uses. Every run on several processes goes through
:mod:`smelt_model.titan` instead; both start from a preset's
:func:`smelt_model.presets.recipe`, and both read their text through :mod:`smelt_model.data`.

:mod:`.trainer` runs one model (AdamW, torchtitan's warm-up and cosine schedule,
accumulation, evaluation, logs); :mod:`.lockstep` runs one or two of them on the same data,
step for step; :mod:`.runspec` is ``run.json``, the recipe a resumed run is held to;
:mod:`.checkpoint` writes atomic, exactly resumable checkpoints (each a
``SmeltLM.save_pretrained`` folder with the training state beside it, in
:mod:`smelt_model.checkpoint.plainstate`: nothing in a run folder can run code) and reads
them strictly; :mod:`.plot` draws loss against FLOPs and seconds.

It imports the model layer, the shared data and checkpoint homes and the kernels, never
``smelt_model.titan``, torchtitan, ``torch.distributed`` or ``bench``.
"""

from smelt_model.train.trainer import RunSpec, Trainer

__all__ = ["RunSpec", "Trainer"]
