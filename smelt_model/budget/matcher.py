"""The matcher: a looped configuration matched to a baseline on all three budgets."""

from __future__ import annotations

import math
from typing import Optional, Sequence

from smelt_model.budget.ledger import (
    Ratios,
    compare,
    layer_counts,
    ledger,
    mean_attended,
    shared_params,
    train_flops,
)
from smelt_model.config import LoopSpec, ModelConfig, middle_loop
from smelt_model.schedule import LoopSchedule

__all__ = ["MatchError", "match", "preference"]


class MatchError(ValueError):
    """Raised when no looped configuration fits the tolerances."""


def _round_to(x: float, multiple: int) -> list[int]:
    lo = max(multiple, int(math.floor(x / multiple)) * multiple)
    return sorted({lo, lo + multiple})


def preference(ratios: Ratios, hidden_size: int, n_experts: int) -> tuple[float, int, int]:
    """How :func:`match` ranks the configs within the tolerances, smallest first: the worst
    mismatch of the three ratios, then the widest hidden size, then the fewest experts."""
    return (round(ratios.worst(), 9), -hidden_size, n_experts)


def _check_search(baseline_cfg, loop, tolerances, multiples, kv_heads) -> tuple:
    """The search's settings checked (one ValueError or TypeError naming the argument):
    ``(loop, kv_choices)`` with the defaults filled in."""
    if not isinstance(baseline_cfg, ModelConfig):
        raise TypeError(f"baseline_cfg must be a ModelConfig, got {type(baseline_cfg).__name__}")
    if baseline_cfg.is_looped:
        raise ValueError("baseline_cfg is already looped; pass the unlooped baseline")
    for name, m in multiples.items():
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"{name} must be a positive int, got {m!r}")
    if len(tolerances) != 3 or any(not (t > 0) for t in tolerances):
        raise ValueError(f"tolerances must be three positive numbers, got {tolerances!r}")
    if loop is None:
        loop = middle_loop(baseline_cfg.n_layers)
    if not isinstance(loop, LoopSpec):
        raise TypeError(f"loop must be a LoopSpec or None, got {type(loop).__name__}")
    if loop.end > baseline_cfg.n_layers:
        raise ValueError(f"loop {loop} lies outside the baseline's {baseline_cfg.n_layers} layers")
    kv_choices = (baseline_cfg.n_kv_heads,) if kv_heads is None else tuple(kv_heads)
    if not kv_choices or any(not isinstance(n, int) or n < 1 for n in kv_choices):
        raise ValueError(f"kv_heads must be positive ints, got {kv_heads!r}")
    return loop, kv_choices


