"""smelt's packed-document data as torchtitan's tokenizer and dataloader.

:class:`PackedDocuments` reads a corpus with :func:`smelt_model.data.corpus.load_documents`
(``python-stdlib``, a folder, a ``.txt`` or a ``.jsonl`` file; nothing is downloaded),
tokenises documents as it goes with :class:`SmeltTokenizer` (smelt's tokenizers: raw bytes,
or one a smelt run saved), packs them with :func:`smelt_model.data.corpus.pack` and deals
the contexts round-robin to the data-parallel ranks. Each batch is torchtitan's
``({"input": (B, T), "positions": (B, T)}, labels (B, T))``: ``positions`` restart at 0 at
every document, and a label whose token belongs to another document than its input
position (or is padding) is ``-100``, as :meth:`smelt_model.SmeltLM.lm_loss` ignores it.

The order is fixed by ``seed`` (documents shuffled per epoch by
:func:`smelt_model.data.corpus.epoch_order`); the loader's checkpoint state is the number of
batches it has yielded (plain integers; a resume skips that many, so the launcher bounds it
by the checkpoint's step first: :mod:`smelt_model.titan.checkpoint.resume`).

A stock torchtitan config (which loads a Hugging Face dataset and tokenizer) takes them
with ``--override.imports``
``smelt_model.titan.loader.smelt_data,smelt_model.titan.loader.smelt_tokenizer``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal

import numpy as np
import torch
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.tokenizer import BaseTokenizer, HuggingFaceTokenizer
from torchtitan.config.override import override
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

from smelt_model.config import IGNORE_INDEX
from smelt_model.data import corpus as smelt_data_module
from smelt_model.data import tokenizer as smelt_tokenizer_module
from smelt_model.model import valid_targets

__all__ = [
    "SmeltTokenizer",
    "PackedDocuments",
    "batch_from_packed",
    "IGNORE_INDEX",
    "smelt_data",
    "smelt_tokenizer",
]

#: documents tokenised and packed together at a time (bounds the memory of a pass)
_CHUNK_DOCS = 64


class SmeltTokenizer(BaseTokenizer):
    """One of smelt's tokenizers behind torchtitan's tokenizer interface.

    ``path``: empty for raw UTF-8 bytes (258 ids), or a folder holding the
    ``tokenizer.json`` a smelt run saved (:func:`smelt_model.data.tokenizer.load`).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        path: str = ""

    def __init__(self, config: Config, *, tokenizer_path: str | None = None, **_: Any):
        super().__init__()
        if config.path:
            self.inner = smelt_tokenizer_module.load(config.path)
        else:
            self.inner = smelt_tokenizer_module.BytesTokenizer()
        self.eos_id = self.inner.eos_id
        self.pad_id = self.inner.pad_id

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
        return [int(i) for i in self.inner.encode(text)]

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.inner.encode(text), dtype=np.int64)

    def decode(self, ids, *args: Any, **kwargs: Any) -> str:
        return self.inner.decode(ids)

    def get_vocab_size(self) -> int:
        return int(self.inner.vocab_size)


