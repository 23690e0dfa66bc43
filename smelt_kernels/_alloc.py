"""Output allocation for kernel launchers, with optional poisoning.

With ``SMELT_POISON=1`` (the test suite sets it) every buffer a kernel is meant to write
completely is filled with NaN (floats) or the most negative integer before the launch, so
an element the kernel forgets to write fails the comparison instead of passing by luck.
"""

from __future__ import annotations

import torch

from . import backends

__all__ = ["cpu_pool_stats", "empty", "poisoning", "release_cpu_pool"]


def poisoning() -> bool:
    return backends.env_flag("SMELT_POISON")


def empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    if poisoning():
        if dtype.is_floating_point:
            t.fill_(float("nan"))
        elif dtype == torch.bool:
            t.fill_(True)
        else:
            t.fill_(torch.iinfo(dtype).min)
    return t


def cpu_pool_stats() -> dict[str, int] | None:
    """What the native CPU kernels' block pool (``csrc/cpu_pool.h``) holds: ``held_bytes``
    kept unused for the next large output, and how many blocks it handed out ``reused`` or
    allocated ``fresh`` so far. None when the extension is not built.

    The MoE kernels take their large outputs (pre-activations, outputs, weight gradients)
    from it, so that a training step does not first-touch tens of megabytes of freshly
    mapped memory per layer. ``SMELT_CPU_POOL_MB`` caps what it keeps unused (default 1024;
    0 turns it off)."""
    if backends.extension_op_missing("_cpu", "pool_stats", "csrc/cpu_module.cpp") is not None:
        return None
    held, reused, fresh = torch.ops.smelt_cpu.pool_stats()
    return {"held_bytes": int(held), "reused": int(reused), "fresh": int(fresh)}


def release_cpu_pool() -> int:
    """Free the blocks the native CPU pool keeps unused; returns the bytes freed (0 without
    the extension). Tensors still on pooled blocks are untouched: their blocks come back
    when they are freed."""
    if backends.extension_op_missing("_cpu", "pool_release", "csrc/cpu_module.cpp") is not None:
        return 0
    return int(torch.ops.smelt_cpu.pool_release())
