"""The trainer: ``python -m smelt_model.train`` (see :mod:`smelt_model.train.__main__`).

:mod:`.data` loads a corpus, splits it by document and packs it into contexts with
``segment_ids``; :mod:`.tokenizer` has the bytes and BPE tokenizers; :mod:`.trainer` runs
one model (AdamW, warm-up and cosine, accumulation, evaluation, logs); :mod:`.runspec` is
``run.json``, the recipe a resumed run is held to; :mod:`.checkpoint` writes atomic, exactly
resumable checkpoints and reads them strictly, with the training state in
:mod:`.plainstate` (JSON and safetensors: nothing in a run folder can run code);
:mod:`.plot` draws loss against FLOPs and seconds.
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
