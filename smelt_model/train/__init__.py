"""The one-process trainer, ``smelt-train`` (``python -m smelt_model.train``; the command
line is :mod:`.cli`): the CPU or one GPU, runs that resume bitwise, and the harness that
``bench/time_to_loss.py`` uses. Every run on several processes goes through
:mod:`smelt_model.titan` instead; both start from a preset's
:func:`smelt_model.presets.recipe`.

:mod:`.data` loads a corpus, splits it by document and packs it into contexts with
``segment_ids``; :mod:`.tokenizer` has the bytes and BPE tokenizers; :mod:`.trainer` runs
one model (AdamW, torchtitan's warm-up and cosine schedule, accumulation, evaluation,
logs); :mod:`.loop` runs one or two of them on the same data; :mod:`.runspec` is
``run.json``, the recipe a resumed run is held to; :mod:`.checkpoint` writes atomic,
exactly resumable checkpoints (each a ``SmeltLM.save_pretrained`` folder with the training
state beside it) and reads them strictly, with the training state in :mod:`.plainstate`
(JSON and safetensors: nothing in a run folder can run code); :mod:`.plot` draws loss
against FLOPs and seconds.

It imports the model layer and the kernels, never ``smelt_model.titan``, torchtitan,
``torch.distributed`` or ``bench``.
"""

from .data import STDLIB, Corpus, Document, Packed, load_documents, pack, prepare, split
from .trainer import RunSpec, Trainer

__all__ = [
    "STDLIB",
    "Corpus",
    "Document",
    "Packed",
    "load_documents",
    "pack",
    "prepare",
    "split",
    "RunSpec",
    "Trainer",
]
