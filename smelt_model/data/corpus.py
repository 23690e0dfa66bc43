"""Training text: documents from a corpus, a deterministic train/validation split, and packing
into fixed contexts with ``segment_ids``.

A corpus is a list of :class:`Document` (a stable key and its text). :func:`split` puts each
document on one side by a hash of its key. :func:`pack` concatenates tokenised documents and
cuts the stream into contexts of ``seq_len`` tokens; every document is its own segment, and a
document that runs past the end of a context continues in the next one as a new segment.
The model ignores targets across a segment boundary, so no context learns across documents.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from smelt_model.config import IGNORE_INDEX
from smelt_model.data import tokenizer as tok_mod

__all__ = [
    "STDLIB",
    "Document",
    "Packed",
    "load_documents",
    "split",
    "pack",
    "stdlib_root",
    "epoch_order",
    "unigram_entropy",
    "Corpus",
    "prepare",
    "held_out",
]

#: the name of the built-in corpus: the running interpreter's standard-library sources
STDLIB = "python-stdlib"


@dataclass(frozen=True)
class Document:
    key: str  # stable identity: a relative path, or "<file>#<index>"
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _read_text(path: str) -> str | None:
    """The file's text, or None when it is not a UTF-8 text file."""
    with open(path, "rb") as fh:
        data = fh.read()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _is_file(entry: os.DirEntry) -> bool:
    """``Path.is_file`` of a listed entry: a regular file, or a link to one (a broken link,
    a link loop, a pipe is not); a regular file needs no further system call."""
    try:
        if entry.is_file(follow_symlinks=False):
            return True
    except OSError:
        pass
    return Path(entry.path).is_file()


def _files(root: Path, suffix: str, skip: Sequence[str]) -> list[tuple[tuple[str, ...], str]]:
    """``(relative parts, path)`` of every file under ``root`` whose name ends with
    ``suffix``, sorted by parts (the order of sorted ``Path`` objects). Folders and files
    whose name starts with a dot or is one of ``skip`` are passed over, their contents
    unread; linked folders are not entered (linked files count); a folder that may not be
    listed is passed over, as ``Path.glob`` does."""
    found = []
    pending = [((), os.fspath(root))]
    while pending:
        parts, folder = pending.pop()
        try:
            with os.scandir(folder) as it:
                entries = list(it)
        except PermissionError:
            continue
        for entry in entries:
            name = entry.name
            if name.startswith(".") or name in skip:
                continue
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:  # gone since the folder was listed
                is_dir = False
            if is_dir:
                pending.append((parts + (name,), entry.path))
            elif name.endswith(suffix) and _is_file(entry):
                found.append((parts + (name,), entry.path))
    found.sort()
    return found


def _folder(root: Path, suffix: str = "", skip: Sequence[str] = ()) -> list[Document]:
    docs = []
    for parts, path in _files(root, suffix, skip):
        text = _read_text(path)
        if text is not None and text.strip():
            docs.append(Document("/".join(parts), text))
    return docs


def _txt(path: Path) -> list[Document]:
    text = path.read_text(encoding="utf-8", errors="replace")
    parts = [p.strip("\n") for p in re.split(r"\n(?:[ \t\r]*\n)+", text)]
    return [Document(f"{path.name}#{i}", p) for i, p in enumerate(parts) if p.strip()]


def _jsonl(path: Path) -> list[Document]:
    docs = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"--data {path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise ValueError(
                    f'--data {path}:{lineno}: expected an object with a string "text" field'
                )
            if obj["text"].strip():
                docs.append(Document(f"{path.name}#{lineno}", obj["text"]))
    return docs


def load_documents(spec: str) -> list[Document]:
    """Documents of ``spec``: ``python-stdlib``, a folder, a ``.txt`` or a ``.jsonl`` file.

    A folder: every UTF-8 text file under it (hidden files skipped) is one document. A
    ``.txt`` file: documents separated by blank lines. A ``.jsonl`` file: one
    ``{"text": ...}`` per line. ``python-stdlib``: the ``.py`` files of the running
    interpreter's standard library (without ``site-packages``). Raises ``ValueError`` for a
    missing path, an unknown file type or a corpus without any text.
    """
    if spec == STDLIB:
        root = stdlib_root()
        docs = _folder(root, ".py", skip=("site-packages", "dist-packages", "__pycache__"))
        where = f"{STDLIB} ({root})"
    else:
        path = Path(spec)
        if not path.exists():
            raise ValueError(f"--data {spec}: no such file or folder")
        if path.is_dir():
            docs = _folder(path)
        elif path.suffix == ".txt":
            docs = _txt(path)
        elif path.suffix == ".jsonl":
            docs = _jsonl(path)
        else:
            raise ValueError(
                f"--data {spec}: expected a folder, a .txt or a .jsonl file, or {STDLIB}"
            )
        where = spec
    if not docs:
        raise ValueError(f"--data {where}: the corpus is empty (no documents with text)")
    return docs


def _unit(key: str, seed: int) -> float:
    h = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64


