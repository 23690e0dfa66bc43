"""The main job's output: the text tables (printed, and the body of ``--markdown``), the
Markdown file and the wall-clock-against-FLOPs plot. Everything is read from the result
dictionary :func:`.driver.run_pair` returns (with the run's options added by the command)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from smelt_model.budget.memory import GiB
from smelt_model.plotting import pyplot

from .account import PART_NAMES, PARTS
from .verdict import describe
from .workload import ARCHS

__all__ = ["LEGEND", "format_tables", "next_step", "markdown", "figure", "plot"]

LEGEND = """\
legend
  baseline,   each architecture's time per call: the median over the kept blocks of each
   smelt      block's fastest call (load only ever adds time, so a block's fastest call is
              the one it touched least); tokens/s and GFLOP/s follow from it
  ratio       smelt / baseline wall-clock: the gap times the F ratio
  F ratio     the ledger's FLOPs, smelt / baseline, of the same call (decode: its own ratio)
  gap         ratio / F ratio: 1.00 = the loop costs exactly its FLOPs; 1.10 = 10% slower.
              Each round runs one block of each architecture back to back: a pair. The gap
              is the median of the kept pairs' gaps, [low, high] its distribution-free
              interval at {conf:.0%} (sign test): load that lands on one block moves one
              pair, not the estimate
  left out    pairs in which a block was contended: other processes, steal or a CPU quota
              held more than {busy:.0%} of the cores the run's threads needed (see "machine")
  gap by      the pairs' gaps one by one: the lowest and highest kept, and those left out
   round
  verdict     meets / misses: the whole interval at or below / above the row's target;
              at target: the interval holds the target but lies within --resolution of
              it (the gap is the target as near as the clock can tell: settled);
              unsettled: the interval still holds the target, wider than that, when the
              run stops; machine busy: most pairs were contended, no gap is given and
              the row's times are marked "contended: not usable"; no target: none is
              set for the row on this device. The run stops when no row is open (each
              settled, or given up as machine busy), before a round that would pass
              --max-time, or at --max-rounds
  account     where each step's time goes, from --account-steps profiled steps per block
              in the first --account-rounds rounds (median per part): every op, forward
              and backward, belongs to one part; ms per step and % of the profiled step;
              ratio smelt / baseline; F the part's ledger FLOPs ratio (- where the ledger
              counts none: head, optimizer, the rest); at GEMM rate: the share of the
              part's time that the host's best GEMM (MKL or oneDNN, timed at the part's
              own shapes in the same block) needs for the part's GEMMs (- for parts
              without GEMMs); excess: smelt - F x baseline, ms: what the part adds to the
              looped model's time beyond its FLOPs (the excesses sum to the step's). The
              rest holds the embedding, the time between ops and what no op covers.
              "timed alone" is the plain step in the same loop: the profiler's cost.
              Parts that moved: those whose time differed between the account's
              blocks by more than a quarter of it (and 5 ms): their excess is partly
              the block's state (a first touch of fresh memory), not the model's
  ceiling   the host's fp32 GEMM rate at 2048^3 on the run's threads, the best of MKL's
              sgemm and oneDNN's matmul; each step's rate (ledger FLOPs / time) against it
  decode      bytes/token: what one token reads (executed layers' weights with the experts
              its batch selects, the head, the KV cache); GB/s: bytes per step / step time"""


#: why a run of one mode can give another gap than the full run's (printed with --mode)
MODE_NOTE = (
    "note: --mode {mode} measures its rows in blocks that hold nothing else, so the step "
    "runs in another context than in the full run (there each block also runs the other "
    "modes: the other model's prefill and compiled decode, their caches and allocations, "
    "come before each step; rounds are longer and fewer); its gap can differ from the "
    "full run's: compare intervals, and quote the full run's verdicts"
)


def _fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    return f"{n / 2**20:.1f} MiB"


def _share(gemm: dict[str, float], parts: dict[str, float], part: str) -> str:
    if part not in gemm or parts.get(part, 0.0) <= 0:
        return "-"
    return f"{100 * gemm[part] / parts[part]:.0f}%"


def _account_lines(arch: dict[str, Any], mode: str, row: dict[str, Any]) -> list[str]:
    """The account's table for one mode, which parts carry the gap's excess, and each
    step's rate against the host's GEMM ceiling."""
    accs = [arch[a][mode].get("account") for a in ARCHS]
    if not all(accs):
        return ["  account: none (CPU only: on CUDA a step's time is on the device)"]
    b, s = accs
    fb, fs = arch["baseline"][mode]["part_flops"], arch["smelt"][mode]["part_flops"]
    F = row["flops_ratio"]
    pb, ps = dict(b["parts_ms"]), dict(s["parts_ms"])
    pb["rest"] += b["untraced_ms"]
    ps["rest"] += s["untraced_ms"]
    tb, ts = sum(pb.values()), sum(ps.values())
    lines = [
        f"  account (profiled steps, {b['blocks']} x {b['steps_per_block']} per model; ms per "
        "step, % of it)",
        f"    {'part':16} {'baseline':>15} {'smelt':>15} {'ratio':>6} {'F':>6} "
        f"{'at GEMM rate':>12} {'excess':>8}",
    ]
    excess = {}
    for part in PARTS:
        vb, vs = pb.get(part, 0.0), ps.get(part, 0.0)
        excess[part] = vs - F * vb
        ratio = f"{vs / vb:.3f}" if vb > 0 and vs > 0 else "-"
        f_ratio = f"{fs[part] / fb[part]:.3f}" if fb.get(part, 0) > 0 else "-"
        rate = f"{_share(b['gemm_ms'], pb, part)} {_share(s['gemm_ms'], ps, part)}"
        lines.append(
            f"    {PART_NAMES[part]:16} {vb:8.1f} {100 * vb / tb:5.1f}% {vs:8.1f} "
            f"{100 * vs / ts:5.1f}% {ratio:>6} {f_ratio:>6} {rate:>12} {excess[part]:>+8.1f}"
        )
    lines.append(
        f"    {'step (profiled)':16} {tb:8.1f} {'':6} {ts:8.1f} {'':6} {ts / tb:>6.3f} "
        f"{F:>6.3f} {'':>12} {ts - F * tb:>+8.1f}"
    )
    lines.append(
        f"    {'timed alone':16} {b['plain_ms']:8.1f} {100 * b['overhead']:+5.1f}% "
        f"{s['plain_ms']:8.1f} {100 * s['overhead']:+5.1f}%   (the profiler's cost, "
        "same loop)"
    )
    moved = _moved_parts(accs)
    if moved:
        lines.append(f"  parts that moved between blocks (min-max ms per step): {moved}")
    total = ts - F * tb
    ranked = sorted(PARTS, key=lambda p: -excess[p])
    carry = [p for p in ranked if excess[p] > 0]
    back = sum(-excess[p] for p in PARTS if excess[p] < 0)
    if total > 0 and carry:
        named = ", ".join(
            f"{PART_NAMES[p]} {excess[p]:+.1f} ms ({100 * excess[p] / total:.0f}%)"
            for p in carry[:4]
        )
        lines.append(
            f"  the excess ({total:+.1f} ms: smelt - F x baseline, gap {ts / tb / F:.3f} in "
            f"these steps) is carried by {named}; the parts below their FLOPs give back "
            f"{back:.1f} ms"
        )
    else:
        lines.append(
            f"  no excess in these steps (smelt - F x baseline = {total:+.1f} ms, gap "
            f"{ts / tb / F:.3f})"
        )
    c = b["ceiling"]
    libs = ", ".join(f"{k} {v:.0f}" for k, v in c.items() if k != "best")
    rates = [row[a]["achieved_flops_per_s"] / 1e9 for a in ARCHS]
    lines.append(
        f"  GEMM ceiling {c['best']:.0f} GFLOP/s (2048^3: {libs}): the baseline's step at "
        f"{rates[0]:.0f} GFLOP/s, {100 * rates[0] / c['best']:.0f}% of it; smelt's at "
        f"{rates[1]:.0f}, {100 * rates[1] / c['best']:.0f}%"
    )
    for a, acc in zip(ARCHS, accs):
        if max(acc["tries"]) > 1:
            lines.append(
                f"  note ({a}): account taken again (tries per block {acc['tries']}) while the "
                f"profiled step exceeded the plain one by more than --tolerance; now "
                f"{100 * acc['overhead']:+.0f}%"
            )
    return lines


#: a part "moved" where its blocks' spread passes both: a share of its median and ms
MOVED_SHARE, MOVED_MS = 0.25, 5.0


def _moved_parts(accs: list[dict[str, Any]]) -> str:
    """The parts whose time differed between the account's blocks by more than
    :data:`MOVED_SHARE` of their median and :data:`MOVED_MS`: their excess is the blocks'
    state (a first touch of fresh memory, say) as much as the model's. Empty if none moved
    or the run kept no spread."""
    found = []
    for arch, acc in zip(ARCHS, accs):
        for part, (lo, hi) in (acc.get("parts_range_ms") or {}).items():
            med = acc["parts_ms"].get(part, 0.0)
            if hi - lo > max(MOVED_SHARE * med, MOVED_MS):
                found.append(f"{arch} {PART_NAMES.get(part, part)} {lo:.1f}-{hi:.1f}")
    return "; ".join(found)


def _interval(est: dict[str, Any]) -> str:
    if est["low"] is None:
        return f"(no interval yet: {est['pairs']} pairs)"
    return f"[{est['low']:.3f}, {est['high']:.3f}] at {est['confidence']:.0%}"


def _row_lines(row: dict[str, Any], mode: str, arch: dict[str, Any]) -> list[str]:
    b, s, est = row["baseline"], row["smelt"], row["estimate"]
    if not row["usable"]:  # machine busy: the times are printed, marked, and nothing from them
        return [
            f"{row['mode']:18} {b['ms']:>10.2f}ms {s['ms']:>10.2f}ms {'-':>8}   "
            "contended: not usable",
            f"{'  verdict':18} {describe(row['verdict'])}",
        ]
    ratio = f"{row['wall_ratio']:>8.3f}" if row["wall_ratio"] is not None else f"{'-':>8}"
    lines = [
        f"{row['mode']:18} {b['ms']:>10.2f}ms {s['ms']:>10.2f}ms {ratio}",
        f"{'  tokens/s':18} {b['tokens_per_s']:>12.0f} {s['tokens_per_s']:>12.0f}",
        f"{'  GFLOP/s':18} {b['achieved_flops_per_s'] / 1e9:>12.1f} "
        f"{s['achieved_flops_per_s'] / 1e9:>12.1f}",
    ]
    if mode == "decode":
        key = row["mode"].split("(")[1].rstrip(")")
        db, ds = arch["baseline"]["decode"][key], arch["smelt"]["decode"][key]
        lines += [
            f"{'  MiB/token':18} {db['bytes_per_token'] / 2**20:>12.2f} "
            f"{ds['bytes_per_token'] / 2**20:>12.2f} "
            f"{ds['bytes_per_token'] / db['bytes_per_token']:>8.3f}",
            f"{'  GB/s':18} {db['gb_per_s']:>12.1f} {ds['gb_per_s']:>12.1f}",
        ]
    fr = row.get("decode_flops_ratio", row["flops_ratio"])
    lines.append(f"{'  F ratio':18} {'':>12} {'':>12} {fr:>8.3f}")
    left = f", {est['left_out']} left out (contended)" if est["left_out"] else ""
    lines.append(
        f"{'  gap (wall / F)':18} {'':>12} {'':>12} {row['gap']:>8.3f}   "
        f"{_interval(est)}, {est['pairs']} pairs{left}"
    )
    g, out = sorted(est["round_gaps"]), est["left_out_gaps"]
    kept = f"min {g[0]:.3f}, max {g[-1]:.3f} over {len(g)} kept pairs"
    if out:
        shown = ", ".join(f"{x:.3f}" for x in out[:4]) + (", ..." if len(out) > 4 else "")
        kept += f"; left out (contended, not usable) {shown}"
    lines.append(f"{'  gap by round':18} {'':>12} {'':>12} {'':>8}   {kept}")
    lines.append(f"{'  verdict':18} {describe(row['verdict'])}")
    return lines


def _memory_line(arch: dict[str, Any], mode: str) -> str:
    mem = []
    for a in ARCHS:
        m = arch[a][mode]
        if mode == "decode":
            first = next(iter(m.values()))
            how = "compiled" if first["compiled"] else f"eager ({first['eager_reason']})"
            mem.append(
                f"KV cache {_fmt_bytes(first['cache_bytes'])} (batch {first['batch']}), step {how}"
            )
        else:
            peak = m.get("peak_bytes")
            txt = f"peak {_fmt_bytes(peak)}" if peak is not None else "peak n/a (CUDA only)"
            if "activation_bytes" in m:
                txt += f", activations saved {_fmt_bytes(m['activation_bytes'])}"
            mem.append(txt)
    return f"  memory: baseline {mem[0]}; smelt {mem[1]}"


def _machine_line(res: dict[str, Any]) -> str:
    m, sch = res["machine"], res["schedule"]
    how = (
        f"{m['contended_blocks']} of {m['timed_blocks']} row timings contended (others "
        f"held more than {m['busy_limit']:.0%} of the cores the threads needed)"
        if m["watched"]
        else "not watched (no /proc/stat here): no block could be left out"
    )
    return (
        f"machine: {how}; stopped after {sch['rounds']} round{'s' * (sch['rounds'] != 1)}, "
        f"{sch['elapsed_s']:.0f} s: "
        f"{sch['stopped']}"
    )


def _verdict_lines(res: dict[str, Any]) -> list[str]:
    t = res["targets"]
    lines = [
        f"verdicts on {t['device']} (each row's gap and its {t['confidence']:.0%} interval "
        "against its target)",
        f"  {'targets':18} {t['scope']}",
    ]
    for rows in res["summary"].values():
        for row in rows:
            lines.append(f"  {row['mode']:18} {describe(row['verdict'])}")
    return lines


def format_tables(res: dict[str, Any]) -> str:
    """The text tables: the pair and its ledger ratios, one table per mode, the verdicts and
    the legend."""
    lines: list[str] = []
    r, wl, sch, arch = res["ratios"], res["workload"], res["schedule"], res["arch"]
    lines.append(
        f"pair {res['preset']}  device {res['device']}  dtype {res['dtype']}  backend "
        f"{res['backend']}  tokens/step {wl['batch'] * wl['seq_len']} "
        f"({wl['batch']} x {wl['seq_len']}, docs of {wl['mean_doc_len']:g})"
    )
    lines.append(
        f"ledger ratios (smelt / baseline): F {r['flops']:.4f}   params "
        f"{r['params']:.4f}   KV {r['kv']:.4f}"
    )
    lines.append(
        f"schedule: {sch['rounds']} rounds of {sch['order']}, "
        f"{sch['repeats_per_block']} timed steps and {sch['decode_steps_per_block']} decode "
        "steps per block"
    )
    if res.get("mode", "all") != "all":
        lines.append(MODE_NOTE.format(mode=res["mode"]))
    lines.append(_machine_line(res))
    est = [sum(arch[a]["memory_estimate_bytes"].values()) / GiB for a in ARCHS]
    rss = [max((x or 0) for x in arch[a].get("peak_rss_bytes", [0])) / GiB for a in ARCHS]
    lines.append(
        f"memory estimate: baseline {est[0]:.2f} GiB, smelt {est[1]:.2f} GiB; process "
        f"peak RSS after their blocks {rss[0]:.2f} / {rss[1]:.2f} GiB"
    )
    for mode, rows in res["summary"].items():
        lines += ["", f"== {mode} ==", f"{'':18} {'baseline':>12} {'smelt':>12} {'ratio':>8}"]
        for row in rows:
            lines += _row_lines(row, mode, arch)
        if mode != "decode":
            lines += _account_lines(arch, mode, rows[0])
        if mode == "train":
            used = [arch[a]["train"].get("optimizer", "AdamW") for a in ARCHS]
            both = used[0] if used[0] == used[1] else " / ".join(used)
            lines.append(f"  optimizer: {both}")
        lines.append(_memory_line(arch, mode))
    lines += [""] + _verdict_lines(res)
    lines += [
        "",
        LEGEND.format(
            conf=res["targets"]["confidence"],
            busy=res["machine"]["busy_limit"],
        ),
    ]
    return "\n".join(lines)


GPU_COMMAND = "bash bench/gpu_check.sh"


def next_step(res: dict[str, Any]) -> str:
    """The run's last line: what its verdicts mean together and what to run next."""
    by: dict[str, list[str]] = {}
    for rows in res["summary"].values():
        for row in rows:
            by.setdefault(row["verdict"]["verdict"], []).append(row["mode"])
    gpu = (
        f"the GPU target (train gap <= 1.00 on one H200) is checked by `{GPU_COMMAND}` on a "
        "machine with a CUDA GPU (it refuses to start without one)"
    )
    if "machine busy" in by:
        return (
            f"next: {', '.join(by['machine busy'])} gave no gap (machine busy): rerun on a "
            "quiet machine, or with --threads set to the cores other work leaves free"
        )
    if "unsettled" in by:
        return (
            f"next: {', '.join(by['unsettled'])} still unsettled: rerun with a larger "
            "--max-time (or --max-rounds)"
        )
    on = res["targets"]["device"]
    if "misses" in by:
        return (
            f"next: on {on} the looped model is slower than its FLOPs say on "
            f"{', '.join(by['misses'])} (beyond the target); "
            + (gpu if on == "cpu" else "see docs/benchmarks.md for the parts that cost it")
        )
    return f"next: every row with a target meets it or is at it on {on}" + (
        f"; {gpu}" if on == "cpu" else ""
    )


