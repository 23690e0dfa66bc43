"""From the blocks of a run to its numbers: each row's pairs (with the contended ones marked),
each architecture's pooled results, and the summary rows with their estimates and verdicts.

A *row* is one measured call: ``train``, ``prefill``, ``decode (batch1)``, ... Its pairs,
estimate and verdict are :mod:`.estimate`'s and :mod:`.verdict`'s; what is pooled here (the
account, the per-architecture times and rates) comes from the blocks the estimate kept.
"""

from __future__ import annotations

import statistics
from typing import Any, Iterator, Optional

from smelt_kernels import backends as bk
from smelt_model.config import ModelConfig
from smelt_tools.timing import Timing, merge

from . import verdict
from .accounting import decode_bytes, flops_for, part_flops
from .estimate import Pair, block_ms, estimate_gap, min_pairs
from .workload import ARCHS, Workload

__all__ = ["rows_of", "row_timing", "pairs_of", "row_flops_ratio", "arch_results", "summarize"]


def rows_of(modes, wl: Workload) -> Iterator[tuple[str, str, Optional[str]]]:
    """(row name, mode, decode key) of every row a run measures, in order."""
    for mode in modes:
        if mode == "decode":
            for b in wl.decode_batches:
                yield f"decode (batch{b})", mode, f"batch{b}"
        else:
            yield mode, mode, None


def row_timing(block: dict[str, Any], mode: str, key: Optional[str]) -> Timing:
    """The timing of one row in one block."""
    if mode == "decode":
        return block["decode"][key]["timing"]
    return block[mode]["step"]


def _contended(block: dict[str, Any], mode: str, key: Optional[str], limit: float):
    load = row_timing(block, mode, key).load
    return load if load is not None and load.contended(limit) else None


def pairs_of(
    blocks: dict[str, list[dict[str, Any]]], mode: str, key: Optional[str], limit: float
) -> list[Pair]:
    """One :class:`~.estimate.Pair` per round; a pair is left out when the watch saw either
    of its blocks contended (others held more than ``limit`` of the cores), and says what
    it saw in the worse of the two."""
    out = []
    for b, s in zip(blocks["baseline"], blocks["smelt"]):
        loads = [x for x in (_contended(b, mode, key, limit), _contended(s, mode, key, limit)) if x]
        worst = max(loads, key=lambda x: x.lost) if loads else None
        out.append(
            Pair(
                block_ms(row_timing(b, mode, key)),
                block_ms(row_timing(s, mode, key)),
                worst.describe() if worst is not None else None,
            )
        )
    return out


def row_flops_ratio(
    mode: str, key: Optional[str], blocks, cfgs, leds, wl: Workload, flops_ratio: float
) -> float:
    """The FLOPs ratio a row's gap divides by: the ledger's for a step, decode's own (at the
    block's context and batch) for a decode row."""
    if mode != "decode":
        return flops_ratio
    d = blocks["baseline"][0]["decode"][key]
    f = {a: flops_for(mode, leds[a], cfgs[a], wl, d["context"], d["batch"]) for a in ARCHS}
    return f["smelt"] / f["baseline"]


def _kept(blocks: list[dict], pairs: list[Pair]) -> list[dict]:
    kept = [b for b, p in zip(blocks, pairs) if p.left_out is None]
    return kept or blocks


def _median(dicts: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(d[k] for d in dicts) for k in dicts[0]}


def _merge_account(blocks: list[dict[str, Any]], fallback: list[dict[str, Any]]) -> dict[str, Any]:
    """The blocks of one mode: the step's timings pooled over all of them; the account's
    medians over those that took one (the first ``--account-rounds``; ``fallback``, every
    block of the architecture, when none of the kept ones did). ``account`` is None where no
    block took one (a CUDA run)."""
    with_acc = [b for b in blocks if b.get("account")] or [b for b in fallback if b.get("account")]
    out = {k: v for k, v in blocks[0].items() if k not in ("step", "account")}
    out["timing"] = merge([b["step"] for b in blocks])
    if not with_acc:
        out["account"] = None
        return out
    accs = [b["account"] for b in with_acc]
    profiled = statistics.median(a["profiled_ms"] for a in accs)
    plain = statistics.median(a["plain_ms"] for a in accs)
    out["account"] = {
        "blocks": len(accs),
        "steps_per_block": accs[0]["steps"],
        "parts_ms": _median([a["parts_ms"] for a in accs]),
        "parts_range_ms": {
            k: [min(a["parts_ms"][k] for a in accs), max(a["parts_ms"][k] for a in accs)]
            for k in accs[0]["parts_ms"]
        },
        "untraced_ms": statistics.median(a["untraced_ms"] for a in accs),
        "profiled_ms": profiled,
        "plain_ms": plain,
        "overhead": profiled / plain - 1.0,
        "tries": [a["tries"] for a in accs],
        "gemm_ms": _median([a["gemm_ms"] for a in accs]),
        "ceiling": _median([a["ceiling"] for a in accs]),
    }
    return out