def split(
    docs: Sequence[Document], val_fraction: float, seed: int = 0
) -> tuple[list[Document], list[Document]]:
    """``(train, val)``: a document is in validation when the hash of its key is below
    ``val_fraction``. Deterministic, disjoint, independent of the documents' order. With
    ``val_fraction > 0`` and at least two documents, each side gets at least one."""
    if not 0 <= val_fraction < 1:
        raise ValueError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    u = [_unit(d.key, seed) for d in docs]
    val_idx = {i for i, x in enumerate(u) if x < val_fraction}
    if val_fraction > 0 and not val_idx and len(docs) >= 2:
        val_idx = {int(np.argmin(u))}
    if len(val_idx) == len(docs) and len(docs) >= 2:
        val_idx.discard(int(np.argmax(u)))
    train = [d for i, d in enumerate(docs) if i not in val_idx]
    val = [d for i, d in enumerate(docs) if i in val_idx]
    return train, val


@dataclass
class Packed:
    """Contexts of packed documents: ``input_ids``, ``segment_ids`` and ``labels`` (N, T),
    int32 (a model takes them as int64, one batch at a time).

    ``labels`` equal ``input_ids`` except padding (``-100``); the model's loss ignores a
    target whose segment differs from its predecessor's. ``doc_lengths`` are the token
    counts of the documents in packing order.
    """

    input_ids: np.ndarray
    segment_ids: np.ndarray
    labels: np.ndarray
    doc_lengths: np.ndarray

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def mean_doc_len(self) -> float:
        return float(self.doc_lengths.mean())


def pack(token_docs: Iterable[np.ndarray], seq_len: int, pad_id: int) -> Packed:
    """Concatenate the token arrays and cut them into contexts of ``seq_len`` tokens.

    Segment ids count the documents inside a context from 0; a document cut by a context
    end continues at position 0 of the next context as a new segment. The last context is
    padded with ``pad_id`` (labels ``-100``, a segment of its own). Works in place on int32
    arrays: about 13 bytes a token at its peak besides the input.
    """
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"--seq-len must be an int >= 2, got {seq_len!r}")
    arrays = [a for a in (np.asarray(t) for t in token_docs) if len(a)]
    if not arrays:
        raise ValueError("no tokens to pack")
    lengths = np.array([len(a) for a in arrays], dtype=np.int64)
    total = int(lengths.sum())
    n = -(-total // seq_len)
    flat = np.full(n * seq_len, pad_id, dtype=np.int32)
    np.concatenate(arrays, out=flat[:total], casting="same_kind")
    labels = flat.copy()
    labels[total:] = IGNORE_INDEX
    # a new segment wherever a document (or the padding) starts inside a row
    starts = np.zeros(n * seq_len, dtype=np.int8)
    starts[np.cumsum(lengths)[:-1]] = 1
    if total < n * seq_len:
        starts[total] = 1
    starts = starts.reshape(n, seq_len)
    starts[:, 0] = 0
    segments = np.cumsum(starts, axis=1, dtype=np.int32)
    return Packed(flat.reshape(n, seq_len), segments, labels.reshape(n, seq_len), lengths)


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The order of ``n`` contexts in ``epoch``: a permutation fixed by ``(seed, epoch)``."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def unigram_entropy(token_docs: Iterable[np.ndarray]) -> float:
    """Entropy (nats) of the token frequencies: the loss of the best context-free model."""
    counts = np.bincount(np.concatenate([np.asarray(t) for t in token_docs]))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


@dataclass
class Corpus:
    """A tokenised, packed, split corpus ready for training."""

    train: Packed
    val: Optional[Packed]
    tokenizer: Any
    n_train_docs: int
    n_val_docs: int


def prepare(
    data: str,
    tokenizer_spec: str,
    seq_len: int,
    val_fraction: float,
    seed: int,
    tokenizer: Any = None,
) -> Corpus:
    """Load ``data``, split it, build (or take) the tokenizer, encode and pack both sides.

    The training documents are packed in an order shuffled by ``seed``; validation
    documents in corpus order. A BPE tokenizer is trained on the training split only.
    """
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"--seq-len must be an int >= 2, got {seq_len!r}")
    tok_mod.parse_spec(tokenizer_spec)
    docs = load_documents(data)
    train_docs, val_docs = split(docs, val_fraction)
    if not train_docs:
        raise ValueError(
            f"--data {data}: no training documents after the split (--val-fraction {val_fraction})"
        )
    if tokenizer is None:
        tokenizer = tok_mod.make(tokenizer_spec, (d.text for d in train_docs))
    order = np.random.default_rng([seed, 0x5EED]).permutation(len(train_docs))
    train_tokens = tokenizer.encode_batch([train_docs[i].text for i in order])
    train = pack(train_tokens, seq_len, tokenizer.pad_id)
    return Corpus(
        train, _pack_docs(val_docs, tokenizer, seq_len), tokenizer, len(train_docs), len(val_docs)
    )


def _pack_docs(docs: Sequence[Document], tokenizer: Any, seq_len: int) -> Optional[Packed]:
    """``docs`` in corpus order, encoded and packed (None without documents)."""
    if not docs:
        return None
    return pack(tokenizer.encode_batch([d.text for d in docs]), seq_len, tokenizer.pad_id)


def held_out(data: str, val_fraction: float, tokenizer: Any, seq_len: int) -> Optional[Packed]:
    """The validation side of ``data`` as :func:`prepare` splits it, encoded with
    ``tokenizer`` and packed into ``seq_len`` contexts (None when the split has none): a
    run's held-out text, for tools that look at a trained model."""
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"--seq-len must be an int >= 2, got {seq_len!r}")
    _, val_docs = split(load_documents(data), val_fraction)
    return _pack_docs(val_docs, tokenizer, seq_len)
