"""Tokenizers for the trainer: raw bytes (no dependencies) and a byte-level BPE trained with
Hugging Face ``tokenizers``.

Both append ``<eos>`` to every document and reserve ``<pad>`` for the packer; both encode
into numpy int64 arrays. ``make(spec, train_texts)`` builds one from a ``--tokenizer``
string (``bytes`` or ``bpe:N``); ``load(folder)`` reads the one saved beside a run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from smelt_model.checkpoint.plainstate import read_json

__all__ = ["BytesTokenizer", "BPETokenizer", "make", "load", "parse_spec", "FILE"]

FILE = "tokenizer.json"
SPECIALS = ("<pad>", "<eos>")


class BytesTokenizer:
    """UTF-8 bytes 0..255, then ``<pad>`` = 256 and ``<eos>`` = 257."""

    spec = "bytes"
    vocab_size = 256 + len(SPECIALS)
    pad_id = 256
    eos_id = 257

    def encode(self, text: str) -> np.ndarray:
        raw = text.encode("utf-8")
        ids = np.empty(len(raw) + 1, dtype=np.int64)
        ids[:-1] = np.frombuffer(raw, dtype=np.uint8)
        ids[-1] = self.eos_id
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def save(self, folder: Path) -> None:
        (Path(folder) / FILE).write_text(json.dumps({"smelt_tokenizer": "bytes"}) + "\n")


class BPETokenizer:
    """A byte-level BPE (Hugging Face ``tokenizers``) with ``<pad>`` = 0 and ``<eos>`` = 1."""

    def __init__(self, tok):
        self._tok = tok
        self.vocab_size = tok.get_vocab_size()
        self.pad_id = tok.token_to_id("<pad>")
        self.eos_id = tok.token_to_id("<eos>")
        self.spec = f"bpe:{self.vocab_size}"

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "BPETokenizer":
        tokenizers = _import_tokenizers()
        # imported once the check above has said what is missing
        from tokenizers import decoders, models, pre_tokenizers, trainers

        tok = tokenizers.Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(SPECIALS),
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        out = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.append(np.asarray(e.ids, dtype=np.int64), self.eos_id) for e in out]

    def encode(self, text: str) -> np.ndarray:
        return self.encode_batch([text])[0]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids if i not in (self.pad_id, self.eos_id)])

    def save(self, folder: Path) -> None:
        self._tok.save(str(Path(folder) / FILE))


def _import_tokenizers():
    try:
        # optional (the [train] extra): only a BPE tokenizer needs it
        import tokenizers
    except ImportError:
        raise ValueError(
            "--tokenizer bpe:N needs the Hugging Face 'tokenizers' package (pip install tokenizers)"
        ) from None
    return tokenizers


def parse_spec(spec: str) -> tuple[str, int]:
    """``("bytes", 258)`` or ``("bpe", N)``; ``ValueError`` for anything else."""
    if spec == "bytes":
        return "bytes", BytesTokenizer.vocab_size
    if spec.startswith("bpe:"):
        try:
            n = int(spec[4:])
        except ValueError:
            n = 0
        # the 256 byte symbols and the two specials must fit, and at least one merge
        if n < 256 + len(SPECIALS) + 1:
            raise ValueError(f"--tokenizer {spec}: N must be an int >= {256 + len(SPECIALS) + 1}")
        return "bpe", n
    raise ValueError(f"--tokenizer must be 'bytes' or 'bpe:N', got {spec!r}")


def make(spec: str, train_texts: Iterable[str] = ()):
    """The tokenizer ``spec`` names; a BPE is trained on ``train_texts``."""
    kind, n = parse_spec(spec)
    if kind == "bytes":
        return BytesTokenizer()
    return BPETokenizer.train(train_texts, n)


def load(folder: Path):
    """The tokenizer saved in ``folder`` by a run; ``ValueError`` naming the file when it is
    missing or not a tokenizer."""
    path = Path(folder) / FILE
    if not path.exists():
        raise ValueError(f"{path}: no tokenizer saved in the run folder")
    head = read_json(path, "tokenizer file")
    if head.get("smelt_tokenizer") == "bytes":
        return BytesTokenizer()
    tokenizers = _import_tokenizers()
    try:
        tok = BPETokenizer(tokenizers.Tokenizer.from_file(str(path)))
    except Exception as e:  # the tokenizers library's own error types
        raise ValueError(f"{path}: not a tokenizer file ({str(e).splitlines()[0]})") from None
    if tok.pad_id is None or tok.eos_id is None:
        raise ValueError(f"{path}: not a smelt tokenizer (no <pad> and <eos> tokens)")
    return tok
