"""The cluster part of ``smelt-budget``: the communication ledger's table, and per cluster
each model's plan, projected step and the gap, as text and as a plot.

    from smelt_model.cluster import report
    print(report.comm_ledger(names, cfgs, 262144, ep=8, dp_shard=8, gpus_per_node=8))
    text, cell = report.format_cluster("h100-64", names, cfgs, None, "auto", Workload())
    report.plot_steps([cell], "200M-S95", Path("steps.png"))

The command (:mod:`smelt_model.budget.cli`) reads the options and calls these; everything
here takes checked settings and returns text (or writes the plot).
"""

from __future__ import annotations

import dataclasses
import os
import textwrap
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from smelt_model import plotting
from smelt_model.budget.ledger import compare
from smelt_model.cluster.comm import Comm, comm, ratios
from smelt_model.cluster.layout import ParallelPlan, loop_of, loop_prefetch, parse_plan
from smelt_model.cluster.projection import Projection, project
from smelt_model.cluster.spec import TOKENS_PER_GPU, parse_cluster
from smelt_model.cluster.units import format_bytes, format_time
from smelt_model.cluster.workload import Workload
from smelt_model.config import ModelConfig
from smelt_tools import cli

__all__ = [
    "LEGEND",
    "Cell",
    "comm_ledger",
    "draw_steps",
    "format_cluster",
    "format_comm",
    "gap_lines",
    "plan_text",
    "plot_steps",
    "table",
]


def comm_ledger(
    names: Sequence[str],
    cfgs: Sequence[ModelConfig],
    tokens_per_step: int,
    *,
    ep: int,
    dp_shard: int,
    gpus_per_node: int,
    plan: Optional[str] = None,
    workload: Optional[Workload] = None,
) -> str:
    """The communication ledger of ``cfgs`` side by side (under torchtitan's stock layout,
    or the plan named by ``plan``), and for a pair without a plan their ratios. A mesh or a
    plan that does not suit the models raises ``ValueError``."""
    w = Workload() if workload is None else workload
    kw = dict(dp_shard=dp_shard, gpus_per_node=gpus_per_node, workload=w)
    if plan is None:
        comms = [comm(c, tokens_per_step, ep=ep, **kw) for c in cfgs]
    else:
        comms = [comm(c, tokens_per_step, plan=parse_plan(plan, c, ep=ep), **kw) for c in cfgs]
    out = [format_comm(names, comms, plan)]
    if len(cfgs) == 2 and plan is None:
        cr = ratios(*cfgs, tokens_per_step, ep=ep, dp_shard=dp_shard, workload=w)
        parts = [
            f"{label} {'-' if v is None else f'{v:.4f}'}"
            for label, v in (("EP", cr.ep), ("FSDP", cr.fsdp), ("all", cr.total))
        ]
        out.append(
            f"\ncommunication ratios (looped / baseline): {'  '.join(parts)}  (F {cr.flops:.4f})"
        )
    return "\n".join(out)


def table(names: Sequence[str], rows) -> list[str]:
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


