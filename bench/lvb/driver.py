"""The ABBA driver: rounds of alternating blocks, one architecture in memory at a time, then
the pooled timings, the per-round gaps and the summary rows with their verdicts.

Each round builds one architecture (seeded: the same weights every time), measures every
mode for a block of repeats (:func:`.runners.measure_block`), frees it, and does the same for
the other, in the order baseline, smelt | smelt, baseline | ..., so a drift of the machine
that is linear in time cancels out of the ratio and each architecture is measured early and
late.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import torch

from smelt_model import budget, presets
from smelt_model.config import ModelConfig
from smelt_model.memory import available as available_memory
from smelt_tools.timing import PartsTiming, Timing, merge

from . import runners, verdict
from .accounting import component_flops, decode_bytes, flops_for
from .workload import ARCHS, Workload, check_memory, make_workload, modes_of, steps_per_block

__all__ = ["DTYPES", "run_pair", "round_ratios", "summarize"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _merge_parts(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    """The blocks of one mode: timings pooled, the add-up check redone on the pooled medians."""
    pts = [b["parts"] for b in blocks]
    step = merge([p.step for p in pts])
    parts = {k: merge([p.parts[k] for p in pts]) for k in pts[0].parts}
    counts = pts[0].counts
    frac = sum(parts[k].median_ms * counts[k] for k in parts) / step.median_ms
    pooled = PartsTiming(step, parts, counts, frac, pts[0].tolerance, max(p.tries for p in pts))
    out = {k: v for k, v in blocks[0].items() if k != "parts"}
    out.update(
        timing=step,
        components_ms=pooled.parts_ms,
        components_fraction=frac,
        components_tries=[p.tries for p in pts],
        components_note=pooled.note,
    )
    return out


def run_pair(args) -> dict[str, Any]:
    """Measure the pair ``--preset`` as the options say; every number, with the summary."""
    from smelt_kernels import backends as bk

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    cfgs = dict(zip(ARCHS, presets.pair(args.preset)))
    wl = make_workload(args)
    est = check_memory(cfgs, wl, args, dtype.itemsize, available_memory(device))
    leds = {
        a: budget.ledger(c, wl.mean_doc_len, wl.seq_len, kv_dtype_bytes=dtype.itemsize)
        for a, c in cfgs.items()
    }
    ratios = budget.compare(cfgs["baseline"], cfgs["smelt"], wl.mean_doc_len, wl.seq_len)
    modes = modes_of(args)
    per_block = sum(len(wl.decode_batches) if m == "decode" else 1 for m in modes)
    bar = _progress(2 * args.rounds * per_block, args.quiet)
    blocks: dict[str, list[dict[str, Any]]] = {a: [] for a in ARCHS}
    for r in range(args.rounds):
        for a in ARCHS if r % 2 == 0 else ARCHS[::-1]:
            bar.set_postfix_str(f"round {r + 1}/{args.rounds}: {a}")
            blocks[a].append(
                runners.measure_block(
                    cfgs[a], wl, args, device, dtype, modes, first=r == 0, bar=bar
                )
            )
    bar.close()
    results: dict[str, Any] = {"arch": {}}
    for a in ARCHS:
        first = blocks[a][0]
        res = {
            "config": cfgs[a].to_dict(),
            "ledger": leds[a].__dict__,
            "params_total": first["params_total"],
            "params_active": first["params_active"],
            "memory_estimate_bytes": est[a],
            "backend_requested": args.backend,
            "peak_rss_bytes": [b["peak_rss_bytes"] for b in blocks[a]],
            "backends_available": bk.report(device),
        }
        for mode in ("train", "prefill"):
            if mode in modes:
                res[mode] = _merge_parts([b[mode] for b in blocks[a]])
                res[mode]["components_flops"] = component_flops(leds[a], wl.tokens, mode == "train")
        if "decode" in modes:
            res["decode"] = {}
            for key, d in first["decode"].items():
                t = merge([b["decode"][key]["timing"] for b in blocks[a]])
                nbytes = decode_bytes(cfgs[a], leds[a], d["batch"], d["context"], dtype.itemsize)
                res["decode"][key] = dict(
                    d,
                    timing=t,
                    bytes_per_step=nbytes,
                    bytes_per_token=nbytes / d["batch"],
                    gb_per_s=nbytes / (t.median_ms / 1e3) / 1e9,
                )
        results["arch"][a] = res
    results["round_ratios"] = round_ratios(blocks, modes)
    results["ratios"] = {"flops": ratios.flops, "params": ratios.params, "kv": ratios.kv}
    results["workload"] = wl.__dict__
    results["schedule"] = {
        "rounds": args.rounds,
        "order": "ABBA blocks, one model in memory",
        "repeats_per_block": steps_per_block(args.repeats, args),
    }
    return summarize(results, leds, wl, modes, args.device)


def _block_median(block: dict[str, Any], mode: str, key: Optional[str]) -> float:
    if mode == "decode":
        return block["decode"][key]["timing"].median_ms
    return block[mode]["parts"].step.median_ms


def round_ratios(blocks: dict[str, list[dict[str, Any]]], modes) -> dict[str, list[float]]:
    """Per row of the summary (``train``, ``prefill``, ``decode (batch8)``, ...), the
    wall-clock ratio smelt / baseline of each round's two blocks, which ran back to back:
    drift between rounds cancels within each, so their range is a direct measure of how
    far the row's ratio can be trusted."""
    out: dict[str, list[float]] = {}
    pairs = list(zip(blocks["baseline"], blocks["smelt"]))
    for mode in modes:
        keys = list(pairs[0][0]["decode"]) if mode == "decode" else [None]
        for key in keys:
            name = mode if key is None else f"{mode} ({key})"
            out[name] = [
                _block_median(s, mode, key) / _block_median(b, mode, key) for b, s in pairs
            ]
    return out