def markdown(res: dict[str, Any], text: str, argv: Sequence[str]) -> str:
    """The ``--markdown`` file: a title, the environment, the command and the tables."""
    env = res["environment"]
    return (
        f"# looped vs baseline: {res['preset']} on {res['device']}\n\n"
        f"{env['date']} · {env['device_name']} · {env['cpu_count']} CPUs · torch "
        f"{env['torch']} · triton {env['triton']}\n\n"
        f"Command: `python bench/looped_vs_baseline.py {' '.join(argv)}`\n\n"
        f"```\n{text}\n```\n"
    )


def figure(res: dict[str, Any]):
    """The plot's figure (matplotlib). Left: each row's gap with its interval and its target,
    one row per line, so no label can cover another; a busy row says so in place of a gap.
    Right: wall-clock against the ledger's FLOPs per call, each row one color, each
    architecture one marker, named in the legend rather than beside the points, with a gray
    line through each baseline point at the baseline's FLOP rate. Below, where the run took
    an account: each model's training step and prefill split into the account's parts."""
    plt = pyplot()  # off screen
    # optional (the [plot] extra), as pyplot: only for --plot
    from matplotlib.transforms import blended_transform_factory

    rows = [row for rs in res["summary"].values() for row in rs]
    accs = [
        (f"{mode}: {a}", res["arch"][a][mode]["account"])
        for mode in ("train", "prefill")
        for a in ARCHS
        if (res["arch"][a].get(mode) or {}).get("account")
    ]
    top = 1.6 + 0.45 * len(rows)
    fig = plt.figure(figsize=(11, top + (1.4 + 0.35 * len(accs) if accs else 0)))
    grid = fig.add_gridspec(
        2 if accs else 1,
        2,
        width_ratios=[1.2, 1],
        height_ratios=[top, 1.4 + 0.35 * len(accs)] if accs else [1],
    )
    gap_ax, ax = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
    if accs:
        _account_bars(fig.add_subplot(grid[1, :]), accs)
    ys = list(range(len(rows)))[::-1]
    left = blended_transform_factory(gap_ax.transAxes, gap_ax.transData)
    colors = [f"C{i % 10}" for i in range(len(rows))]
    for y, row, color in zip(ys, rows, colors):
        v = row["verdict"]
        if v["gap"] is None:
            gap_ax.text(0.02, y, "machine busy: no gap", va="center", fontsize=8, transform=left)
        else:
            if v["low"] is not None:
                gap_ax.plot([v["low"], v["high"]], [y, y], color=color, lw=2)
            gap_ax.plot([v["gap"]], [y], "o", color=color)
        if v["target"] is not None:
            gap_ax.plot([v["target"]], [y], "|", color="black", ms=14, mew=2)
    gap_ax.set_yticks(ys, [f"{r['mode']}: {r['verdict']['verdict']}" for r in rows])
    gap_ax.set_ylim(-0.7, len(rows) - 0.3)
    gap_ax.axvline(1.0, color="gray", lw=0.6, ls=":")
    gap_ax.set_xlabel("gap = wall-clock ratio / FLOPs ratio (dot), interval (bar), target (|)")
    gap_ax.set_title(f"gap at {res['targets']['confidence']:.0%} against each target", fontsize=10)
    markers = {"baseline": "o", "smelt": "s"}
    for row, color in zip(rows, colors):
        if not row["usable"]:  # a busy machine's times are no measurement
            ax.plot([], [], "-", color=color, lw=4, label=f"{row['mode']} (contended: not shown)")
            continue
        for arch in ARCHS:
            p = row[arch]
            ax.scatter(p["flops"], p["ms"], marker=markers[arch], s=36, color=color)
        b = row["baseline"]
        xs = [b["flops"] * 0.8, b["flops"] * 1.4]
        ax.plot(xs, [b["ms"] * x / b["flops"] for x in xs], lw=0.6, color="gray")
        ax.plot([], [], "-", color=color, lw=4, label=row["mode"])
    for arch in ARCHS:
        ax.scatter([], [], marker=markers[arch], color="black", label=arch)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("useful FLOPs per call (ledger)")
    ax.set_ylabel("wall-clock per call (ms)")
    ax.set_title("wall-clock against FLOPs; gray: the baseline's FLOP rate", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.suptitle(f"{res['preset']} pair on {res['device']}", fontsize=11)
    fig.tight_layout()
    return fig


def _account_bars(ax, accs: list[tuple[str, dict[str, Any]]]) -> None:
    """Each model's step as one bar split into the account's parts (the untraced time in
    the rest), train above prefill, baseline above smelt."""
    ys = list(range(len(accs)))[::-1]
    for i, (y, (_, acc)) in enumerate(zip(ys, accs)):
        left = 0.0
        for j, part in enumerate(PARTS):
            w = acc["parts_ms"][part] + (acc["untraced_ms"] if part == "rest" else 0.0)
            label = PART_NAMES[part] if i == 0 else None
            ax.barh(y, w, left=left, color=f"C{j}", height=0.7, label=label)
            left += w
    ax.set_yticks(ys, [name for name, _ in accs])
    ax.set_xlabel("ms per step, inside profiled steps")
    ax.set_title("where each step's time goes (the account)", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def plot(res: dict[str, Any], path: str) -> None:
    """Write :func:`figure` to ``path`` (.png, .svg or .pdf)."""
    fig = figure(res)
    fig.savefig(path, dpi=130, bbox_inches="tight")
    pyplot().close(fig)
