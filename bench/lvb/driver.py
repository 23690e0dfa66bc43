"""The main job's rounds: ABBA pairs of blocks, one architecture in memory at a time, until
every row is settled, or the next round would pass ``--max-time``, or ``--max-rounds``.

Each round builds one architecture (seeded: the same weights every time), measures every
mode for a block of repeats (:func:`.runners.measure_block`), frees it, and does the same for
the other, in the order baseline, smelt | smelt, baseline | ..., so a drift of the machine
that is linear in time cancels and each architecture is measured early and late. A
:class:`~smelt_tools.watch.Watch` reads the machine around every row's timed calls. After
each round every row's pairs are estimated (:mod:`.estimate`, contended pairs left out) and
asked whether they are settled (:func:`.verdict.row_state`): the stopping rule.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Optional

import torch

from smelt_model import budget, presets
from smelt_model.budget.memory import available as available_memory
from smelt_tools.watch import Watch

from . import runners, summary, verdict
from .estimate import estimate_gap, min_pairs
from .workload import ARCHS, check_memory, make_workload, modes_of

__all__ = [
    "DTYPES",
    "run_pair",
    "start_line",
    "block_line",
    "eta_line",
    "progress_line",
    "no_row_open",
]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def progress_line(
    rounds: int, elapsed: float, states: dict[str, tuple[str, Any]], seen: Optional[str] = None
) -> str:
    """One line after a round: per row its gap, interval (once there is one) and state, and
    what the watch ``seen`` when this round's pairs were left out."""
    cells = []
    for name, (state, est) in states.items():
        if est.gap is None:
            cell = f"{name} -"
        elif est.low is None:
            cell = f"{name} {est.gap:.3f}"
        else:
            cell = f"{name} {est.gap:.3f} [{est.low:.3f}, {est.high:.3f}]"
        if state != "open":
            cell += f" {state}"
        if est.left_out:
            cell += f" ({est.left_out} left out)"
        cells.append(cell)
    line = f"round {rounds} ({elapsed:.0f} s): " + " | ".join(cells)
    return line + (f"; left out: {seen}" if seen else "")


def no_row_open(states: list[str]) -> str:
    """Why a run with no row left open stops: every row settled, or how many were given up
    on a busy machine (never "settled" beside a busy row)."""
    busy = sum(s == "busy" for s in states)
    if not busy:
        return "every row settled"
    if busy == len(states):
        return "every row given up: machine busy (most pairs contended)"
    return f"{busy} of {len(states)} rows given up (machine busy), the others settled"


def start_line(preset: str, modes, rows: int, needed: int, args) -> str:
    """What a run is about to do, printed before anything is built."""
    least = max(needed, args.min_rounds)
    return (
        f"{preset}: {rows} row{'s' * (rows != 1)} ({', '.join(modes)}) on {args.device}; "
        "a round builds each model in turn, warms it up and times every row; an interval "
        f"needs {least} rounds "
        f"at least; the run ends when every row is settled, before a round that would pass "
        f"--max-time {args.max_time:g} s, or after --max-rounds {args.max_rounds}"
    )


def block_line(r: int, arch: str, args) -> str:
    """The phase a run is in: which round, which model, what that block does."""
    extra = ", compile the decode step" if "decode" in modes_of(args) else ""
    parts = "the steps, profile them for the account" if r < args.account_rounds else "the steps"
    return f"round {r + 1}: {arch}: build, warm up{extra}, time {parts}"


def eta_line(round_s: float, needed: int, args) -> str:
    """After the first round: about how long the run will take."""
    least = min(max(needed, args.min_rounds), args.max_rounds)
    most = min(args.max_time, args.max_rounds * round_s)
    return (
        f"the first round took {round_s:.0f} s (later ones are shorter: nothing to compile, "
        f"no account after round {args.account_rounds}); the fewest rounds that can "
        f"settle every row: {least}, about {least * round_s:.0f} s at most; the run ends "
        f"by about {most:.0f} s"
    )


def run_pair(args, log: Optional[Callable[[str], None]] = _log) -> dict[str, Any]:
    """Measure the pair ``--preset`` as the options say, until the stopping rule ends the
    run; every number, with the summary. ``log`` gets a line after every round (None:
    silent)."""
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    cfgs = dict(zip(ARCHS, presets.pair(args.preset)))
    wl = make_workload(args)
    mem = check_memory(cfgs, wl, args, dtype.itemsize, available_memory(device))
    leds = {
        a: budget.ledger(c, wl.mean_doc_len, wl.seq_len, kv_dtype_bytes=dtype.itemsize)
        for a, c in cfgs.items()
    }
    ratios = budget.compare(cfgs["baseline"], cfgs["smelt"], wl.mean_doc_len, wl.seq_len)
    modes = modes_of(args)
    needed = min_pairs(args.confidence)
    # on the CPU the work runs on torch's threads; on CUDA one host thread drives the device
    watch = Watch(threads=1 if device.type == "cuda" else None)
    blocks: dict[str, list[dict[str, Any]]] = {a: [] for a in ARCHS}
    if log is not None:
        log(start_line(args.preset, modes, len(list(summary.rows_of(modes, wl))), needed, args))
    start = time.monotonic()
    stop = None
    while stop is None:
        r = len(blocks["baseline"])
        began = time.monotonic()
        for a in ARCHS if r % 2 == 0 else ARCHS[::-1]:
            if log is not None and r == 0:  # the first round is the long silent one
                log(block_line(r, a, args))
            blocks[a].append(
                runners.measure_block(
                    cfgs[a],
                    wl,
                    args,
                    device,
                    dtype,
                    modes,
                    r == 0,
                    watch,
                    account=r < args.account_rounds,
                )
            )
        states, seen = {}, None
        for name, mode, key in summary.rows_of(modes, wl):
            F = summary.row_flops_ratio(mode, key, blocks, cfgs, leds, wl, ratios.flops)
            pairs = summary.pairs_of(blocks, mode, key, args.busy_limit)
            est = estimate_gap(pairs, F, args.confidence)
            target = verdict.target_for(args.device, name)
            states[name] = (verdict.row_state(est, target, needed, args.resolution), est)
            seen = seen or pairs[-1].left_out
        now = time.monotonic()
        if log is not None:
            log(progress_line(r + 1, now - start, states, seen))
            if r == 0:
                log(eta_line(now - began, needed, args))
        if r + 1 >= args.min_rounds and all(s != "open" for s, _ in states.values()):
            stop = no_row_open([s for s, _ in states.values()])
        elif r + 1 >= args.max_rounds:
            stop = f"--max-rounds {args.max_rounds} reached"
        elif now - start + (now - began) > args.max_time:
            stop = f"another round would pass --max-time {args.max_time:g} s"
    results: dict[str, Any] = {
        "arch": summary.arch_results(
            blocks, cfgs, leds, mem, args, device, modes, wl, dtype.itemsize
        ),
        "ratios": {"flops": ratios.flops, "params": ratios.params, "kv": ratios.kv},
        "workload": wl.__dict__,
        "schedule": {
            "rounds": len(blocks["baseline"]),
            "order": "ABBA blocks, one model in memory",
            "repeats_per_block": args.repeats,
            "account_rounds": min(args.account_rounds, len(blocks["baseline"])),
            "decode_steps_per_block": wl.decode_steps,
            "min_rounds": args.min_rounds,
            "max_rounds": args.max_rounds,
            "max_time_s": args.max_time,
            "elapsed_s": time.monotonic() - start,
            "stopped": stop,
        },
    }
    return summary.summarize(results, blocks, leds, cfgs, wl, modes, args)
