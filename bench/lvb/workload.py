"""The workload of one run, checked from the options, and the memory it needs.

Every numeric option is checked here (one :class:`UsageError` naming it) before anything is
built; :func:`check_memory` refuses a run whose larger architecture, with
:data:`smelt_model.budget.memory.MARGIN` on top, would not fit in what the device has left.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from output_paths import output_file

from smelt_kernels import backends as bk
from smelt_model.budget import memory
from smelt_model.config import ModelConfig
from smelt_tools import cli
from smelt_tools.cli import UsageError

__all__ = [
    "MODES",
    "ARCHS",
    "UsageError",
    "Workload",
    "packed_segments",
    "make_workload",
    "check_environment",
    "modes_of",
    "decode_warmup",
    "decode_cache_len",
    "estimate_memory",
    "check_memory",
]

MODES = ("train", "prefill", "decode")
ARCHS = ("baseline", "smelt")


@dataclass
class Workload:
    batch: int
    seq_len: int
    mean_doc_len: float
    decode_prompt: int
    decode_steps: int
    decode_batches: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len


def packed_segments(batch: int, seq_len: int, mean_doc_len: float, device) -> torch.Tensor:
    """Segment ids of documents packed like the ledger assumes: full documents of
    ``min(mean_doc_len, seq_len)`` tokens, the last one cut at the context end."""
    doc = max(1, int(round(min(mean_doc_len, seq_len))))
    seg = torch.arange(seq_len, device=device) // doc
    return seg[None].expand(batch, seq_len).contiguous()


def make_workload(args) -> Workload:
    """Check every numeric option (one :class:`UsageError` naming it) and build the workload."""
    positive = (
        "tokens",
        "seq_len",
        "repeats",
        "min_rounds",
        "max_rounds",
        "decode_prompt",
        "decode_steps",
        "max_tries",
        "account_rounds",
        "account_steps",
    )
    for name in positive:
        v = getattr(args, name)
        if not isinstance(v, int) or v < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {v}")
    if args.warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {args.warmup}")
    cli.threads(args.threads)
    if not (args.mean_doc_len > 0 and math.isfinite(args.mean_doc_len)):
        raise UsageError(f"--mean-doc-len must be a positive number, got {args.mean_doc_len}")
    for name in ("tolerance", "confidence", "resolution", "busy_limit"):
        v = getattr(args, name)
        if not 0 < v < 1:
            raise UsageError(f"--{name.replace('_', '-')} must lie in (0, 1), got {v}")
    if not (args.max_time > 0 and math.isfinite(args.max_time)):
        raise UsageError(f"--max-time must be a positive number of seconds, got {args.max_time}")
    if any(b < 1 for b in args.decode_batch):
        raise UsageError(f"--decode-batch sizes must be positive, got {args.decode_batch}")
    if args.max_rounds < args.min_rounds:
        raise UsageError(
            f"--max-rounds ({args.max_rounds}) must be at least --min-rounds ({args.min_rounds})"
        )
    seq = min(args.seq_len, args.tokens)
    if args.tokens % seq:
        raise UsageError(f"--tokens ({args.tokens}) must be a multiple of --seq-len ({seq})")
    return Workload(
        batch=args.tokens // seq,
        seq_len=seq,
        mean_doc_len=args.mean_doc_len,
        decode_prompt=args.decode_prompt,
        decode_steps=args.decode_steps,
        decode_batches=tuple(args.decode_batch),
    )


def check_environment(args) -> None:
    """Backends, device and optional packages, before anything is built or measured."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but no CUDA device is available")
    if args.backend != "auto":
        why = bk.unavailable_reason(args.backend, args.device)
        if why is not None:
            raise UsageError(f"--backend {args.backend} cannot run on {args.device}: {why}")
    suffixes = {"json": (".json",), "markdown": (".md",), "plot": (".png", ".svg", ".pdf")}
    for opt, ends in suffixes.items():
        output_file(getattr(args, opt), f"--{opt}", ends)
    if args.plot:
        try:
            # optional (the [plot] extra): checked here, imported when the plot is drawn
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError(
                "--plot needs matplotlib (pip install matplotlib, or the [plot] extra)"
            ) from None


def modes_of(args) -> tuple[str, ...]:
    """The modes a run measures (``--mode``)."""
    return MODES if args.mode == "all" else (args.mode,)


def decode_warmup(args) -> int:
    """Untimed decode steps before a block (the first calls of a compiled step compile)."""
    return max(args.warmup, 0 if args.eager_decode else 2)


def decode_cache_len(wl: Workload, args) -> int:
    """Positions of one decode block's cache: prompt, warm-up and timed steps."""
    return wl.decode_prompt + decode_warmup(args) + wl.decode_steps + 1


def estimate_memory(cfg: ModelConfig, wl: Workload, args, dtype_bytes: int) -> dict[str, int]:
    """Bytes one architecture needs at its peak in this run, by part
    (:func:`smelt_model.budget.memory.estimate` for the modes asked). On the 100M pairs at 512
    tokens it is about 6-8% below the measured peak RSS of the whole run (14.8 GiB), which
    the check's margin covers."""
    modes = modes_of(args)
    decode = "decode" in modes
    return memory.estimate(
        cfg,
        tokens=wl.tokens,
        seq_len=wl.seq_len,
        train="train" in modes,
        forward="prefill" in modes,
        decode_batch=max(wl.decode_batches) if decode else 0,
        decode_len=decode_cache_len(wl, args) if decode else 0,
        param_bytes=dtype_bytes,
    )


def check_memory(
    cfgs: dict[str, ModelConfig], wl: Workload, args, dtype_bytes: int, available: Optional[int]
) -> dict[str, dict[str, int]]:
    """The estimate per architecture; a :class:`UsageError` naming the larger one when it
    (with the margin) exceeds ``available`` bytes (only one architecture is ever in memory)."""
    est = {a: estimate_memory(c, wl, args, dtype_bytes) for a, c in cfgs.items()}
    try:
        memory.check(
            est,
            available,
            what=f"--preset {args.preset}",
            where=str(args.device),
            hint="lower --tokens, pick a --mode, or a smaller --preset",
        )
    except memory.MemoryRefusal as e:
        raise UsageError(str(e)) from None
    return est
