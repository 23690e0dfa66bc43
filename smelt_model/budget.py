"""The three-budget ledger (FLOPs, parameters, KV cache) and the looped-config matcher.

Every accounting formula lives in this file. The convention reproduces the SMELT paper's
appendix (Wang et al., 2026) for all twelve sparse cells:

* Per layer, non-embedding parameters are
  attention ``2*H*(n_q*d_h) + 2*H*(n_kv*d_h)`` (Q and O, K and V),
  router ``H*E``, two RMSNorm gains ``2*H`` and ``3*H*d_e`` per SwiGLU expert.
  *Active* parameters count ``top_k`` experts, *total* parameters count all ``E``.
  The final RMSNorm (``H``) is added once to both, so the counts equal the model's
  ``num_params()`` exactly. A looped layer's weights count once.
* Training FLOPs per token: ``F = 6*N_exec + 12*L_exec*(n_q*d_h)*c_bar`` where ``N_exec``
  sums active parameters over *executed* layers (span layers ``r`` times) and ``c_bar`` is
  the mean number of keys a query attends to (:func:`mean_attended`).
* KV-cache bytes per token: ``2 * L_exec * n_kv * d_h * bytes_per_element``.
* Compute-equivalent sparsity: ``S = 1 - N_act_eq / N`` with ``N_act_eq = (F/F0) * N0``,
  where ``F0, N0`` belong to a control that activates all of its experts (by default the
  same geometry with ``E = top_k``).

Command line::

    python -m smelt_model.budget 200M-S95            # both ledgers side by side, and ratios
    python -m smelt_model.budget 200M-S95-baseline --match
    python -m smelt_model.budget my_baseline.json --match
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from smelt_kernels.plan import LoopPlan

from .config import LoopSpec, ModelConfig, middle_loop

__all__ = [
    "Ledger",
    "Ratios",
    "layer_params",
    "mean_attended",
    "ledger",
    "compare",
    "match",
    "dense_control",
    "MatchError",
]


class MatchError(ValueError):
    """Raised when no looped configuration fits the tolerances."""


@dataclass(frozen=True)
class Ledger:
    """The budgets of one configuration (all counts non-embedding)."""

    active_params: int
    total_params: int
    flops_per_token: float
    kv_bytes_per_token: int
    executed_layers: int
    sparsity: float
    #: mean number of keys a query attends to (c-bar) used for the attention FLOPs
    mean_attended: float
    #: the attention-score part of ``flops_per_token`` (12 * L_exec * n_q * d_h * c_bar)
    attention_flops_per_token: float


@dataclass(frozen=True)
class Ratios:
    """Looped / baseline ratios of the three budgets."""

    flops: float
    params: float
    kv: float

    def worst(self) -> float:
        return max(abs(self.flops - 1), abs(self.params - 1), abs(self.kv - 1))

    def within(self, tolerances: Sequence[float]) -> bool:
        tf, tp, tk = tolerances
        return abs(self.flops - 1) <= tf and abs(self.params - 1) <= tp and abs(self.kv - 1) <= tk


def layer_params(cfg: ModelConfig) -> dict[str, int]:
    """Parameters of one physical layer, by part."""
    h = cfg.hidden_size
    return {
        "attention": 2 * h * cfg.q_dim + 2 * h * cfg.kv_dim,
        "router": h * cfg.n_experts,
        "norms": 2 * h,
        "experts_active": cfg.top_k * 3 * h * cfg.expert_size,
        "experts_total": cfg.n_experts * 3 * h * cfg.expert_size,
    }


def mean_attended(mean_doc_len: float, seq_len: int) -> float:
    """Mean number of keys a query attends to (``c_bar``), causal inside documents.

    Documents of length ``l = min(mean_doc_len, seq_len)`` are packed into a context of
    ``seq_len`` tokens; the last one is cut at the context end. A query at position ``p``
    of its document attends to ``p + 1`` keys, so a document contributes ``l(l+1)/2``.
    With the paper's 800-token documents in 4096-token contexts, ``c_bar`` is about 392
    (the paper's tables fit 400).
    """
    if not (isinstance(seq_len, int) and seq_len >= 1):
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    if not (mean_doc_len > 0 and math.isfinite(mean_doc_len)):
        raise ValueError(f"mean_doc_len must be positive and finite, got {mean_doc_len!r}")
    doc = min(float(mean_doc_len), float(seq_len))
    full = int(seq_len // doc)
    rest = seq_len - full * doc
    total = full * doc * (doc + 1) / 2 + rest * (rest + 1) / 2
    return total / seq_len


def dense_control(cfg: ModelConfig) -> ModelConfig:
    """The same geometry with every expert active (E = top_k): the S = 0 control."""
    return cfg.replace(n_experts=cfg.top_k)


def _raw(cfg: ModelConfig, c_bar: float, kv_dtype_bytes: int) -> tuple[int, int, float, float, int]:
    p = layer_params(cfg)
    shared = p["attention"] + p["router"] + p["norms"]
    active_layer = shared + p["experts_active"]
    total_layer = shared + p["experts_total"]
    final_norm = cfg.hidden_size
    l_exec = cfg.executed_layers
    active = cfg.n_layers * active_layer + final_norm
    total = cfg.n_layers * total_layer + final_norm
    n_exec = l_exec * active_layer + final_norm
    attn = 12.0 * l_exec * cfg.q_dim * c_bar
    flops = 6.0 * n_exec + attn
    kv = 2 * l_exec * cfg.kv_dim * kv_dtype_bytes
    return active, total, flops, attn, kv


def ledger(
    cfg: ModelConfig,
    mean_doc_len: float = 800,
    seq_len: int = 4096,
    kv_dtype_bytes: int = 2,
    control: Optional[ModelConfig] = None,
) -> Ledger:
    """The budgets of ``cfg``; ``control`` (default :func:`dense_control`) sets the sparsity."""
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    if not (isinstance(kv_dtype_bytes, int) and kv_dtype_bytes >= 1):
        raise ValueError(f"kv_dtype_bytes must be a positive int, got {kv_dtype_bytes!r}")
    c_bar = mean_attended(mean_doc_len, seq_len)
    active, total, flops, attn, kv = _raw(cfg, c_bar, kv_dtype_bytes)
    ctrl = dense_control(cfg) if control is None else control
    if not isinstance(ctrl, ModelConfig):
        raise TypeError(f"control must be a ModelConfig, got {type(ctrl).__name__}")
    _, n0, f0, _, _ = _raw(ctrl, c_bar, kv_dtype_bytes)
    sparsity = 1.0 - (flops / f0) * n0 / total
    return Ledger(
        active_params=active,
        total_params=total,
        flops_per_token=flops,
        kv_bytes_per_token=kv,
        executed_layers=cfg.executed_layers,
        sparsity=sparsity,
        mean_attended=c_bar,
        attention_flops_per_token=attn,
    )


def compare(
    baseline_cfg: ModelConfig,
    looped_cfg: ModelConfig,
    mean_doc_len: float = 800,
    seq_len: int = 4096,
) -> Ratios:
    """Looped / baseline ratios of training FLOPs, total params and KV bytes per token."""
    a = ledger(baseline_cfg, mean_doc_len, seq_len)
    b = ledger(looped_cfg, mean_doc_len, seq_len)
    return Ratios(
        flops=b.flops_per_token / a.flops_per_token,
        params=b.total_params / a.total_params,
        kv=b.kv_bytes_per_token / a.kv_bytes_per_token,
    )


# ---------------------------------------------------------------------------- matcher
def _round_to(x: float, multiple: int) -> list[int]:
    lo = max(multiple, int(math.floor(x / multiple)) * multiple)
    return sorted({lo, lo + multiple})


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
    mismatch wins (ties: the widest hidden size, then the fewest experts).

    Returns ``(config, ratios)``; raises :class:`MatchError` when nothing fits.
    """
    if not isinstance(baseline_cfg, ModelConfig):
        raise TypeError(f"baseline_cfg must be a ModelConfig, got {type(baseline_cfg).__name__}")
    if baseline_cfg.is_looped:
        raise ValueError("baseline_cfg is already looped; pass the unlooped baseline")
    for name, m in (("head_dim_multiple", head_dim_multiple),
                    ("expert_size_multiple", expert_size_multiple),
                    ("expert_count_multiple", expert_count_multiple)):
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
    l_exec = LoopPlan(baseline_cfg.n_layers, loop).executed_layers

    c_bar = mean_attended(mean_doc_len, seq_len)
    base = ledger(baseline_cfg, mean_doc_len, seq_len)
    L = baseline_cfg.n_layers
    k = baseline_cfg.top_k
    tf, tp, tk = tolerances
    base_kv_unit = base.kv_bytes_per_token / (2 * 2)  # = L * n_kv * d_h
    kv_choices = (baseline_cfg.n_kv_heads,) if kv_heads is None else tuple(kv_heads)
    if not kv_choices or any(not isinstance(n, int) or n < 1 for n in kv_choices):
        raise ValueError(f"kv_heads must be positive ints, got {kv_heads!r}")
    H0 = baseline_cfg.hidden_size

    best: Optional[tuple[tuple[float, int, int], ModelConfig, Ratios]] = None
    e_lo = max(k, baseline_cfg.n_experts)
    e_lo = -(-e_lo // expert_count_multiple) * expert_count_multiple
    e_hi = 4 * baseline_cfg.n_experts
    for n_kv in kv_choices:
        # KV: l_exec * n_kv * d_h must be within tk of the baseline's L * n_kv * d_h.
        for d_h in range(head_dim_multiple, baseline_cfg.head_dim + 1, head_dim_multiple):
            kv_ratio = l_exec * n_kv * d_h / base_kv_unit
            if abs(kv_ratio - 1) > tk:
                continue
            for n_q in range(n_kv, 4 * H0 // d_h + 1, n_kv):
                H = n_q * d_h
                if H > H0 or H < H0 // 2:
                    continue
                attn_layer = 2 * H * H + 2 * H * n_kv * d_h
                for E in range(e_lo, e_hi + 1, expert_count_multiple):
                    fixed = L * (attn_layer + H * E + 2 * H) + H
                    per_de = L * E * 3 * H
                    de_exact = (base.total_params - fixed) / per_de
                    if de_exact <= 0:
                        continue
                    for d_e in _round_to(de_exact, expert_size_multiple):
                        total = fixed + per_de * d_e
                        p_ratio = total / base.total_params
                        if abs(p_ratio - 1) > tp:
                            continue
                        active_layer = attn_layer + H * E + 2 * H + k * 3 * H * d_e
                        flops = 6.0 * (l_exec * active_layer + H) + 12.0 * l_exec * H * c_bar
                        f_ratio = flops / base.flops_per_token
                        if abs(f_ratio - 1) > tf:
                            continue
                        r = Ratios(flops=f_ratio, params=p_ratio, kv=kv_ratio)
                        key = (round(r.worst(), 9), -H, E)
                        if best is None or key < best[0]:
                            cfg = baseline_cfg.replace(
                                hidden_size=H,
                                n_heads=n_q,
                                n_kv_heads=n_kv,
                                head_dim=d_h,
                                n_experts=E,
                                expert_size=d_e,
                                loop=loop,
                            )
                            best = (key, cfg, r)
    if best is None:
        raise MatchError(
            f"no looped config within tolerances (flops {tf}, params {tp}, kv {tk}) for "
            f"baseline {baseline_cfg.describe()} with loop {loop}; widen the tolerances or "
            f"the search (head_dim_multiple, expert_size_multiple, kv_heads; at the command "
            f"line --tolerances, --head-dim-multiple, --expert-size-multiple, --kv-heads)"
        )
    _, cfg, _ = best
    return cfg, compare(baseline_cfg, cfg, mean_doc_len, seq_len)


# ---------------------------------------------------------------------------- command line
def _format_side_by_side(names: Sequence[str], ledgers: Sequence[Ledger], cfgs) -> str:
    rows = [
        ("geometry", [c.describe() for c in cfgs], None),
        ("active params", [f"{x.active_params / 1e9:.4f} B" for x in ledgers], "active_params"),
        ("total params", [f"{x.total_params / 1e9:.4f} B" for x in ledgers], "total_params"),
        ("train FLOPs / token", [f"{x.flops_per_token:.4e}" for x in ledgers], "flops_per_token"),
        ("KV bytes / token", [f"{x.kv_bytes_per_token}" for x in ledgers], "kv_bytes_per_token"),
        ("executed layers", [f"{x.executed_layers}" for x in ledgers], "executed_layers"),
        ("sparsity S", [f"{x.sparsity:.4f}" for x in ledgers], None),
        ("c_bar", [f"{x.mean_attended:.1f}" for x in ledgers], None),
    ]
    out = []
    w0 = max(len(r[0]) for r in rows)
    if len(ledgers) == 2:
        out.append(f"{'':{w0}}  {names[0]:>18}  {names[1]:>18}  {'ratio':>7}")
    for label, vals, field in rows:
        if label == "geometry":
            for n, v in zip(names, vals):
                out.append(f"{n}: {v}")
            continue
        line = f"{label:{w0}}  " + "  ".join(f"{v:>18}" for v in vals)
        if field is not None and len(ledgers) == 2:
            a, b = getattr(ledgers[0], field), getattr(ledgers[1], field)
            line += f"  {b / a:7.4f}"
        out.append(line)
    return "\n".join(out)


def _load_config(spec: str) -> ModelConfig:
    """A preset name or a JSON config file; ValueError/OSError with a clear message."""
    from . import presets

    if spec in presets.names():
        return presets.get(spec)
    path = Path(spec)
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise FileNotFoundError(f"no such config file: {spec}")
        try:
            return ModelConfig.from_json(path)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{spec}: {e}" if not str(e).startswith(spec) else str(e)) from None
    raise ValueError(
        f"unknown preset or config file {spec!r}; presets: {', '.join(presets.names())}"
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    from . import presets

    ap = argparse.ArgumentParser(
        prog="python -m smelt_model.budget",
        description="Print the FLOPs / params / KV ledger of a matched pair, or match a baseline.",
    )
    ap.add_argument(
        "config",
        help="a pair name (e.g. 200M-S95), a preset (e.g. 200M-S95-baseline) or a JSON config",
    )
    ap.add_argument("--match", action="store_true", help="search a looped config for the baseline")
    ap.add_argument("--mean-doc-len", type=float, default=800)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument(
        "--tolerances", type=float, nargs=3, default=(0.04, 0.01, 0.04), metavar=("F", "N", "KV")
    )
    ap.add_argument("--head-dim-multiple", type=int, default=8,
                    help="--match: head sizes tried are multiples of this")
    ap.add_argument("--expert-size-multiple", type=int, default=8,
                    help="--match: expert sizes tried are multiples of this")
    ap.add_argument("--kv-heads", type=int, nargs="+",
                    help="--match: KV-head counts to try (default: the baseline's)")
    args = ap.parse_args(argv)

    try:
        if args.config in presets.pairs():
            base, looped = presets.pair(args.config)
            names = [f"{args.config}-baseline", f"{args.config}-smelt"]
        else:
            base = _load_config(args.config)
            looped = None
            names = [args.config]
        if args.match:
            looped, _ = match(
                base, tolerances=args.tolerances, mean_doc_len=args.mean_doc_len,
                seq_len=args.seq_len, head_dim_multiple=args.head_dim_multiple,
                expert_size_multiple=args.expert_size_multiple, kv_heads=args.kv_heads,
            )
            names = [names[0], "matched-smelt"]
        cfgs = [base] if looped is None else [base, looped]
        leds = [ledger(c, args.mean_doc_len, args.seq_len) for c in cfgs]
    except MatchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (OSError, TypeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(_format_side_by_side(names, leds, cfgs))
    if looped is not None:
        r = compare(base, looped, args.mean_doc_len, args.seq_len)
        print(f"\nratios (looped / baseline): F {r.flops:.4f}  N {r.params:.4f}  KV {r.kv:.4f}")
        if args.match:
            print("\nmatched config (JSON):")
            print(looped.to_json())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
