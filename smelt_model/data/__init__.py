"""The text data both trainers share: :mod:`.corpus` loads a corpus, splits it by document
and packs it into contexts with ``segment_ids``; :mod:`.tokenizer` has the bytes and BPE
tokenizers and reads and writes ``tokenizer.json``.

The one-process trainer (``smelt_model.train``) and the torchtitan loader
(``smelt_model.titan.loader``) both import it; it imports neither.
"""

from smelt_model.data.corpus import (
    STDLIB,
    Corpus,
    Document,
    Packed,
    held_out,
    load_documents,
    pack,
    prepare,
    split,
)

__all__ = [
    "STDLIB",
    "Corpus",
    "Document",
    "Packed",
    "held_out",
    "load_documents",
    "pack",
    "prepare",
    "split",
]
