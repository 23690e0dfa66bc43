"""The command line of the ledger: ``smelt-budget`` (or ``python -m smelt_model.budget``).

    smelt-budget 200M-S95                      # both ledgers and communication, ratios
    smelt-budget 200M-S95 --ep 8 --dp-shard 64 --tokens-per-step 2097152
    smelt-budget 200M-S95 --ep 8 --plan span-gather    # the bytes under a parallel plan
    smelt-budget 200M-S95 --cluster h100-8 --cluster h100-64,ep=16
    smelt-budget 1.6B-S97 --cluster h100-8 --cluster h100-64 --plot runs/steps.png
    smelt-budget 200M-S95-baseline --match
    smelt-budget my_baseline.json --match

Without ``--cluster`` the communication ledger (:mod:`smelt_model.cluster.comm`) follows
the three budgets: bytes per step and rank at ``--tokens-per-step`` (default 32768 per
data-parallel rank), ``--ep`` (default: the largest of 8, 4, 2, 1 that divides every
model's expert count and ``--dp-shard``) and ``--dp-shard`` (default 8), under torchtitan's
stock layout or ``--plan``. With ``--cluster SPEC`` (repeatable; see
:mod:`smelt_model.cluster.spec`) it prints, per cluster, each architecture's best plan (or
``--plan``) beside torchtitan's stock layout, their bytes, memory and projected step times,
and the gap (:mod:`smelt_model.cluster.projection`); ``--plot PATH`` also draws each
model's projected step per cluster, split into compute and the exposed traffic, with the
step the looped model would need for a gap of 1.00. This module reads the options and
prints the three budgets; the cluster's tables and the plot are
:mod:`smelt_model.cluster.report`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence

from smelt_model import plotting, presets
from smelt_model.budget.ledger import Ledger, compare, ledger
from smelt_model.budget.matcher import match, preference
from smelt_model.cluster import report
from smelt_model.cluster.layout import PLAN_NAMES, parse_plan
from smelt_model.cluster.spec import TOKENS_PER_GPU, parse_cluster
from smelt_model.cluster.workload import Workload
from smelt_model.config import ModelConfig
from smelt_tools import cli

__all__ = ["PROG", "main"]

PROG = "smelt-budget"


def _format_side_by_side(names: Sequence[str], ledgers: Sequence[Ledger], cfgs) -> str:
    rows = [
        ("active params", [f"{x.active_params / 1e9:.4f} B" for x in ledgers], "active_params"),
        ("total params", [f"{x.total_params / 1e9:.4f} B" for x in ledgers], "total_params"),
        ("train FLOPs / token", [f"{x.flops_per_token:.4e}" for x in ledgers], "flops_per_token"),
        ("KV bytes / token", [f"{x.kv_bytes_per_token}" for x in ledgers], "kv_bytes_per_token"),
        ("executed layers", [f"{x.executed_layers}" for x in ledgers], "executed_layers"),
        ("sparsity S", [f"{x.sparsity:.4f}" for x in ledgers], None),
        ("c_bar", [f"{x.mean_attended:.1f}" for x in ledgers], None),
    ]
    w0 = max(len(r[0]) for r in rows)
    out = []
    if len(ledgers) == 2:
        out.append(f"{'':{w0}}  {names[0]:>18}  {names[1]:>18}  {'ratio':>7}")
    out += [f"{n}: {c.describe()}" for n, c in zip(names, cfgs)]
    for label, vals, field in rows:
        line = f"{label:{w0}}  " + "  ".join(f"{v:>18}" for v in vals)
        if field is not None and len(ledgers) == 2:
            a, b = getattr(ledgers[0], field), getattr(ledgers[1], field)
            line += f"  {b / a:7.4f}"
        out.append(line)
    return "\n".join(out)


def _default_ep(cfgs, dp_shard: int) -> int:
    return next(
        ep for ep in (8, 4, 2, 1) if dp_shard % ep == 0 and all(c.n_experts % ep == 0 for c in cfgs)
    )


def _preset_names(spec: str) -> Optional[tuple[str, ...]]:
    """The presets ``spec`` names in any case, spelt as the presets spell them (a pair name
    gives its two models); None for anything else (a config file)."""
    try:
        return presets.resolve(spec)
    except presets.PresetError:
        return None


def _load_config(spec: str) -> ModelConfig:
    """A JSON config file (a name that is neither a preset nor a file is refused)."""
    path = Path(spec)
    if path.suffix != ".json" and not path.exists():
        known = presets.pairs() + presets.names()
        raise cli.unknown("pair or preset", spec, known)
    if not path.is_file():
        raise cli.CommandError(f"{spec}: no such config file")
    try:
        return ModelConfig.from_json(path)
    except (TypeError, ValueError) as e:
        raise cli.CommandError(str(e) if str(e).startswith(spec) else f"{spec}: {e}") from None


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return v


def _parser() -> cli.Parser:
    ap = cli.Parser(
        prog=PROG,
        description="Print the FLOPs / params / KV ledger and the communication ledger of a "
        "matched pair, project its step time on a cluster at each architecture's best "
        "parallel plan, or match a baseline.",
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
        "--head-dim-multiple", type=int, default=8, help="--match: head sizes tried are multiples"
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
        "--gpus-per-node",
        type=_positive,
        default=8,
        help="ranks per node, the gather group of a plan's 'node' (default 8); with --cluster, "
        "set gpus_per_node in SPEC",
    )
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        help="dtype of the all-to-alls and the gathered parameters (default bfloat16)",
    )
    ap.add_argument(
        "--plan",
        help=f"the parallel plan: {', '.join(PLAN_NAMES)} or one ep/gather per layer, comma "
        f"separated; with --cluster also auto (the default: each architecture's best)",
    )
    ap.add_argument(
        "--cluster",
        action="append",
        metavar="SPEC",
        help="project step times on a cluster: a preset (h100-8, h100-64) and/or "
        "key=value pairs gpus,gpus_per_node,intra,inter,peak,mfu,ep,memory; repeatable",
    )
    ap.add_argument(
        "--plot",
        metavar="PATH",
        help="with --cluster: draw each model's projected step per cluster (.png, .pdf, .svg, "
        "in a folder that exists; needs matplotlib)",
    )
    return ap


def _configs(args) -> tuple[list[str], list[ModelConfig]]:
    """(column names, configs) from the command: one config, a pair, or a matched pair."""
    found = _preset_names(args.config)
    if found is not None:
        cfgs, names = [presets.get(n) for n in found], list(found)
    else:
        cfgs, names = [_load_config(args.config)], [args.config]
    if args.match:
        looped, _ = match(
            cfgs[0],
            tolerances=args.tolerances,
            mean_doc_len=args.mean_doc_len,
            seq_len=args.seq_len,
            head_dim_multiple=args.head_dim_multiple,
            expert_size_multiple=args.expert_size_multiple,
            kv_heads=args.kv_heads,
        )
        cfgs, names = [cfgs[0], looped], [names[0], "matched-smelt"]
    return names, cfgs


def _check_options(args) -> None:
    """Settings the command cannot run with, refused before any work (UsageError)."""
    try:
        if args.cluster:
            if args.ep is not None or args.dp_shard is not None:
                raise ValueError(
                    "with --cluster, give ep and gpus in the cluster SPEC, not --ep / --dp-shard"
                )
            for spec in args.cluster:
                _check_tokens(args.tokens_per_step, spec, parse_cluster(spec).gpus)
        elif args.plan == "auto":
            raise ValueError("--plan auto chooses a plan for a cluster: give --cluster SPEC")
        elif args.plot is not None:
            raise ValueError("--plot draws the projected steps: give --cluster SPEC")
        _workload(args)
    except (TypeError, ValueError) as e:
        raise cli.UsageError(str(e)) from None


def _check_tokens(tokens: Optional[int], spec: str, gpus: int) -> None:
    """--tokens-per-step that the GPUs of a cluster cannot share equally: ValueError."""
    if tokens is not None and tokens % gpus:
        raise ValueError(
            f"--tokens-per-step ({tokens}) must be a multiple of the {gpus} GPUs of --cluster "
            f"{spec}: every data-parallel rank holds an equal share"
        )


def _check_plan(args, cfgs) -> None:
    """A --plan spec that does not describe these models: UsageError before any work."""
    if args.plan in (None, "auto"):
        return
    try:
        for c in cfgs:
            parse_plan(args.plan, c)
    except ValueError as e:
        raise cli.UsageError(f"--plan {args.plan}: {e}") from None


def _workload(args) -> Workload:
    return Workload(dtype=args.dtype, mean_doc_len=args.mean_doc_len, seq_len=args.seq_len)


def _ledgers(args, names, cfgs) -> str:
    """The three budgets, the communication ledger and their ratios (and a match's JSON)."""
    leds = [ledger(c, args.mean_doc_len, args.seq_len) for c in cfgs]
    dp_shard = 8 if args.dp_shard is None else args.dp_shard
    ep = _default_ep(cfgs, dp_shard) if args.ep is None else args.ep
    tokens = TOKENS_PER_GPU * dp_shard if args.tokens_per_step is None else args.tokens_per_step
    try:
        traffic = report.comm_ledger(
            names,
            cfgs,
            tokens,
            ep=ep,
            dp_shard=dp_shard,
            gpus_per_node=min(args.gpus_per_node, dp_shard),
            plan=args.plan,
            workload=_workload(args),
        )
    except ValueError as e:  # the mesh or the plan does not suit these models
        raise cli.UsageError(str(e)) from None
    out = [_format_side_by_side(names, leds, cfgs)]
    if len(cfgs) == 2:
        r = compare(*cfgs, args.mean_doc_len, args.seq_len)
        out.append(
            f"\nratios (looped / baseline): F {r.flops:.4f}  N {r.params:.4f}  KV {r.kv:.4f}"
        )
    out.append("\n" + traffic)
    if args.match:
        why = _against_the_preset(args, names[0], *cfgs)
        if why is not None:
            out.append("\n" + why)
        out.append("\nmatched config (JSON):\n" + cfgs[1].to_json())
    return "\n".join(out)


def _against_the_preset(args, name: str, base: ModelConfig, found: ModelConfig) -> Optional[str]:
    """Where ``found`` (the match of the preset baseline ``name``) differs from the looped
    preset of its pair, why the search picked it: the rule of :func:`preference` and where
    the preset stands by it. None for a baseline that is not a preset, or the same config."""
    if not name.endswith("-baseline") or name not in presets.names():
        return None
    preset = name.removesuffix("-baseline") + "-smelt"
    theirs_cfg = presets.get(preset)
    if theirs_cfg == found:
        return None
    ours = compare(base, found, args.mean_doc_len, args.seq_len)
    theirs = compare(base, theirs_cfg, args.mean_doc_len, args.seq_len)
    tf, tp, tk = args.tolerances
    text = (
        f"matched-smelt differs from the preset {preset} ({theirs_cfg.describe()}): the "
        f"search keeps the configs within the tolerances (F {tf:g}, N {tp:g}, KV {tk:g}) and "
        f"takes the smallest worst mismatch, then the widest hidden size, then the fewest "
        f"experts; matched {_ratios_text(ours)}, preset {_ratios_text(theirs)}: "
    )
    mine = preference(ours, found.hidden_size, found.n_experts)
    other = preference(theirs, theirs_cfg.hidden_size, theirs_cfg.n_experts)
    if not theirs.within(args.tolerances):
        return text + "the preset lies outside these tolerances"
    if other[0] > mine[0]:
        return (
            text + f"the preset's worst mismatch is larger ({other[0]:.4f} against {mine[0]:.4f})"
        )
    if other < mine:  # it would have won: the search never tried it
        return text + (
            "the search does not try the preset's shape with these options (loop, head size, "
            "expert size and count multiples, KV heads)"
        )
    if found.hidden_size != theirs_cfg.hidden_size:
        return text + (
            f"both have the worst mismatch {mine[0]:.4f}, and the search prefers the wider "
            f"hidden size (H {found.hidden_size} against {theirs_cfg.hidden_size}); the "
            f"preset keeps the paper's choice"
        )
    return text + (
        f"both have the worst mismatch {mine[0]:.4f} and H {found.hidden_size}, and the search "
        f"prefers fewer experts ({found.n_experts} against {theirs_cfg.n_experts})"
    )


def _ratios_text(r) -> str:
    return f"F {r.flops:.4f} N {r.params:.4f} KV {r.kv:.4f}"


def _run(argv: Optional[Sequence[str]] = None) -> None:
    """Print the ledgers, the communication ledger or the projected steps (module docstring)."""
    args = _parser().parse_args(argv)
    _check_options(args)
    plot = plotting.plot_path(args.plot, new_folders=False)
    names, cfgs = _configs(args)
    _check_plan(args, cfgs)
    if args.cluster:
        plan = "auto" if args.plan is None else args.plan
        w = _workload(args)
        done = [
            report.format_cluster(spec, names, cfgs, args.tokens_per_step, plan, w)
            for spec in args.cluster
        ]
        print("\n\n".join(text for text, _ in done) + "\n\n" + report.LEGEND)
        if plot is not None:
            print(f"plot: {report.plot_steps([cell for _, cell in done], args.config, plot)}")
    else:
        print(_ledgers(args, names, cfgs))


main = cli.command(PROG, _run)
