"""The command line of the ledger: ``python -m smelt_model.budget``.

    python -m smelt_model.budget 200M-S95            # both ledgers side by side, and ratios
    python -m smelt_model.budget 200M-S95-baseline --match
    python -m smelt_model.budget my_baseline.json --match
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from ..config import ModelConfig
from .ledger import Ledger, compare, ledger
from .matcher import MatchError, match

__all__ = ["main"]


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
    from .. import presets

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
    from .. import presets

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