def batch_from_packed(
    ids: np.ndarray, segments: np.ndarray, labels: np.ndarray
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One torchtitan batch from packed contexts of ``T + 1`` tokens (see the module doc).

    ``ids``, ``segments``, ``labels``: (B, T + 1) as :func:`smelt_model.data.corpus.pack`
    makes them. Returns ``({"input", "positions"}, labels)``, each (B, T).
    """
    ids, segments, labels = (
        torch.from_numpy(np.ascontiguousarray(a)).long() for a in (ids, segments, labels)
    )
    # the model's own rule: no target across a document boundary, none at IGNORE_INDEX
    target = torch.where(valid_targets(labels, segments), labels[:, 1:], IGNORE_INDEX)
    seg = segments[:, :-1]
    T = seg.shape[1]
    change = torch.ones_like(seg, dtype=torch.bool)
    change[:, 1:] = seg[:, 1:] != seg[:, :-1]
    start = torch.where(change, torch.arange(T)[None, :], 0).cummax(dim=1).values
    positions = torch.arange(T)[None, :] - start
    return ({"input": ids[:, :-1].contiguous(), "positions": positions}, target.contiguous())


class PackedDocuments(BaseDataLoader):
    """smelt's packed documents as a torchtitan dataloader (see the module docstring).

    Config: ``dataset`` is the corpus (``python-stdlib``, a folder, ``.txt`` or ``.jsonl``);
    ``split``: ``"all"`` its documents, or the ``"train"`` or ``"val"`` side of
    :func:`smelt_model.data.corpus.split` with ``val_fraction`` (smelt's own trainer's
    split); ``seed`` fixes the order; ``infinite`` starts a new epoch when the documents are
    used up (else the loader stops, and torchtitan ends the run).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        dataset: str = smelt_data_module.STDLIB
        split: Literal["all", "train", "val"] = "all"
        val_fraction: float = 0.05
        seed: int = 0
        infinite: bool = True

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: BaseTokenizer,
        seq_len: int,
        local_batch_size: int,
        **_: Any,
    ):
        if not isinstance(tokenizer, SmeltTokenizer):
            raise TypeError(
                f"PackedDocuments needs a SmeltTokenizer, got "
                f"{type(tokenizer).__name__} (set the run's tokenizer to "
                f"smelt_model.titan.loader.SmeltTokenizer.Config)"
            )
        if seq_len < 1 or local_batch_size < 1:
            raise ValueError(
                f"seq_len and local_batch_size must be >= 1, got {seq_len}, {local_batch_size}"
            )
        if config.split not in ("all", "train", "val"):
            raise ValueError(f"split must be 'all', 'train' or 'val', got {config.split!r}")
        self.config = config
        self.docs = smelt_data_module.load_documents(config.dataset)
        if config.split != "all":
            train, val = smelt_data_module.split(self.docs, config.val_fraction)
            self.docs = train if config.split == "train" else val
            if not self.docs:
                raise ValueError(
                    f"--dataloader.dataset {config.dataset}: no documents on the "
                    f"{config.split} side (val_fraction {config.val_fraction})"
                )
        self.tokenizer = tokenizer
        self.seq_len, self.batch_size = seq_len, local_batch_size
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.batches_yielded = 0

    def _contexts(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Every context of ``seq_len + 1`` tokens, in order, for all ranks."""
        epoch = 0
        while True:
            order = smelt_data_module.epoch_order(len(self.docs), self.config.seed, epoch)
            for lo in range(0, len(order), _CHUNK_DOCS):
                chunk = [
                    self.tokenizer.encode_array(self.docs[i].text)
                    for i in order[lo : lo + _CHUNK_DOCS]
                ]
                packed = smelt_data_module.pack(chunk, self.seq_len + 1, self.tokenizer.pad_id)
                for row in range(len(packed)):
                    yield packed.input_ids[row], packed.segment_ids[row], packed.labels[row]
            if not self.config.infinite:
                return
            epoch += 1

    def _batches(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for i, ctx in enumerate(self._contexts()):
            if i % self.dp_world_size != self.dp_rank:
                continue
            rows.append(ctx)
            if len(rows) == self.batch_size:
                ids, segs, labels = (np.stack(parts) for parts in zip(*rows))
                rows = []
                yield batch_from_packed(ids, segs, labels)

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        skip = self.batches_yielded
        for n, batch in enumerate(self._batches()):
            if n < skip:
                continue
            self.batches_yielded = n + 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {
            f"dp_rank_{self.dp_rank}": {"batches": self.batches_yielded},
            "world_size": self.dp_world_size,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        mine = state_dict.get(f"dp_rank_{self.dp_rank}")
        if mine is None:
            return
        if state_dict.get("world_size") != self.dp_world_size:
            raise ValueError(
                f"the checkpoint's data state is for {state_dict.get('world_size')} "
                f"data-parallel ranks, this run has {self.dp_world_size}"
            )
        batches = mine.get("batches") if isinstance(mine, dict) else None
        if not (isinstance(batches, int) and not isinstance(batches, bool) and batches >= 0):
            raise ValueError(
                f"the checkpoint's data position for dp rank {self.dp_rank} is not a count "
                f"of batches ({batches!r})"
            )
        self.batches_yielded = batches


@override(
    target=HuggingFaceTextDataLoader.Config,
    exact=True,
    description="smelt's packed documents (local corpus, no download)",
)
def smelt_data(
    cfg: HuggingFaceTextDataLoader.Config, dataset: str | None = None, seed: int = 0
) -> PackedDocuments.Config:
    """A stock config's text loader -> :class:`PackedDocuments` (``dataset`` defaults to
    the loader's own ``--dataloader.dataset`` when that names a local corpus, else
    ``python-stdlib``)."""
    spec = dataset or (cfg.dataset if _local_corpus(cfg.dataset) else smelt_data_module.STDLIB)
    return PackedDocuments.Config(dataset=spec, seed=seed, infinite=cfg.infinite)


@override(
    target=HuggingFaceTokenizer.Config,
    exact=True,
    description="smelt's tokenizer (bytes, or a saved smelt tokenizer)",
)
def smelt_tokenizer(cfg: HuggingFaceTokenizer.Config, path: str = "") -> SmeltTokenizer.Config:
    """A stock config's Hugging Face tokenizer -> :class:`SmeltTokenizer`."""
    return SmeltTokenizer.Config(path=path)


def _local_corpus(spec: str) -> bool:
    return spec == smelt_data_module.STDLIB or Path(spec).exists()
