"""The command line of the ledger: ``python -m smelt_model.budget``.

    python -m smelt_model.budget 200M-S95            # both ledgers and communication, ratios
    python -m smelt_model.budget 200M-S95 --ep 8 --dp-shard 64 --tokens-per-step 2097152
    python -m smelt_model.budget 200M-S95 --cluster h100-8 --cluster h100-64,ep=16
    python -m smelt_model.budget 200M-S95-baseline --match
    python -m smelt_model.budget my_baseline.json --match

Without ``--cluster`` the communication ledger (:mod:`.comm`) follows the three budgets:
bytes per step and rank at ``--tokens-per-step`` (default 32768 per data-parallel rank),
``--ep`` (default: the largest of 8, 4, 2, 1 that divides every model's expert count and
``--dp-shard``) and ``--dp-shard`` (default 8). With ``--cluster SPEC`` (repeatable; see
:mod:`.cluster`) it prints the projected step times on each cluster instead.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from smelt_tools.cli import Parser

from ..config import ModelConfig
from .cluster import TOKENS_PER_GPU, parse_cluster, project, project_pair
from .comm import Comm, comm, ratios
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


def _bytes(x: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f} ms"


def _table(names: Sequence[str], rows) -> list[str]:
    """Rows of (label, values, format): one column per model, a ratio column for a pair."""
    w0 = max(len(r[0]) for r in rows)
    out = [
        f"{'':{w0}}  "
        + "  ".join(f"{n:>18}" for n in names)
        + ("  {:>7}".format("ratio") if len(names) == 2 else "")
    ]
    for label, vals, fmt in rows:
        line = f"{label:{w0}}  " + "  ".join(f"{fmt(v):>18}" for v in vals)
        if len(vals) == 2:
            line += f"  {vals[1] / vals[0]:7.4f}" if vals[0] else f"  {'-':>7}"
        out.append(line)
    return out


def _format_comm(names: Sequence[str], comms: Sequence[Comm]) -> str:
    c0 = comms[0]
    head = (
        f"communication per step and rank: {c0.tokens_per_step} tokens per step "
        f"({c0.tokens_per_rank} per rank), ep {c0.ep}, dp_shard {c0.dp_shard} (efsdp "
        f"{c0.efsdp}), {c0.dtype}, gradients reduced in {c0.reduce_dtype}; uniform routing"
    )
    get = lambda attr: [getattr(c, attr) for c in comms]  # noqa: E731
    rows = [
        ("executed MoE layers", get("moe_layers"), str),
        ("EP dispatch, forward", get("dispatch_forward"), _bytes),
        ("EP combine, forward", get("combine_forward"), _bytes),
        ("EP dispatch, backward", get("dispatch_backward"), _bytes),
        ("EP combine, backward", get("combine_backward"), _bytes),
        ("EP all-to-alls", get("ep_bytes"), _bytes),
        ("EP bytes / token", get("ep_bytes_per_token"), _bytes),
        ("FSDP all-gather, forward", get("fsdp_all_gather_forward"), _bytes),
        ("FSDP all-gather, backward", get("fsdp_all_gather_backward"), _bytes),
        ("FSDP reduce-scatter", get("fsdp_reduce_scatter"), _bytes),
        ("FSDP", get("fsdp_bytes"), _bytes),
        ("all communication", get("total_bytes"), _bytes),
    ]
    return "\n".join([head] + _table(names, rows))


def _format_projection(spec: str, names: Sequence[str], projections, pair) -> str:
    p0 = projections[0]
    c0 = p0.comm
    lines = [
        f"projected step on {spec}: {p0.cluster.describe()}",
        f"{c0.tokens_per_step} tokens per step ({c0.tokens_per_rank} per GPU), {c0.dtype}; "
        f"a model on paper, not a measurement",
    ]
    get = lambda attr: [getattr(p, attr) for p in projections]  # noqa: E731
    rows = [
        ("compute", get("compute_s"), _ms),
        ("EP all-to-alls", [p.comm.ep_bytes for p in projections], _bytes),
        ("EP time", get("ep_s"), _ms),
        ("FSDP", [p.comm.fsdp_bytes for p in projections], _bytes),
        ("FSDP time", get("fsdp_s"), _ms),
        ("step, serial", get("serial_s"), _ms),
        ("step, FSDP overlapped", get("fsdp_overlapped_s"), _ms),
        ("step, all overlapped", get("overlapped_s"), _ms),
    ]
    lines += _table(names, rows)
    if pair is not None:
        lines.append(
            f"gap (step ratio / F ratio {pair.flops_ratio:.4f}): serial "
            f"{pair.gap('serial'):.4f}  FSDP overlapped "
            f"{pair.gap('fsdp_overlapped'):.4f}  all overlapped "
            f"{pair.gap('overlapped'):.4f}"
        )
    return "\n".join(lines)


def _default_ep(cfgs, dp_shard: int) -> int:
    return next(
        ep for ep in (8, 4, 2, 1) if dp_shard % ep == 0 and all(c.n_experts % ep == 0 for c in cfgs)
    )


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


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return v


def _parser() -> argparse.ArgumentParser:
    ap = Parser(
        prog="python -m smelt_model.budget",
        description="Print the FLOPs / params / KV ledger and the communication ledger of a "
        "matched pair, project its step time on a cluster, or match a baseline.",
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
    ap.add_argument(
        "--head-dim-multiple",
        type=int,
        default=8,
        help="--match: head sizes tried are multiples of this",
    )
    ap.add_argument(
        "--expert-size-multiple",
        type=int,
        default=8,
        help="--match: expert sizes tried are multiples of this",
    )
    ap.add_argument(
        "--kv-heads",
        type=int,
        nargs="+",
        help="--match: KV-head counts to try (default: the baseline's)",
    )
    ap.add_argument(
        "--tokens-per-step",
        type=_positive,
        help=f"global batch in tokens (default {TOKENS_PER_GPU} per data-parallel rank or GPU)",
    )
    ap.add_argument(
        "--ep",
        type=_positive,
        help="expert-parallel degree (default: the largest of 8, 4, 2, 1 dividing "
        "every expert count and --dp-shard); with --cluster, set ep in SPEC",
    )
    ap.add_argument(
        "--dp-shard",
        type=_positive,
        help="data-parallel (FSDP) ranks (default 8); with --cluster, set gpus in SPEC",
    )
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        help="dtype of the all-to-alls and the gathered parameters (default bfloat16)",
    )
    ap.add_argument(
        "--cluster",
        action="append",
        metavar="SPEC",
        help="project step times on a cluster: a preset (h100-8, h100-64) and/or "
        "key=value pairs gpus,gpus_per_node,intra,inter,peak,mfu,ep; repeatable",
    )
    return ap


def _configs(args) -> tuple[list[str], ModelConfig, Optional[ModelConfig]]:
    """(column names, baseline or single config, looped config or None) from the command."""
    from .. import presets

    if args.config in presets.pairs():
        base, looped = presets.pair(args.config)
        names = [f"{args.config}-baseline", f"{args.config}-smelt"]
    else:
        base, looped, names = _load_config(args.config), None, [args.config]
    if args.match:
        looped, _ = match(
            base,
            tolerances=args.tolerances,
            mean_doc_len=args.mean_doc_len,
            seq_len=args.seq_len,
            head_dim_multiple=args.head_dim_multiple,
            expert_size_multiple=args.expert_size_multiple,
            kv_heads=args.kv_heads,
        )
        names = [names[0], "matched-smelt"]
    return names, base, looped


def _projections(args, names, base, looped) -> str:
    if args.ep is not None or args.dp_shard is not None:
        raise ValueError(
            "with --cluster, give ep and gpus in the cluster SPEC, not --ep / --dp-shard"
        )
    kw = dict(dtype=args.dtype, mean_doc_len=args.mean_doc_len, seq_len=args.seq_len)
    blocks = []
    for spec in args.cluster:
        cl = parse_cluster(spec)
        if looped is None:
            pair, projs = None, [project(base, cl, args.tokens_per_step, **kw)]
        else:
            pair = project_pair(base, looped, cl, args.tokens_per_step, **kw)
            projs = [pair.baseline, pair.looped]
        blocks.append(_format_projection(spec, names, projs, pair))
    return "\n\n".join(blocks)


def _ledgers(args, names, base, looped) -> str:
    """The three budgets, the communication ledger and their ratios (and a match's JSON)."""
    cfgs = [base] if looped is None else [base, looped]
    leds = [ledger(c, args.mean_doc_len, args.seq_len) for c in cfgs]
    dp_shard = 8 if args.dp_shard is None else args.dp_shard
    ep = _default_ep(cfgs, dp_shard) if args.ep is None else args.ep
    tokens = TOKENS_PER_GPU * dp_shard if args.tokens_per_step is None else args.tokens_per_step
    kw = dict(ep=ep, dp_shard=dp_shard, dtype=args.dtype)
    comms = [comm(c, tokens, **kw) for c in cfgs]
    out = [_format_side_by_side(names, leds, cfgs)]
    if looped is not None:
        r = compare(base, looped, args.mean_doc_len, args.seq_len)
        out.append(
            f"\nratios (looped / baseline): F {r.flops:.4f}  N {r.params:.4f}  KV {r.kv:.4f}"
        )
    out.append("\n" + _format_comm(names, comms))
    if looped is not None:
        cr = ratios(
            base, looped, tokens, mean_doc_len=args.mean_doc_len, seq_len=args.seq_len, **kw
        )
        parts = [
            f"{label} {'-' if v is None else f'{v:.4f}'}"
            for label, v in (("EP", cr.ep), ("FSDP", cr.fsdp), ("all", cr.total))
        ]
        out.append(
            f"\ncommunication ratios (looped / baseline): {'  '.join(parts)}  (F {cr.flops:.4f})"
        )
    if args.match:
        out.append("\nmatched config (JSON):\n" + looped.to_json())
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = _parser().parse_args(argv)
        names, base, looped = _configs(args)
        if args.cluster:
            text = _projections(args, names, base, looped)
        else:
            text = _ledgers(args, names, base, looped)
    except MatchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (OSError, TypeError, ValueError) as e:  # a UsageError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0