def format_comm(names: Sequence[str], comms: Sequence[Comm], plan: Optional[str]) -> str:
    c0 = comms[0]
    head = (
        f"communication per step and rank: {c0.tokens_per_step} tokens per step "
        f"({c0.tokens_per_rank} per rank), ep {c0.ep_degree}, dp_shard {c0.dp_shard} (efsdp "
        f"{c0.efsdp}), {c0.dtype}, gradients reduced in {c0.reduce_dtype}; uniform routing; "
        + (
            "torchtitan's stock layout"
            if plan is None
            else f"plan {plan} (gather group of {c0.gather.group_size} ranks)"
        )
    )
    ep, fsdp, gather = [c.ep for c in comms], [c.fsdp for c in comms], [c.gather for c in comms]
    get = lambda family, attr: [getattr(f, attr) for f in family]  # noqa: E731
    rows = [
        ("executed MoE layers", [c.moe_layers for c in comms], str),
        ("EP dispatch, forward", get(ep, "dispatch_forward"), format_bytes),
        ("EP combine, forward", get(ep, "combine_forward"), format_bytes),
        ("EP dispatch, backward", get(ep, "dispatch_backward"), format_bytes),
        ("EP combine, backward", get(ep, "combine_backward"), format_bytes),
        ("EP all-to-alls", get(ep, "bytes"), format_bytes),
        ("EP bytes / token", [c.ep.bytes / c.tokens_per_rank for c in comms], format_bytes),
        ("FSDP all-gather, forward", get(fsdp, "all_gather_forward"), format_bytes),
        ("FSDP all-gather, backward", get(fsdp, "all_gather_backward"), format_bytes),
        ("FSDP reduce-scatter", get(fsdp, "reduce_scatter"), format_bytes),
        ("FSDP", get(fsdp, "bytes"), format_bytes),
    ]
    if any(e.dispatch_recompute for e in ep):
        # what the recomputed forwards add: all but the forward and backward rows
        again = [e.bytes - 2 * (e.dispatch_forward + e.combine_forward) for e in ep]
        rows.insert(6, ("EP recomputed forward", again, format_bytes))
    if plan is not None:
        rows += [
            ("gathered experts, all-gather fwd", get(gather, "all_gather_forward"), format_bytes),
            ("gathered experts, all-gather bwd", get(gather, "all_gather_backward"), format_bytes),
            ("gathered experts, reduce-scatter", get(gather, "reduce_scatter"), format_bytes),
            ("gathered experts, all-reduce", get(gather, "all_reduce"), format_bytes),
            ("gathered experts", get(gather, "bytes"), format_bytes),
        ]
    rows.append(("all communication", [c.total_bytes for c in comms], format_bytes))
    return "\n".join([head] + table(names, rows))


def plan_text(plan: ParallelPlan, cfg: ModelConfig) -> str:
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
class Cell:
    """One cluster's projections, for the plot: the best plans (a refusal's text where a
    model has none) and the F ratio of a pair (None for one model)."""

    spec: str
    names: tuple[str, ...]
    best: tuple[Union[Projection, str], ...]
    flops: Optional[float]


def format_cluster(spec, names, cfgs, tokens, plan_spec, w: Workload) -> tuple[str, Cell]:
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
        lines.append(f"{n} {label}: {plan_text(p.plan, c)}")
        if isinstance(s, str):
            lines.append(f"{n} torchtitan stock: {s}")
    flops = compare(*cfgs, *w.doc).flops if len(cfgs) == 2 else None
    cell = Cell(spec, tuple(names), tuple(best), flops)
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
        ("EP all-to-alls, sent", get(lambda p: p.comm.ep.bytes), format_bytes),
        ("FSDP, sent", get(lambda p: p.comm.fsdp.bytes), format_bytes),
        ("gathered experts, sent", get(lambda p: p.comm.gather.bytes), format_bytes),
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
    lines += table(names, rows)
    if len(ok) == 2:
        lines += gap_lines(label, ok, stock, flops)
        if w.head:  # the same search with the steps cut to F's parts
            bare = dataclasses.replace(w, head=False)
            parts = [_attempt(c, cl, tokens, plan_spec, bare) for c in cfgs]
            if not any(isinstance(p, str) for p in parts):
                lines.append(
                    f"without the output head's compute (F's parts only): {label} gap "
                    f"{parts[1].step_s / parts[0].step_s / flops:.4f}"
                )
    return "\n".join(lines), cell


def gap_lines(label: str, best, stock, flops: float) -> list[str]:
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


def plot_steps(cells: Sequence[Cell], title: str, path: Path) -> Path:
    """Write :func:`draw_steps` to ``path``."""
    return plotting.save(draw_steps(cells, title), path)


def draw_steps(cells: Sequence[Cell], title: str) -> Any:
    """Each model's projected step per cluster as stacked bars (ms); for a pair, a mark at
    the step the looped model would take at a gap of 1.00 and the gap above its bar. The
    title is the figure's, wrapped to its width (one cluster makes a narrow figure)."""
    plt = plotting.pyplot()
    width = 0.8 / max(len(c.names) for c in cells)
    inches = 3.0 + 2.4 * len(cells)
    fig, ax = plt.subplots(figsize=(inches, 4.5))
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
    text = f"{title}: projected training step per cluster (a model on paper)"
    # characters of 9 pt text that fit the figure's width (about 0.6 em each, with a margin)
    fig.suptitle(textwrap.fill(text, int(inches * 72 / (0.6 * 9)) - 4), fontsize=9)
    if labelled:  # nothing drawn where no model has a plan
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig
