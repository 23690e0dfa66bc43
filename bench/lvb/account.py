"""The account of a step: where each model's training step or prefill spends its time, part
by part, measured inside the same steps the verdict times (:func:`smelt_tools.account.account`),
and what the host's best GEMM would take for each part's GEMMs at the part's own shapes.

Parts (:data:`PARTS`): the experts (the fused MoE kernel, forward and backward), attention
(rotary and the segment-masked core), the q/k/v/o projections, the head (the output GEMM and
the loss), routing (router GEMM, top-k, router losses), norms and residual adds, the
optimizer (AdamW, zero_grad, adding each gradient into ``.grad``) and the rest (embedding,
Python between ops, anything else). The GEMM reference times every GEMM a part runs (forward,
and for a training step its two backward GEMMs) through the faster of MKL's sgemm
(``torch.mm``) and oneDNN's matmul (:func:`gemm_ms`), at the rows each expert sees under even
routing; :func:`ceiling` is the same best of both at 2048^3, the host's GEMM ceiling.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from smelt_kernels.layers import MoE, RMSNorm, SegmentAttention
from smelt_model.block import Block
from smelt_model.config import ModelConfig
from smelt_tools.account import Account, account

__all__ = [
    "PARTS",
    "PART_NAMES",
    "LEDGER_PARTS",
    "scopes",
    "account_step",
    "gemm_shapes",
    "gemm_ms",
    "gemm_reference",
    "ceiling",
]

PARTS = ("moe", "attention", "projections", "head", "routing", "norms", "optimizer", "rest")
PART_NAMES = {
    "moe": "experts (MoE)",
    "attention": "attention",
    "projections": "q/k/v/o proj.",
    "head": "head and loss",
    "routing": "routing",
    "norms": "norms, residual",
    "optimizer": "optimizer",
    "rest": "the rest",
}
#: the ledger's FLOP parts in each part (the ledger counts no head, optimizer or embedding)
LEDGER_PARTS = {
    "moe": ("experts",),
    "attention": ("attention_scores",),
    "projections": ("attention",),
    "routing": ("router",),
    "norms": ("norms", "final_norm"),
}

#: op-name prefixes that are a part wherever they run (the custom op with autograd, and
#: the native op a no-grad forward dispatches to directly)
OPS = {"smelt::moe_ffn": "moe", "smelt_cpu::moe_ffn": "moe"}
#: top-level events outside the model
NAMED = {"Optimizer.": "optimizer", "torch::autograd::AccumulateGrad": "optimizer"}


def scopes(model) -> dict[torch.nn.Module, str]:
    """Each module of a SmeltLM whose forward is one part's (the innermost scope wins)."""
    out: dict[torch.nn.Module, str] = {model: "head", model.embed: "rest"}
    for m in model.modules():
        if isinstance(m, Block):
            out[m] = "norms"  # the residual adds between the block's children
        elif isinstance(m, RMSNorm):
            out[m] = "norms"
        elif isinstance(m, SegmentAttention):
            out[m] = "attention"
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                out[getattr(m, name)] = "projections"
        elif isinstance(m, MoE):
            out[m] = "routing"  # the expert kernel inside is its own part (OPS)
    out[model.lm_head] = "head"
    return out


def account_step(model, step: Callable[[], Any], steps: int) -> Account:
    """The account of ``steps`` calls of ``step`` (a warmed-up training step or prefill of
    ``model``), with the plain step timed around them."""
    return account(
        step, scopes(model), ops=OPS, named=NAMED, default="rest", steps=steps, parts=PARTS
    )


def gemm_shapes(cfg: ModelConfig, tokens: int, train: bool) -> dict[str, list[tuple]]:
    """Per part, the GEMMs of one step as ``(M, N, K, count)``: C[M, N] = A[M, K] B[K, N],
    ``count`` times; a training step adds each forward GEMM's two backward ones (dA: M x K x
    N, dB: K x N x M). The experts' rows are those of even routing (tokens x top_k / E)."""
    T, H, L = tokens, cfg.hidden_size, cfg.executed_layers
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    rows = max(1, round(tokens * cfg.top_k / cfg.n_experts))
    E, de = cfg.n_experts, cfg.expert_size
    fwd = {
        "projections": [(T, q, H, L), (T, kv, H, 2 * L), (T, H, q, L)],
        "head": [(T, cfg.vocab_size, H, 1)],
        "routing": [(T, E, H, L)],
        "moe": [(rows, 2 * de, H, E * L), (rows, H, de, E * L)],
    }
    if not train:
        return fwd
    return {
        part: [g for (M, N, K, c) in gemms for g in ((M, N, K, c), (M, K, N, c), (K, N, M, c))]
        for part, gemms in fwd.items()
    }


def _best_ms(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def _onednn() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def gemm_ms(M: int, N: int, K: int, repeats: int = 3) -> dict[str, float]:
    """The fastest of ``repeats`` fp32 GEMMs of M x N x K on the CPU, per library: ``mkl``
    (``torch.mm``, ATen's sgemm) and, where torch has it, ``onednn`` (oneDNN's matmul)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(M, K, generator=g)
    b = torch.randn(K, N, generator=g)
    out = {"mkl": _best_ms(lambda: torch.mm(a, b), repeats)}
    if _onednn():
        w = b.t().contiguous()
        out["onednn"] = _best_ms(
            lambda: torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], ""), repeats
        )
    return out


def gemm_reference(shapes: dict[str, list[tuple]], repeats: int = 3) -> dict[str, float]:
    """Per part, the milliseconds its GEMMs take through the faster library at each shape
    (each distinct shape timed once)."""
    seen: dict[tuple, float] = {}
    out = {}
    for part, gemms in shapes.items():
        total = 0.0
        for M, N, K, count in gemms:
            if (M, N, K) not in seen:
                seen[(M, N, K)] = min(gemm_ms(M, N, K, repeats).values())
            total += seen[(M, N, K)] * count
        out[part] = total
    return out


def ceiling(n: int = 2048, repeats: int = 3) -> dict[str, float]:
    """The host's fp32 GEMM rate in GFLOP/s at n^3 on torch's threads, per library, and
    ``best``: the ceiling every part's rate is read against."""
    rates = {k: 2 * n**3 / (ms / 1e3) / 1e9 for k, ms in gemm_ms(n, n, n, repeats).items()}
    rates["best"] = max(rates.values())
    return rates


def median_reference(refs: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the median over blocks."""
    return {k: statistics.median(r[k] for r in refs) for k in refs[0]}
