"""The ``"cpu"`` backend of :func:`smelt_kernels.dense.linear`: the native grouped GEMM
(``csrc/moe_gemm/cpu_grouped.cpp``) with one group. The weight is packed into panels once per
call and each thread runs oneDNN's brgemm micro-kernel (ATen's ``cpublas::brgemm``) over
blocks of rows, so the forward and the input gradient run at oneDNN's rate where MKL's sgemm
(what ATen's ``mm`` calls in fp32) takes a narrow path: on AMD CPUs. The weight gradient
stays ATen's (``dy^T @ x``: measured as fast there, and faster for narrow outputs). Each
output row is reduced in one fixed order: bitwise the same at any thread count. bfloat16 and
float16 run on the CPU's matrix unit (AMX) where it has one for the type, else in float32
with one rounding at the end."""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .. import backends

__all__ = ["missing", "forward", "vendor", "fastest_here"]


_MISSING: dict[str, Optional[str]] = {}


def missing() -> Optional[str]:
    """None when the native kernel is available, else why not (looked up once: the
    extension does not change within a process; a plain dict, which compiled code reads
    as it is)."""
    if "why" not in _MISSING:
        _MISSING["why"] = backends.extension_op_missing(
            "_cpu", "grouped_gemm", "csrc/moe_gemm/cpu_grouped.cpp"
        )
    return _MISSING["why"]


@functools.cache
def vendor() -> str:
    """The CPU's vendor string (``GenuineIntel``, ``AuthenticAMD``...; ``unknown`` where
    /proc/cpuinfo does not say)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def fastest_here() -> bool:
    """Whether ``"auto"`` runs this backend on this CPU: everywhere but on Intel CPUs, where
    MKL's sgemm reaches the host's fp32 GEMM ceiling itself. Decided by the CPU, not by a
    timing, so that every process on a machine computes the same bits."""
    return vendor() != "GenuineIntel"


def forward(x: torch.Tensor, weight: torch.Tensor, trans_w: bool) -> torch.Tensor:
    """``x @ weight^T`` (``trans_w``, weight (N, K)) or ``x @ weight`` (weight (K, N)),
    x (M, K)."""
    backends.check_env("SMELT_POISON")
    rows = torch.tensor([0, x.shape[0]], dtype=torch.int32)
    return torch.ops.smelt_cpu.grouped_gemm(x, weight.unsqueeze(0), rows, None, trans_w)


def _grouped_fake(a, b, offsets, gather, trans_b):
    rows = a.shape[0] if gather is None else gather.shape[0]
    return a.new_empty(rows, b.shape[1] if trans_b else b.shape[2])


# compiled code that names the "cpu" backend calls the native GEMM directly (the no-autograd
# entry point): its fake gives the compiler the output's shape
backends.register_native_fake("_cpu", "grouped_gemm", _grouped_fake)