def arch_results(blocks, cfgs, leds, mem, args, device, modes, wl: Workload, itemsize: int):
    """Per architecture: its config, ledger and memory, and per mode the timings pooled over
    the blocks its rows kept."""
    pairs = {n: pairs_of(blocks, m, k, args.busy_limit) for n, m, k in rows_of(modes, wl)}
    out = {}
    for a in ARCHS:
        first = blocks[a][0]
        res = {
            "config": cfgs[a].to_dict(),
            "ledger": leds[a].__dict__,
            "params_total": first["params_total"],
            "params_active": first["params_active"],
            "memory_estimate_bytes": mem[a],
            "backend_requested": args.backend,
            "peak_rss_bytes": [b["peak_rss_bytes"] for b in blocks[a]],
            "backends_available": bk.report(device),
        }
        for mode in ("train", "prefill"):
            if mode in modes:
                kept = _kept(blocks[a], pairs[mode])
                res[mode] = _merge_account([b[mode] for b in kept], [b[mode] for b in blocks[a]])
                res[mode]["part_flops"] = part_flops(leds[a], wl.tokens, mode == "train")
        if "decode" in modes:
            res["decode"] = {}
            for name, _, key in rows_of(("decode",), wl):
                kept = _kept(blocks[a], pairs[name])
                d = first["decode"][key]
                ms = statistics.median(block_ms(b["decode"][key]["timing"]) for b in kept)
                nbytes = decode_bytes(cfgs[a], leds[a], d["batch"], d["context"], itemsize)
                res["decode"][key] = dict(
                    d,
                    timing=merge([b["decode"][key]["timing"] for b in kept]),
                    ms=ms,
                    bytes_per_step=nbytes,
                    bytes_per_token=nbytes / d["batch"],
                    gb_per_s=nbytes / (ms / 1e3) / 1e9,
                )
        out[a] = res
    return out


def _lost(load) -> Optional[float]:
    return None if load is None else load.lost


def _per_arch(blocks, kept, mode, key, led, cfg, wl, m) -> dict[str, Any]:
    """One architecture's side of a row: ``ms`` (the median over the kept blocks of each
    block's fastest call) and the rates from it, every block's time and the share of its
    cores others held meanwhile (``Load.lost``), the pooled spread."""
    ms = statistics.median(kept)
    batch = m.get("batch", 1)
    fl = flops_for(mode, led, cfg, wl, m.get("context", 0), batch)
    t: Timing = m["timing"]
    return {
        "ms": ms,
        "block_ms": [block_ms(row_timing(b, mode, key)) for b in blocks],
        "block_lost": [_lost(row_timing(b, mode, key).load) for b in blocks],
        "spread": t.spread,
        "tokens_per_s": m.get("tokens", batch) / (ms / 1e3),
        "flops": fl,
        "achieved_flops_per_s": fl / (ms / 1e3),
    }


def _json_timings(arch: dict[str, Any]) -> None:
    """Each pooled :class:`Timing` of an architecture's results as a dictionary."""
    for mode in ("train", "prefill"):
        if mode in arch:
            arch[mode]["timing"] = arch[mode]["timing"].to_dict()
    for d in arch.get("decode", {}).values():
        d["timing"] = d["timing"].to_dict()


def summarize(results: dict[str, Any], blocks, leds, cfgs, wl: Workload, modes, args):
    """Add ``summary`` (per mode, one row per measured call: both architectures' times and
    rates, the row's FLOPs ratio, its estimate with interval, its pairs and its verdict),
    ``targets`` and ``machine`` (what the watch saw) to ``results``."""
    needed = min_pairs(args.confidence)
    summary: dict[str, list] = {}
    loads = []
    for name, mode, key in rows_of(modes, wl):
        pairs = pairs_of(blocks, mode, key, args.busy_limit)
        F = row_flops_ratio(mode, key, blocks, cfgs, leds, wl, results["ratios"]["flops"])
        est = estimate_gap(pairs, F, args.confidence)
        target = verdict.target_for(args.device, name)
        state = verdict.row_state(est, target, needed, args.resolution)
        seen = est.reasons[len(est.reasons) // 2] if est.reasons else None
        v = verdict.judge(est, target, state, needed, seen, args.resolution)
        row: dict[str, Any] = {"mode": name, "flops_ratio": results["ratios"]["flops"]}
        if mode == "decode":
            row["decode_flops_ratio"] = F
        for a in ARCHS:
            m = results["arch"][a][mode]
            mine = [p.smelt_ms if a == "smelt" else p.baseline_ms for p in pairs]
            kept = [x for x, p in zip(mine, pairs) if p.left_out is None] or mine
            cfg = ModelConfig.from_dict(results["arch"][a]["config"])
            row[a] = _per_arch(blocks[a], kept, mode, key, leds[a], cfg, wl, m[key] if key else m)
            loads += [row_timing(b, mode, key).load for b in blocks[a]]
        row.update(
            gap=v["gap"],
            wall_ratio=v["gap"] * F if v["gap"] is not None else None,
            estimate=est.to_dict(),
            state=state,
            verdict=v,
            # a busy machine's timings are kept in the file but are not a measurement
            usable=v["verdict"] != "machine busy",
        )
        summary.setdefault(mode, []).append(row)
    for a in ARCHS:
        _json_timings(results["arch"][a])
    dev = str(args.device).split(":")[0]
    results["summary"] = summary
    results["targets"] = {
        "device": dev,
        "gap": verdict.TARGETS.get(dev, {}),
        "scope": verdict.TARGET_SCOPE.get(dev, "no targets on this device"),
        "confidence": args.confidence,
        "resolution": args.resolution,
    }
    watched = [x for x in loads if x is not None and x.lost is not None]
    results["machine"] = {
        "watched": bool(watched),
        "busy_limit": args.busy_limit,
        "timed_blocks": len(loads),
        "contended_blocks": sum(x.contended(args.busy_limit) for x in watched),
        "median_lost": statistics.median(x.lost for x in watched) if watched else None,
    }
    return results