def _shapes(baseline_cfg, kv_choices, tk, l_exec, head_dim_multiple):
    """(n_kv, d_h, n_q, kv ratio) of the attention shapes whose KV ratio is within ``tk``
    and whose hidden size ``n_q x d_h`` lies between half the baseline's and the
    baseline's."""
    H0 = baseline_cfg.hidden_size
    for n_kv in kv_choices:
        # KV bytes are proportional to L_exec * n_kv * d_h (the element size cancels)
        for d_h in range(head_dim_multiple, baseline_cfg.head_dim + 1, head_dim_multiple):
            kv_ratio = l_exec * n_kv * d_h / (baseline_cfg.executed_layers * baseline_cfg.kv_dim)
            if abs(kv_ratio - 1) > tk:
                continue
            for n_q in range(n_kv, 4 * H0 // d_h + 1, n_kv):
                if H0 // 2 <= n_q * d_h <= H0:
                    yield n_kv, d_h, n_q, kv_ratio


def _candidates(baseline_cfg, loop, tolerances, kv_choices, doc, multiples):
    """Every (ratios, hidden size, n_q, n_kv, d_h, experts, d_e) the search tries whose
    three ratios lie within ``tolerances``; ``doc`` is (mean_doc_len, seq_len)."""
    base = ledger(baseline_cfg, *doc)
    c_bar = mean_attended(*doc)
    L, k = baseline_cfg.n_layers, baseline_cfg.top_k
    tf, tp, tk = tolerances
    l_exec = LoopSchedule(L, loop).executed_layers
    e_step = multiples["expert_count_multiple"]
    e_lo = -(-max(k, baseline_cfg.n_experts) // e_step) * e_step
    shapes = _shapes(baseline_cfg, kv_choices, tk, l_exec, multiples["head_dim_multiple"])
    for n_kv, d_h, n_q, kv_ratio in shapes:
        H = n_q * d_h
        for E in range(e_lo, 4 * baseline_cfg.n_experts + 1, e_step):
            # total params are linear in d_e: solve for it, then try its neighbours
            fixed = L * shared_params(layer_counts(H, H, n_kv * d_h, E, 0, k)) + H
            per_de = L * layer_counts(H, H, n_kv * d_h, E, 1, k)["experts_total"]
            de_exact = (base.total_params - fixed) / per_de
            if de_exact <= 0:
                continue
            for d_e in _round_to(de_exact, multiples["expert_size_multiple"]):
                p = layer_counts(H, H, n_kv * d_h, E, d_e, k)
                p_ratio = (L * (shared_params(p) + p["experts_total"]) + H) / base.total_params
                if abs(p_ratio - 1) > tp:
                    continue
                executed = l_exec * (shared_params(p) + p["experts_active"]) + H
                flops, _ = train_flops(executed, l_exec, H, c_bar)
                f_ratio = flops / base.flops_per_token
                if abs(f_ratio - 1) <= tf:
                    r = Ratios(flops=f_ratio, params=p_ratio, kv=kv_ratio)
                    yield r, H, n_q, n_kv, d_h, E, d_e


def match(
    baseline_cfg: ModelConfig,
    loop: Optional[LoopSpec] = None,
    tolerances: Sequence[float] = (0.04, 0.01, 0.04),
    *,
    mean_doc_len: float = 800,
    seq_len: int = 4096,
    head_dim_multiple: int = 8,
    expert_size_multiple: int = 8,
    expert_count_multiple: int = 8,
    kv_heads: Optional[Sequence[int]] = None,
) -> tuple[ModelConfig, Ratios]:
    """Find a looped config matched to ``baseline_cfg`` on FLOPs, params and KV bytes.

    The search follows the paper's recipe: the looped model keeps the physical depth and
    ``top_k``; KV bytes are matched by a smaller head size and/or fewer KV heads, FLOPs by a
    narrower hidden size ``H = n_q * d_h`` (query heads fill H), and params by more experts
    and a re-sized expert intermediate dimension. Head dims, expert sizes and expert counts
    are kept hardware-aligned (multiples of 8 by default); head dims are at most the
    baseline's, expert counts at least the baseline's, and the KV-head counts tried are
    ``kv_heads`` (default: the baseline's, as in the paper). Among the configs whose three
    ratios lie within ``tolerances = (flops, params, kv)``, the one with the smallest worst
    mismatch wins (ties: the widest hidden size, then the fewest experts: :func:`preference`).

    Returns ``(config, ratios)``; raises :class:`MatchError` when nothing fits.
    """
    multiples = {
        "head_dim_multiple": head_dim_multiple,
        "expert_size_multiple": expert_size_multiple,
        "expert_count_multiple": expert_count_multiple,
    }
    loop, kv_choices = _check_search(baseline_cfg, loop, tolerances, multiples, kv_heads)
    doc = (mean_doc_len, seq_len)
    best: Optional[tuple[tuple[float, int, int], tuple]] = None
    for found in _candidates(baseline_cfg, loop, tolerances, kv_choices, doc, multiples):
        r, H, _, _, _, E, _ = found
        key = preference(r, H, E)
        if best is None or key < best[0]:
            best = (key, found)
    if best is None:
        tf, tp, tk = tolerances
        raise MatchError(
            f"no looped config within tolerances (flops {tf}, params {tp}, kv {tk}) for "
            f"baseline {baseline_cfg.describe()} with loop {loop}; widen the tolerances or "
            f"the search (head_dim_multiple, expert_size_multiple, kv_heads; at the command "
            f"line --tolerances, --head-dim-multiple, --expert-size-multiple, --kv-heads)"
        )
    _, H, n_q, n_kv, d_h, E, d_e = best[1]
    cfg = baseline_cfg.replace(
        hidden_size=H,
        n_heads=n_q,
        n_kv_heads=n_kv,
        head_dim=d_h,
        n_experts=E,
        expert_size=d_e,
        loop=loop,
    )
    return cfg, compare(baseline_cfg, cfg, mean_doc_len, seq_len)