class _NoBar:
    def update(self, n=1):
        pass

    def set_postfix_str(self, s):
        pass

    def close(self):
        pass


def _progress(total: int, quiet: bool):
    if quiet:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc="measuring", unit="task", file=sys.stderr)


def summarize(
    results: dict[str, Any],
    leds: dict[str, budget.Ledger],
    wl: Workload,
    modes,
    device: str = "cpu",
) -> dict[str, Any]:
    """Add ``summary``: per mode, one row per measured call (per decode batch) with both
    architectures' medians, spreads, rates and FLOPs, the wall-clock and FLOPs ratios, the
    gap, the gap of each round and the row's verdict against its target on ``device``;
    and ``targets``: the targets that applied."""
    F = results["ratios"]["flops"]
    summary = {}
    for mode in modes:
        rows = []
        keys = ["batch%d" % b for b in wl.decode_batches] if mode == "decode" else [None]
        for key in keys:
            per = {}
            for arch in ARCHS:
                m = results["arch"][arch][mode]
                m = m[key] if key else m
                t: Timing = m["timing"]
                cfg = ModelConfig.from_dict(results["arch"][arch]["config"])
                batch = m.get("batch", 1)
                fl = flops_for(mode, leds[arch], cfg, wl, m.get("context", 0), batch)
                tokens = m.get("tokens", batch)
                per[arch] = {
                    "median_ms": t.median_ms,
                    "spread": t.spread,
                    "tokens_per_s": tokens / (t.median_ms / 1e3),
                    "flops": fl,
                    "achieved_flops_per_s": fl / (t.median_ms / 1e3),
                }
                m["timing"] = t.to_dict()
            wall = per["smelt"]["median_ms"] / per["baseline"]["median_ms"]
            row = {
                "mode": mode if key is None else f"{mode} ({key})",
                "flops_ratio": F,
                "wall_ratio": wall,
                "gap": wall / F,
                "baseline": per["baseline"],
                "smelt": per["smelt"],
            }
            if mode == "decode":
                # decode FLOPs differ from the training ratio: report its own FLOP ratio too
                row["decode_flops_ratio"] = per["smelt"]["flops"] / per["baseline"]["flops"]
                row["gap"] = wall / row["decode_flops_ratio"]
            f_row = row.get("decode_flops_ratio", F)
            row["round_gaps"] = [
                x / f_row for x in results.get("round_ratios", {}).get(row["mode"], [])
            ]
            row["verdict"] = verdict.judge_row(row, device)
            rows.append(row)
        summary[mode] = rows
    results["summary"] = summary
    dev = str(device).split(":")[0]
    results["targets"] = {
        "device": dev,
        "gap": verdict.TARGETS.get(dev, {}),
        "scope": verdict.TARGET_SCOPE.get(dev, "no targets on this device"),
        "spread_limit": verdict.SPREAD_LIMIT,
    }
    return results
