"""The command line of the ledger: ``smelt-budget`` (or ``python -m smelt_model.budget``).

    smelt-budget 200M-S95                      # both ledgers and communication, ratios
    smelt-budget 200M-S95 --ep 8 --dp-shard 64 --tokens-per-step 2097152
    smelt-budget 200M-S95 --ep 8 --plan span-gather    # the bytes under a parallel plan
    smelt-budget 200M-S95 --cluster h100-8 --cluster h100-64,ep=16
    smelt-budget 1.6B-S97 --cluster h100-8 --cluster h100-64 --plot runs/steps.png
    smelt-budget 200M-S95-baseline --match
    smelt-budget my_baseline.json --match

Without ``--cluster`` the communication ledger (:mod:`.comm`) follows the three budgets:
bytes per step and rank at ``--tokens-per-step`` (default 32768 per data-parallel rank),
``--ep`` (default: the largest of 8, 4, 2, 1 that divides every model's expert count and
``--dp-shard``) and ``--dp-shard`` (default 8), under torchtitan's stock layout or
``--plan``. With ``--cluster SPEC`` (repeatable; see :mod:`.cluster`) it prints, per
cluster, each architecture's best plan (or ``--plan``) beside torchtitan's stock layout,
their bytes, memory and projected step times, and the gap (:mod:`.projection`);
``--plot PATH`` also draws each model's projected step per cluster, split into compute and
the exposed traffic, with the step the looped model would need for a gap of 1.00.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Optional, Sequence, Union

from smelt_model import plotting
from smelt_model.budget.ledger import Ledger, compare, ledger
from smelt_model.budget.matcher import match
from smelt_model.cluster.comm import Comm, comm, ratios
from smelt_model.cluster.layout import PLAN_NAMES, ParallelPlan, loop_of, loop_prefetch, parse_plan
from smelt_model.cluster.projection import Projection, project
from smelt_model.cluster.spec import TOKENS_PER_GPU, parse_cluster
from smelt_model.cluster.units import format_bytes, format_time
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


def _table(names: Sequence[str], rows) -> list[str]:
    """Rows of (label, values, format): one column per model, a ratio column for a pair;
    a value of None prints as ``-``."""
    w0 = max(len(r[0]) for r in rows)
    out = [
        f"{'':{w0}}  "
        + "  ".join(f"{n:>18}" for n in names)
        + ("  {:>7}".format("ratio") if len(names) == 2 else "")
    ]
    for label, vals, fmt in rows:
        line = f"{label:{w0}}  " + "  ".join(f"{'-' if v is None else fmt(v):>18}" for v in vals)
        if len(vals) == 2:
            a, b = vals
            ok = a is not None and b is not None and a
            line += f"  {b / a:7.4f}" if ok else f"  {'-':>7}"
        out.append(line)
    return out


def _format_comm(names: Sequence[str], comms: Sequence[Comm], plan: Optional[str]) -> str:
    c0 = comms[0]
    head = (
        f"communication per step and rank: {c0.tokens_per_step} tokens per step "
        f"({c0.tokens_per_rank} per rank), ep {c0.ep}, dp_shard {c0.dp_shard} (efsdp "
        f"{c0.efsdp}), {c0.dtype}, gradients reduced in {c0.reduce_dtype}; uniform routing; "
        + (
            "torchtitan's stock layout"
            if plan is None
            else f"plan {plan} (gather group of {c0.gather_group_size} ranks)"
        )
    )
    get = lambda attr: [getattr(c, attr) for c in comms]  # noqa: E731
    rows = [
        ("executed MoE layers", get("moe_layers"), str),
        ("EP dispatch, forward", get("dispatch_forward"), format_bytes),
        ("EP combine, forward", get("combine_forward"), format_bytes),
        ("EP dispatch, backward", get("dispatch_backward"), format_bytes),
        ("EP combine, backward", get("combine_backward"), format_bytes),
        ("EP all-to-alls", get("ep_bytes"), format_bytes),
        ("EP bytes / token", get("ep_bytes_per_token"), format_bytes),
        ("FSDP all-gather, forward", get("fsdp_all_gather_forward"), format_bytes),
        ("FSDP all-gather, backward", get("fsdp_all_gather_backward"), format_bytes),
        ("FSDP reduce-scatter", get("fsdp_reduce_scatter"), format_bytes),
        ("FSDP", get("fsdp_bytes"), format_bytes),
    ]
    if any(c.dispatch_recompute for c in comms):
        rows.insert(
            6,
            (
                "EP recomputed forward",
                [c.ep_bytes - 2 * (c.dispatch_forward + c.combine_forward) for c in comms],
                format_bytes,
            ),
        )
    if plan is not None:
        rows += [
            ("gathered experts, all-gather fwd", get("gather_all_gather_forward"), format_bytes),
            ("gathered experts, all-gather bwd", get("gather_all_gather_backward"), format_bytes),
            ("gathered experts, reduce-scatter", get("gather_reduce_scatter"), format_bytes),
            ("gathered experts, all-reduce", get("gather_all_reduce"), format_bytes),
            ("gathered experts", get("gather_bytes"), format_bytes),
        ]
    rows.append(("all communication", get("total_bytes"), format_bytes))
    return "\n".join([head] + _table(names, rows))


def _plan_text(plan: ParallelPlan, cfg: ModelConfig) -> str:
    """``plan`` in a line: its layers (``|`` around the span) and how it runs."""
    letters = plan.letters
    loop = loop_of(cfg)
    if cfg.is_looped:
        letters = f"{letters[: loop.start]}|{letters[loop.start : loop.end]}|{letters[loop.end :]}"
    ways = ["no EP"]
    if plan.ep_layers:
        ways = [
            f"EP {plan.ep}",
            "de-duplicated" if plan.dedup else "stock dispatch",
            f"overlap in {plan.chunks} chunks" if plan.overlap else "no overlap",
        ]
    if plan.gather_layers:
        ways.append(f"gathered over {'a node' if plan.gather_group == 'node' else 'all GPUs'}")
    if cfg.is_looped:
        ways.append("span layers as units" if plan.span_units == "layer" else "span as one unit")
        if plan.span_gather == "layer" and any(loop.in_span(i) for i in plan.gather_layers):
            ways.append("span experts gathered at every visit")
    ways.append("re-gathered for the backward" if plan.reshard_after_forward else "kept gathered")
    if loop_prefetch(plan, cfg):
        ways.append("loop-aware prefetch")
    ways.append(f"recompute {plan.recompute}")
    return f"{letters}  ({', '.join(ways)})"


def _attempt(cfg: ModelConfig, cl, tokens, plan, w: Workload) -> Union[Projection, str]:
    try:
        return project(cfg, cl, tokens, plan=plan, workload=w)
    except ValueError as e:  # a plan that cannot run or fit is part of the answer
        return cli.one_line(e)


LEGEND = (
    "Bytes are what one GPU sends to other GPUs per step, under uniform routing; 'busy' is\n"
    "the time each link needs for them at its nominal bandwidth; 'exposed' is the time the\n"
    "compute waits for each kind of traffic (what the overlap cannot hide), so a step is\n"
    "compute + exposed. e: a layer whose tokens move (EP), g: a layer whose experts are\n"
    "gathered; | marks the looped span."
)


@dataclasses.dataclass(frozen=True)
class _Cell:
    """One cluster's projections, for the plot: the best plans (a refusal's text where a
    model has none) and the F ratio of a pair (None for one model)."""

    spec: str
    names: tuple[str, ...]
    best: tuple[Union[Projection, str], ...]
    flops: Optional[float]


def _format_cluster(spec, names, cfgs, tokens, plan_spec, w: Workload) -> tuple[str, _Cell]:
    cl = parse_cluster(spec)
    tokens = TOKENS_PER_GPU * cl.gpus if tokens is None else tokens
    label = "best plan" if plan_spec == "auto" else f"plan {plan_spec}"
    best = [_attempt(c, cl, tokens, plan_spec, w) for c in cfgs]
    stock = [_attempt(c, cl, tokens, None, w) for c in cfgs]
    lines = [
        f"projected step on {spec}: {cl.describe()}",
        f"{tokens} tokens per step ({tokens // cl.gpus} per GPU); a model on paper, not a "
        f"measurement",
    ]
    for n, c, p, s in zip(names, cfgs, best, stock):
        if isinstance(p, str):
            lines.append(f"{n}: {p}")
            continue
        lines.append(f"{n} {label}: {_plan_text(p.plan, c)}")
        if isinstance(s, str):
            lines.append(f"{n} torchtitan stock: {s}")
    flops = compare(*cfgs, *w.doc).flops if len(cfgs) == 2 else None
    cell = _Cell(spec, tuple(names), tuple(best), flops)
    ok = [p for p in best if not isinstance(p, str)]
    if not ok:
        return "\n".join(lines), cell
    names = [n for n, p in zip(names, best) if not isinstance(p, str)]
    stock = [s for s, p in zip(stock, best) if not isinstance(p, str)]
    get = lambda f: [f(p) for p in ok]  # noqa: E731
    gb = lambda x: f"{x / 1e9:.2f} GB"  # noqa: E731
    rows = [
        ("compute (recompute included)", get(lambda p: p.compute_s), format_time),
        ("  of which the output head", get(lambda p: p.model.head_s), format_time),
        ("EP all-to-alls, sent", get(lambda p: p.comm.ep_bytes), format_bytes),
        ("FSDP, sent", get(lambda p: p.comm.fsdp_bytes), format_bytes),
        ("gathered experts, sent", get(lambda p: p.comm.gather_bytes), format_bytes),
        ("in-node links busy", get(lambda p: p.model.busy["intra"]), format_time),
        ("NIC busy", get(lambda p: p.model.busy["inter"]), format_time),
        ("exposed EP", get(lambda p: p.exposed["ep"]), format_time),
        ("exposed FSDP", get(lambda p: p.exposed["fsdp"]), format_time),
        ("exposed gathered experts", get(lambda p: p.exposed["gather"]), format_time),
        (f"memory per GPU (of {cl.memory / 1e9:.4g} GB)", get(lambda p: p.memory.total), gb),
        (f"step, {label}", get(lambda p: p.step_s), format_time),
        (
            "step, torchtitan stock",
            [None if isinstance(s, str) else s.step_s for s in stock],
            format_time,
        ),
    ]
    lines += _table(names, rows)
    if len(ok) == 2:
        lines += _gap_lines(label, ok, stock, flops)
        if w.head:  # the same search with the steps cut to F's parts
            bare = dataclasses.replace(w, head=False)
            parts = [_attempt(c, cl, tokens, plan_spec, bare) for c in cfgs]
            if not any(isinstance(p, str) for p in parts):
                lines.append(
                    f"without the output head's compute (F's parts only): {label} gap "
                    f"{parts[1].step_s / parts[0].step_s / flops:.4f}"
                )
    return "\n".join(lines), cell


#: the parts of a plotted step, bottom to top: (label, colour, seconds of a projection)
_STACK = (
    ("compute (recompute included)", "#4c72b0", lambda p: p.compute_s),
    ("exposed EP all-to-alls", "#dd8452", lambda p: p.exposed["ep"]),
    ("exposed FSDP", "#c44e52", lambda p: p.exposed["fsdp"]),
    ("exposed gathered experts", "#8172b3", lambda p: p.exposed["gather"]),
)


def _short(names: Sequence[str]) -> list[str]:
    """``names`` without the prefix they share up to a dash (``200M-S95-smelt`` ->
    ``smelt``); the names themselves where they share none."""
    common = os.path.commonprefix(list(names)) if len(names) > 1 else ""
    cut = common.rfind("-") + 1
    return [n[cut:] or n for n in names]


def _plot(cells: Sequence[_Cell], title: str, path: Path) -> Path:
    """Each model's projected step per cluster as stacked bars (ms); for a pair, a mark at
    the step the looped model would take at a gap of 1.00 and the gap above its bar."""
    plt = plotting.pyplot()
    width = 0.8 / max(len(c.names) for c in cells)
    fig, ax = plt.subplots(figsize=(3.0 + 2.4 * len(cells), 4.5))
    steps = [p.step_s for c in cells for p in c.best if not isinstance(p, str)]
    top = max(steps, default=1.0) * 1e3
    labelled: set[str] = set()
    ticks, tick_labels = [], []
    for i, cell in enumerate(cells):
        for j, (p, short) in enumerate(zip(cell.best, _short(cell.names))):
            x = i + (j - (len(cell.best) - 1) / 2) * width
            ticks.append(x)
            tick_labels.append(short)
            if isinstance(p, str):
                ax.text(
                    x, 0.02 * top, "no plan fits", ha="center", va="bottom", fontsize=8, rotation=90
                )
                continue
            bottom = 0.0
            for label, colour, part in _STACK:
                h = part(p) * 1e3
                if h <= 0:
                    continue
                ax.bar(
                    x,
                    h,
                    width * 0.9,
                    bottom=bottom,
                    color=colour,
                    label=None if label in labelled else label,
                )
                labelled.add(label)
                bottom += h
        ax.text(
            i,
            -0.13,
            cell.spec,
            transform=ax.get_xaxis_transform(),
            ha="center",
            va="top",
            fontsize=8,
        )
        if cell.flops is not None and not any(isinstance(p, str) for p in cell.best):
            base, looped = cell.best
            x = i + width / 2
            even = base.step_s * cell.flops * 1e3
            ax.hlines(
                even,
                x - width / 2,
                x + width / 2,
                colors="black",
                linestyles="--",
                label=None if "gap 1.00" in labelled else "looped step at gap 1.00",
            )
            labelled.add("gap 1.00")
            gap = looped.step_s / base.step_s / cell.flops
            ax.text(
                x,
                max(even, looped.step_s * 1e3) * 1.01,
                f"gap {gap:.4f}",
                ha="center",
                va="bottom",
                fontsize=8,
            )
    ax.set_xticks(ticks)
    ax.set_xticklabels(tick_labels, fontsize=8)
    ax.set_xlim(-0.6, len(cells) - 0.4)
    ax.set_ylim(0, top * 1.12)
    ax.set_ylabel("projected step (ms)")
    ax.set_title(f"{title}: projected training step per cluster (a model on paper)", fontsize=9)
    if labelled:  # nothing drawn where no model has a plan
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return plotting.save(fig, path)


def _gap_lines(label: str, best, stock, flops: float) -> list[str]:
    gap = best[1].step_s / best[0].step_s / flops
    text = f"gap (step ratio / F ratio {flops:.4f}): {label} {gap:.4f}"
    if not any(isinstance(s, str) for s in stock):
        text += f", torchtitan stock {stock[1].step_s / stock[0].step_s / flops:.4f}"
    out = [text]
    if gap > 1.00005:
        b, a = best[1], best[0]
        extra = b.step_s - a.step_s * flops  # beyond what the FLOPs account for
        # the extra, split: compute (recompute included) and exposed traffic
        more_compute = b.compute_s - a.compute_s * flops
        ratio = b.compute_s / a.compute_s
        out.append(
            f"above 1.00 by {gap - 1:.2%} ({format_time(extra)} per step more than the F ratio "
            f"allows: {_signed(more_compute)} from compute, {_signed(extra - more_compute)} "
            f"from exposed traffic): compute {ratio:.4f}x the baseline's (recompute "
            f"{b.plan.recompute} against {a.plan.recompute}), so with every transfer of both "
            f"hidden the gap would be {ratio / flops:.4f}; exposed traffic of the looped "
            f"model {_exposed(b)}, of the baseline {_exposed(a)}"
        )
    return out


def _signed(seconds: float) -> str:
    return ("+" if seconds >= 0 else "-") + format_time(abs(seconds))


def _exposed(p: Projection) -> str:
    names = {"ep": "EP", "fsdp": "FSDP", "gather": "gathered experts"}
    parts = [f"{names[k]} {format_time(v)}" for k, v in p.exposed.items() if v > 0]
    return ", ".join(parts) if parts else "none"


def _default_ep(cfgs, dp_shard: int) -> int:
    return next(
        ep for ep in (8, 4, 2, 1) if dp_shard % ep == 0 and all(c.n_experts % ep == 0 for c in cfgs)
    )


def _load_config(spec: str) -> ModelConfig:
    """A preset name or a JSON config file."""
    from smelt_model import presets

    if spec in presets.names():
        return presets.get(spec)
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
        help="with --cluster: draw each model's projected step per cluster (.png, .pdf, .svg; "
        "needs matplotlib)",
    )
    return ap


def _configs(args) -> tuple[list[str], list[ModelConfig]]:
    """(column names, configs) from the command: one config, a pair, or a matched pair."""
    from smelt_model import presets

    if args.config in presets.pairs():
        cfgs = list(presets.pair(args.config))
        names = [f"{args.config}-baseline", f"{args.config}-smelt"]
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
                parse_cluster(spec)
        elif args.plan == "auto":
            raise ValueError("--plan auto chooses a plan for a cluster: give --cluster SPEC")
        elif args.plot is not None:
            raise ValueError("--plot draws the projected steps: give --cluster SPEC")
        _workload(args)
    except (TypeError, ValueError) as e:
        raise cli.UsageError(str(e)) from None


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
    node = min(args.gpus_per_node, dp_shard)
    kw = dict(dp_shard=dp_shard, gpus_per_node=node, workload=_workload(args))
    try:
        if args.plan is None:
            comms = [comm(c, tokens, ep=ep, **kw) for c in cfgs]
        else:
            comms = [comm(c, tokens, plan=parse_plan(args.plan, c, ep=ep), **kw) for c in cfgs]
    except ValueError as e:  # the mesh or the plan does not suit these models
        raise cli.UsageError(str(e)) from None
    out = [_format_side_by_side(names, leds, cfgs)]
    if len(cfgs) == 2:
        r = compare(*cfgs, args.mean_doc_len, args.seq_len)
        out.append(
            f"\nratios (looped / baseline): F {r.flops:.4f}  N {r.params:.4f}  KV {r.kv:.4f}"
        )
    out.append("\n" + _format_comm(names, comms, args.plan))
    if len(cfgs) == 2 and args.plan is None:
        cr = ratios(*cfgs, tokens, ep=ep, dp_shard=dp_shard, workload=kw["workload"])
        parts = [
            f"{label} {'-' if v is None else f'{v:.4f}'}"
            for label, v in (("EP", cr.ep), ("FSDP", cr.fsdp), ("all", cr.total))
        ]
        out.append(
            f"\ncommunication ratios (looped / baseline): {'  '.join(parts)}  (F {cr.flops:.4f})"
        )
    if args.match:
        out.append("\nmatched config (JSON):\n" + cfgs[1].to_json())
    return "\n".join(out)


def _run(argv: Optional[Sequence[str]] = None) -> None:
    """Print the ledgers, the communication ledger or the projected steps (module docstring)."""
    args = _parser().parse_args(argv)
    _check_options(args)
    plot = plotting.plot_path(args.plot)
    names, cfgs = _configs(args)
    _check_plan(args, cfgs)
    if args.cluster:
        plan = "auto" if args.plan is None else args.plan
        w = _workload(args)
        done = [
            _format_cluster(spec, names, cfgs, args.tokens_per_step, plan, w)
            for spec in args.cluster
        ]
        print("\n\n".join(text for text, _ in done) + "\n\n" + LEGEND)
        if plot is not None:
            print(f"plot: {_plot([cell for _, cell in done], args.config, plot)}")
    else:
        print(_ledgers(args, names, cfgs))


main = cli.command(PROG, _run)
