"""Wall-clock against the FLOPs match: a budget-matched baseline / SMELT pair, side by side.

    python bench/looped_vs_baseline.py                       # CPU, the tiny pair, 1-2 minutes
    python bench/looped_vs_baseline.py --preset 200M-S95 --device cuda --tokens 32768

For each architecture it measures (warm-up, repeats, median and spread) a training step
(forward + backward + AdamW), prefill, and per-token decode latency at batch 1 and a larger
batch, with tokens/s and memory. One table per mode puts the ledger's FLOPs ratio next to
the wall-clock ratio; their quotient is the efficiency gap (1.00: the loop costs exactly
its FLOPs). ``--json`` writes every number with the environment; ``--plot`` draws
wall-clock against FLOPs. The printed legend explains every column.

How it measures, and why:

* **One architecture in memory at a time, in alternating blocks.** Before building anything
  the memory of the larger model (weights, gradients, AdamW state, activations, KV cache) is
  estimated and the run refused when it will not fit. Then the run is ``--rounds`` rounds;
  each round builds one architecture (seeded: the same weights every time), measures every
  mode for a block of repeats, frees it, and does the same for the other, in the order
  baseline, smelt | smelt, baseline | ... (ABBA), so a drift of the machine that is linear in
  time cancels out of the ratio, and each architecture is measured early and late. Calls of
  the two models cannot alternate one by one without both models in memory (the 100M pairs
  need ~12 GB each to train); rebuilding costs seconds, not timed.
* **Components add up to the step.** The step and its components (attention, MoE GEMMs,
  routing, norms, embedding + head + loss, the optimizer) are timed round-robin in one loop
  at the step's shapes and thread count (:func:`timing.measure_parts`). Timed at other
  moments, as separate measurements after the step, they met other load on a shared machine
  and summed to up to 3.6x the step. Where the components still exceed the step by more than
  ``--tolerance``, the measurement is repeated (``--max-tries``) and the row says so.
* **Decode** runs the model's single-token step compiled once
  (:class:`smelt_model.generation.DecodeStep`; ``--eager-decode`` for the eager model), and
  prints the bytes a token has to read (executed layers' weights with the selected experts,
  the head, the KV cache) and the achieved GB/s: decode is bound by memory traffic.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import Timing, environment, measure, measure_parts, merge, release_memory  # noqa: E402

from smelt_model import budget, memory, presets  # noqa: E402
from smelt_model.memory import available as available_memory  # noqa: E402
from smelt_model.memory import peak_rss  # noqa: E402
from smelt_model.config import ModelConfig  # noqa: E402

MODES = ("train", "prefill", "decode")
ARCHS = ("baseline", "smelt")
GiB = memory.GiB


class UsageError(ValueError):
    """A bad option or a run that cannot fit: one line on stderr, exit status 2."""


# ----------------------------------------------------------------------------- workload
def packed_segments(batch: int, seq_len: int, mean_doc_len: float, device) -> torch.Tensor:
    """Segment ids of documents packed like the ledger assumes: full documents of
    ``min(mean_doc_len, seq_len)`` tokens, the last one cut at the context end."""
    doc = max(1, int(round(min(mean_doc_len, seq_len))))
    seg = torch.arange(seq_len, device=device) // doc
    return seg[None].expand(batch, seq_len).contiguous()


@dataclass
class Workload:
    batch: int
    seq_len: int
    mean_doc_len: float
    decode_prompt: int
    decode_steps: int
    decode_batches: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len


def make_workload(args) -> Workload:
    """Check every numeric option (one :class:`UsageError` naming it) and build the workload."""
    positive = ("tokens", "seq_len", "repeats", "rounds", "decode_prompt", "decode_steps",
                "max_tries")
    for name in positive:
        v = getattr(args, name)
        if not isinstance(v, int) or v < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {v}")
    if args.warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {args.warmup}")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be a positive integer, got {args.threads}")
    if not (args.mean_doc_len > 0 and math.isfinite(args.mean_doc_len)):
        raise UsageError(f"--mean-doc-len must be a positive number, got {args.mean_doc_len}")
    if not 0 < args.tolerance < 1:
        raise UsageError(f"--tolerance must lie in (0, 1), got {args.tolerance}")
    if any(b < 1 for b in args.decode_batch):
        raise UsageError(f"--decode-batch sizes must be positive, got {args.decode_batch}")
    if args.repeats < args.rounds:
        raise UsageError(f"--repeats ({args.repeats}) must be at least --rounds ({args.rounds}):"
                         " every round times at least one repeat")
    seq = min(args.seq_len, args.tokens)
    if args.tokens % seq:
        raise UsageError(f"--tokens ({args.tokens}) must be a multiple of --seq-len ({seq})")
    return Workload(batch=args.tokens // seq, seq_len=seq, mean_doc_len=args.mean_doc_len,
                    decode_prompt=args.decode_prompt, decode_steps=args.decode_steps,
                    decode_batches=tuple(args.decode_batch))


def check_environment(args) -> None:
    """Backends, device and optional packages, before anything is built or measured."""
    from smelt_kernels import backends as bk

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but no CUDA device is available")
    if args.backend != "auto":
        why = bk.unavailable_reason(args.backend, args.device)
        if why is not None:
            raise UsageError(f"--backend {args.backend} cannot run on {args.device}: {why}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib (pip install matplotlib, or the [plot]"
                             " extra)") from None


# ----------------------------------------------------------------------------- memory
def decode_cache_len(wl: Workload, args) -> int:
    """Positions of one decode block's cache: prompt, warm-up and timed steps."""
    return wl.decode_prompt + decode_warmup(args) + steps_per_block(wl.decode_steps, args) + 1


def decode_warmup(args) -> int:
    return max(args.warmup, 0 if args.eager_decode else 2)  # the first calls compile


def steps_per_block(total: int, args) -> int:
    return -(-total // args.rounds)


def estimate_memory(cfg: ModelConfig, wl: Workload, args, dtype_bytes: int) -> dict[str, int]:
    """Bytes one architecture needs at its peak in this run, by part
    (:func:`smelt_model.memory.estimate` for the modes asked). On the 100M pairs at 512
    tokens it is about 6-8% below the measured peak RSS of the whole run (14.8 GiB), which
    the check's margin covers."""
    modes = MODES if args.mode == "all" else (args.mode,)
    decode = "decode" in modes
    return memory.estimate(cfg, tokens=wl.tokens, seq_len=wl.seq_len, train="train" in modes,
                           forward="prefill" in modes,
                           decode_batch=max(wl.decode_batches) if decode else 0,
                           decode_len=decode_cache_len(wl, args) if decode else 0,
                           param_bytes=dtype_bytes)


def check_memory(cfgs: dict[str, ModelConfig], wl: Workload, args, dtype_bytes: int,
                 available: Optional[int]) -> dict[str, dict[str, int]]:
    """The estimate per architecture; a :class:`UsageError` naming the larger one when it
    (with the margin) exceeds ``available`` bytes (only one architecture is ever in memory)."""
    est = {a: estimate_memory(c, wl, args, dtype_bytes) for a, c in cfgs.items()}
    try:
        memory.check(est, available, what=f"--preset {args.preset}", where=str(args.device),
                     hint="lower --tokens, pick a --mode, or a smaller --preset")
    except memory.MemoryRefusal as e:
        raise UsageError(str(e)) from None
    return est


# ----------------------------------------------------------------------------- runners
# Each runner builds the inputs and state for one architecture and returns a callable that
# performs one measured call, plus facts about it.
def _peak_of(fn: Callable[[], Any], device: torch.device) -> Optional[int]:
    """Peak CUDA memory of one call above what was allocated before it (None on the CPU)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def _batch(model, wl: Workload, device, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, model.cfg.vocab_size, (wl.batch, wl.seq_len), generator=g).to(device)
    return ids, packed_segments(wl.batch, wl.seq_len, wl.mean_doc_len, device)


def train_runner(model, wl: Workload, device, args):
    """A training step; gradients stay allocated between steps (zeroed, not freed), so the
    optimizer can be timed alone as a component and memory is the steady state's."""
    from smelt_kernels.executor import maybe_capture

    ids, seg = _batch(model, wl, device, 0)
    model.train()
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, capturable=cuda)

    def step(i, s):
        out = model(i, s, labels=i)
        loss = out.loss + out.aux_loss if out.aux_loss is not None else out.loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return out.loss.detach()

    runner = maybe_capture(step, [ids, seg], capture=args.capture and cuda)
    info = {"tokens": wl.tokens, "captured": runner.graph is not None,
            "capture_note": getattr(runner, "reason", None)}
    return (lambda: runner(ids, seg)), info, (ids, seg), opt


def prefill_runner(model, wl: Workload, device, args):
    from smelt_kernels.executor import maybe_capture

    ids, seg = _batch(model, wl, device, 1)
    model.eval()

    def fwd(i, s):
        with torch.no_grad():
            return model(i, s).logits

    runner = maybe_capture(fwd, [ids, seg], capture=args.capture and device.type == "cuda")
    info = {"tokens": wl.tokens, "captured": runner.graph is not None}
    return (lambda: runner(ids, seg)), info


def decode_runner(model, wl: Workload, B: int, device, args):
    """One greedy decode step per call, on a cache prefilled with a ``decode_prompt`` prompt,
    through :class:`DecodeStep` (compiled unless ``--eager-decode``)."""
    from smelt_model.generation import DecodeStep, KVCache

    model.eval()
    g = torch.Generator(device="cpu").manual_seed(2)
    P = wl.decode_prompt
    prompt = torch.randint(0, model.cfg.vocab_size, (B, P), generator=g).to(device)
    seg1 = torch.zeros(B, 1, dtype=torch.long, device=device)
    cache = KVCache.for_model(model, B, decode_cache_len(wl, args))
    with torch.no_grad():
        logits = model(prompt, torch.zeros_like(prompt), cache=cache, cache_pos=0).logits
    state = {"tok": logits[:, -1].argmax(-1, keepdim=True), "pos": P}
    step = DecodeStep(model, compile=not args.eager_decode)

    def one():
        lg = step(state["tok"], seg1, cache, state["pos"])
        state["tok"] = lg.argmax(-1, keepdim=True)
        state["pos"] += 1

    info = {"batch": B, "context": P + decode_warmup(args) + wl.decode_steps // 2,
            "cache_bytes": cache.nbytes}
    return one, info, step


def decode_bytes(cfg: ModelConfig, batch: int, context: int, dtype_bytes: int) -> float:
    """Bytes one decode step reads: per executed layer its attention, router and norm
    weights and the experts the batch selects (expected distinct experts under uniform
    routing, E (1 - (1 - k/E)^B)); the head; the KV cache up to ``context``."""
    p = budget.layer_params(cfg)
    E, k, H = cfg.n_experts, cfg.top_k, cfg.hidden_size
    distinct = E * (1.0 - (1.0 - k / E) ** batch)
    per_layer = p["attention"] + p["router"] + p["norms"] + distinct * 3 * H * cfg.expert_size
    weights = cfg.executed_layers * per_layer + H + cfg.vocab_size * H + batch * H
    kv = batch * context * 2 * cfg.executed_layers * cfg.kv_dim
    return (weights + kv) * dtype_bytes


# ----------------------------------------------------------------------------- components
def component_runners(model, wl: Workload, device, train: bool,
                      opt=None) -> dict[str, tuple[Callable, int]]:
    """Per component: a callable running it once at the step's shapes (forward, plus backward
    when ``train``), and how many times a step runs it."""
    from smelt_kernels.moe_gemm import moe_ffn, route

    cfg = model.cfg
    B, T, H = wl.batch, wl.seq_len, cfg.hidden_size
    dtype = next(model.parameters()).dtype
    L_exec = model.plan.executed_layers
    blk = model.layer(0)
    backend = None if model.backend == "auto" else model.backend
    seg = packed_segments(B, T, wl.mean_doc_len, device)
    cos, sin = model.rotary.tables(0, T, device)
    g = torch.Generator(device="cpu").manual_seed(3)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype).requires_grad_(train)

    h, x2 = rnd(B, T, H), rnd(B * T, H)
    zeros = torch.zeros(B, T, dtype=torch.long, device=device)
    with torch.no_grad():
        weights, ids = route(blk.moe.router(x2).float(), cfg.top_k, cfg.router_renormalize)
    weights = weights.requires_grad_(train)

    def run(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        if not train:
            def f():
                with torch.no_grad():
                    fn()
            return f

        def fb():
            y = fn()
            y.backward(torch.ones_like(y))
        return fb

    def head():
        if train:
            return model.lm_loss(model.lm_head(model.norm(model.embed(zeros))), zeros)
        return model.lm_head(model.norm(h))

    parts = {
        "attention": (run(lambda: blk.attn(h, seg, rope=(cos, sin), check_values=False)), L_exec),
        "moe_gemm": (run(lambda: moe_ffn(x2, blk.moe.gate_up_proj, blk.moe.down_proj, weights, ids,
                                         backend=backend, check_values=False)), L_exec),
        "routing": (run(lambda: route(blk.moe.router(x2).float(), cfg.top_k,
                                      cfg.router_renormalize)[0]), L_exec),
        "norms": (run(lambda: blk.attn_norm(h)), 2 * L_exec),
        "embed_head": (run(head), 1),
    }
    if opt is not None:
        parts["optimizer"] = (opt.step, 1)
    return parts


def component_flops(cfg, led: budget.Ledger, tokens: int, train: bool) -> dict[str, float]:
    """The ledger's FLOPs of each timed component over one step (``embed_head`` and
    ``optimizer``: the ledger counts none, so 0). They sum to the step's FLOPs less the
    final norm's."""
    p = budget.layer_params(cfg)
    per_token = 6.0 * cfg.executed_layers
    f = {
        "attention": per_token * p["attention"] + led.attention_flops_per_token,
        "moe_gemm": per_token * p["experts_active"],
        "routing": per_token * p["router"],
        "norms": per_token * p["norms"],
        "embed_head": 0.0,
    }
    if train:
        f["optimizer"] = 0.0
    scale = tokens * (1.0 if train else 1.0 / 3.0)
    return {k: v * scale for k, v in f.items()}


# ----------------------------------------------------------------------------- driver
def build(cfg, device, dtype, backend, recompute):
    from smelt_model.model import SmeltLM

    torch.manual_seed(0)
    model = SmeltLM(cfg, backend=backend, recompute=recompute)
    return model.to(device=device, dtype=dtype)


def flops_for(mode: str, led: budget.Ledger, cfg, wl: Workload, ctx: int = 0,
              batch: int = 1) -> float:
    """Useful FLOPs of one measured call (the ledger's convention, non-embedding)."""
    if mode == "train":
        return led.flops_per_token * wl.tokens
    if mode == "prefill":
        return led.flops_per_token * wl.tokens / 3
    n_exec = (led.flops_per_token - led.attention_flops_per_token) / 6
    return batch * (2 * n_exec + 4 * cfg.executed_layers * cfg.q_dim * ctx)


def measure_block(cfg: ModelConfig, wl: Workload, args, device, dtype, modes, first: bool,
                  bar) -> dict[str, Any]:
    """One architecture's block of one round: build it, measure every mode, free it."""
    from smelt_kernels.executor import activation_memory

    model = build(cfg, device, dtype, args.backend, args.recompute)
    timed = dict(device=device, warmup=args.warmup, repeats=steps_per_block(args.repeats, args),
                 tolerance=args.tolerance, max_tries=args.max_tries)
    out: dict[str, Any] = {"params_total": model.num_params("total"),
                           "params_active": model.num_params("active")}
    if "train" in modes:
        fn, info, (ids, seg), opt = train_runner(model, wl, device, args)
        parts = component_runners(model, wl, device, True, opt)
        out["train"] = dict(info, parts=measure_parts(fn, parts, **timed))
        if first:
            params = list(model.parameters())
            act = activation_memory(lambda: model(ids, seg, labels=ids).loss,
                                    device=device, exclude=params)[1]  # graph freed here
            del params
            out["train"].update(activation_bytes=act.saved_bytes, peak_bytes=_peak_of(fn, device))
        del fn, parts, opt
        model.zero_grad(set_to_none=True)
        bar.update(1)
    if "prefill" in modes:
        fn, info = prefill_runner(model, wl, device, args)
        parts = component_runners(model, wl, device, False)
        out["prefill"] = dict(info, parts=measure_parts(fn, parts, **timed),
                              peak_bytes=_peak_of(fn, device) if first else None)
        del fn, parts
        bar.update(1)
    if "decode" in modes:
        out["decode"] = {}
        for B in wl.decode_batches:
            fn, info, step = decode_runner(model, wl, B, device, args)
            t = measure(fn, device=device, warmup=decode_warmup(args),
                        repeats=steps_per_block(wl.decode_steps, args))
            out["decode"][f"batch{B}"] = dict(info, timing=t, compiled=step.compiled,
                                              eager_reason=step.reason)
            del fn, step
            bar.update(1)
    del model
    release_memory()
    out["peak_rss_bytes"] = peak_rss()
    return out


def _merge_parts(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    """The blocks of one mode: timings pooled, the add-up check redone on the pooled medians."""
    from timing import PartsTiming

    pts = [b["parts"] for b in blocks]
    step = merge([p.step for p in pts])
    parts = {k: merge([p.parts[k] for p in pts]) for k in pts[0].parts}
    counts = pts[0].counts
    frac = sum(parts[k].median_ms * counts[k] for k in parts) / step.median_ms
    pooled = PartsTiming(step, parts, counts, frac, pts[0].tolerance, max(p.tries for p in pts))
    out = {k: v for k, v in blocks[0].items() if k != "parts"}
    out.update(timing=step, components_ms=pooled.parts_ms, components_fraction=frac,
               components_tries=[p.tries for p in pts], components_note=pooled.note)
    return out


def run_pair(args) -> dict[str, Any]:
    from smelt_kernels import backends as bk

    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    cfgs = dict(zip(ARCHS, presets.pair(args.preset)))
    wl = make_workload(args)
    est = check_memory(cfgs, wl, args, dtype.itemsize, available_memory(device))
    leds = {a: budget.ledger(c, wl.mean_doc_len, wl.seq_len, kv_dtype_bytes=dtype.itemsize)
            for a, c in cfgs.items()}
    ratios = budget.compare(cfgs["baseline"], cfgs["smelt"], wl.mean_doc_len, wl.seq_len)
    modes = MODES if args.mode == "all" else (args.mode,)
    per_block = sum(len(wl.decode_batches) if m == "decode" else 1 for m in modes)
    bar = _progress(2 * args.rounds * per_block, args.quiet)
    blocks: dict[str, list[dict[str, Any]]] = {a: [] for a in ARCHS}
    for r in range(args.rounds):
        for a in (ARCHS if r % 2 == 0 else ARCHS[::-1]):
            bar.set_postfix_str(f"round {r + 1}/{args.rounds}: {a}")
            blocks[a].append(measure_block(cfgs[a], wl, args, device, dtype, modes,
                                           first=r == 0, bar=bar))
    bar.close()
    results: dict[str, Any] = {"arch": {}}
    for a in ARCHS:
        first = blocks[a][0]
        res = {"config": cfgs[a].to_dict(), "ledger": leds[a].__dict__,
               "params_total": first["params_total"], "params_active": first["params_active"],
               "memory_estimate_bytes": est[a], "backend_requested": args.backend,
               "peak_rss_bytes": [b["peak_rss_bytes"] for b in blocks[a]],
               "backends_available": bk.report(device)}
        for mode in ("train", "prefill"):
            if mode in modes:
                res[mode] = _merge_parts([b[mode] for b in blocks[a]])
                res[mode]["components_flops"] = component_flops(cfgs[a], leds[a], wl.tokens,
                                                                mode == "train")
        if "decode" in modes:
            res["decode"] = {}
            for key, d in first["decode"].items():
                t = merge([b["decode"][key]["timing"] for b in blocks[a]])
                nbytes = decode_bytes(cfgs[a], d["batch"], d["context"], dtype.itemsize)
                res["decode"][key] = dict(d, timing=t, bytes_per_step=nbytes,
                                          bytes_per_token=nbytes / d["batch"],
                                          gb_per_s=nbytes / (t.median_ms / 1e3) / 1e9)
        results["arch"][a] = res
    results["round_ratios"] = round_ratios(blocks, modes)
    results["ratios"] = {"flops": ratios.flops, "params": ratios.params, "kv": ratios.kv}
    results["workload"] = wl.__dict__
    results["schedule"] = {"rounds": args.rounds, "order": "ABBA blocks, one model in memory",
                           "repeats_per_block": steps_per_block(args.repeats, args)}
    return summarize(results, leds, wl, modes)


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
            out[name] = [_block_median(s, mode, key) / _block_median(b, mode, key) for b, s in pairs]
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


def summarize(results, leds, wl: Workload, modes) -> dict[str, Any]:
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
                per[arch] = {"median_ms": t.median_ms, "spread": t.spread,
                             "tokens_per_s": tokens / (t.median_ms / 1e3),
                             "flops": fl, "achieved_flops_per_s": fl / (t.median_ms / 1e3)}
                m["timing"] = t.to_dict()
            wall = per["smelt"]["median_ms"] / per["baseline"]["median_ms"]
            row = {"mode": mode if key is None else f"{mode} ({key})", "flops_ratio": F,
                   "wall_ratio": wall, "gap": wall / F, "baseline": per["baseline"],
                   "smelt": per["smelt"]}
            if mode == "decode":
                # decode FLOPs differ from the training ratio: report its own FLOP ratio too
                row["decode_flops_ratio"] = per["smelt"]["flops"] / per["baseline"]["flops"]
                row["gap"] = wall / row["decode_flops_ratio"]
            f_row = row.get("decode_flops_ratio", F)
            row["round_gaps"] = [x / f_row for x in results.get("round_ratios", {}).get(row["mode"], [])]
            rows.append(row)
        summary[mode] = rows
    results["summary"] = summary
    return results


# ----------------------------------------------------------------------------- output
LEGEND = """\
legend
  ratio       smelt / baseline wall-clock, medians of every timed call
  F ratio     the ledger's FLOPs, smelt / baseline, of the same call (decode: its own ratio)
  gap         ratio / F ratio: 1.00 = the loop costs exactly its FLOPs; 1.10 = 10% slower
  spread      (p80 - p20) / median of an architecture's samples. Above ~0.10 the machine was
              busy or changing clocks while measuring: rerun, or raise --repeats / --rounds,
              before trusting a ratio from that row
  gap by      the gap of each round alone (its two blocks ran back to back, so drift between
   round      rounds cancels): median, min and max. A target inside [min, max] is not told
              apart from the measured gap by this run
  components  each part timed alone at the step's shapes, round-robin with the step in one
              loop; ms per step (median x runs per step) and % of the step; the ratio column
              is smelt / baseline, F the part's FLOPs ratio (- where the ledger counts none)
  other       step - components: residual adds, rotary tables, router losses, reshapes and
              framework overhead (Python, dispatch, allocation), plus the parts' timing
              error. Components exceeding the step by more than {tol:.0%} are remeasured
              (up to --max-tries) and the row says so instead of printing a negative other
  decode      bytes/token: what one token reads (executed layers' weights with the experts
              its batch selects, the head, the KV cache); GB/s: bytes per step / step time"""


def _fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    return f"{n / 2**20:.1f} MiB"


def _component_lines(arch: dict[str, Any], mode: str, row: dict[str, Any]) -> list[str]:
    lines = []
    mb, ms = arch["baseline"][mode], arch["smelt"][mode]
    cb, cs = mb["components_ms"], ms["components_ms"]
    tb, ts = row["baseline"]["median_ms"], row["smelt"]["median_ms"]
    fb, fs = mb.get("components_flops", {}), ms.get("components_flops", {})
    ok = mb["components_note"] is None and ms["components_note"] is None
    lines.append(f"  components (ms per step, % of step){'':14}{'ratio':>8}")
    for name in list(cb) + ["other"]:
        if name == "other":
            if not ok:
                lines.append(f"    {'other':14} {'n/a':>10}        {'n/a':>10}         "
                             "(components exceed the step: see the note)")
                continue
            vb, vs = tb - sum(cb.values()), ts - sum(cs.values())
        else:
            vb, vs = cb[name], cs[name]
        ratio = f"{vs / vb:.3f}" if vb > 0 and vs > 0 else "-"
        f_ratio = f"{fs[name] / fb[name]:.3f}" if fb.get(name, 0) > 0 else "-"
        lines.append(f"    {name:14} {vb:>10.2f} ({100 * vb / tb:5.1f}%) {vs:>10.2f} "
                     f"({100 * vs / ts:5.1f}%) {ratio:>8}   F {f_ratio}")
    for a in ARCHS:
        m = arch[a][mode]
        tries = m["components_tries"]
        if m["components_note"]:
            lines.append(f"  note ({a}): {m['components_note']}")
        elif max(tries) > 1:
            lines.append(f"  note ({a}): components remeasured (tries per round {tries}) "
                         f"until they added up; now {100 * m['components_fraction']:.0f}% of "
                         "the step")
    return lines


def format_tables(res: dict[str, Any]) -> str:
    lines: list[str] = []
    print = lines.append  # noqa: A001 - the tables are built line by line
    r = res["ratios"]
    wl = res["workload"]
    sch = res["schedule"]
    print(f"pair {res['preset']}  device {res['device']}  dtype {res['dtype']}  backend "
          f"{res['backend']}  tokens/step {wl['batch'] * wl['seq_len']} "
          f"({wl['batch']} x {wl['seq_len']}, docs of {wl['mean_doc_len']:g})")
    print(f"ledger ratios (smelt / baseline): F {r['flops']:.4f}   params {r['params']:.4f}   "
          f"KV {r['kv']:.4f}")
    print(f"schedule: {sch['rounds']} rounds of {sch['order']}, "
          f"{sch['repeats_per_block']} timed repeats per block")
    arch = res["arch"]
    est = [sum(arch[a]["memory_estimate_bytes"].values()) / GiB for a in ARCHS]
    rss = [max((x or 0) for x in arch[a].get("peak_rss_bytes", [0])) / GiB for a in ARCHS]
    print(f"memory estimate: baseline {est[0]:.2f} GiB, smelt {est[1]:.2f} GiB; process peak "
          f"RSS after their blocks {rss[0]:.2f} / {rss[1]:.2f} GiB")
    for mode, rows in res["summary"].items():
        print("")
        print(f"== {mode} ==")
        print(f"{'':18} {'baseline':>12} {'smelt':>12} {'ratio':>8}")
        for row in rows:
            b, s = row["baseline"], row["smelt"]
            print(f"{row['mode']:18} {b['median_ms']:>10.2f}ms {s['median_ms']:>10.2f}ms "
                  f"{row['wall_ratio']:>8.3f}   (spread {b['spread']:.2f} / {s['spread']:.2f})")
            print(f"{'  tokens/s':18} {b['tokens_per_s']:>12.0f} {s['tokens_per_s']:>12.0f}")
            print(f"{'  GFLOP/s':18} {b['achieved_flops_per_s'] / 1e9:>12.1f} "
                  f"{s['achieved_flops_per_s'] / 1e9:>12.1f}")
            if mode == "decode":
                key = row["mode"].split("(")[1].rstrip(")")
                db, ds = arch["baseline"]["decode"][key], arch["smelt"]["decode"][key]
                print(f"{'  MiB/token':18} {db['bytes_per_token'] / 2**20:>12.2f} "
                      f"{ds['bytes_per_token'] / 2**20:>12.2f} "
                      f"{ds['bytes_per_token'] / db['bytes_per_token']:>8.3f}")
                print(f"{'  GB/s':18} {db['gb_per_s']:>12.1f} {ds['gb_per_s']:>12.1f}")
            fr = row.get("decode_flops_ratio", row["flops_ratio"])
            print(f"{'  F ratio':18} {'':>12} {'':>12} {fr:>8.3f}")
            print(f"{'  gap (wall / F)':18} {'':>12} {'':>12} {row['gap']:>8.3f}")
            g = sorted(row.get("round_gaps", []))
            if len(g) > 1:
                print(f"{'  gap by round':18} {'':>12} {'':>12} {statistics.median(g):>8.3f}   "
                      f"(min {g[0]:.3f}, max {g[-1]:.3f} over {len(g)} rounds)")
        if mode != "decode":
            for line in _component_lines(arch, mode, rows[0]):
                print(line)
        mem = []
        for a in ARCHS:
            m = arch[a][mode]
            if mode == "decode":
                first = next(iter(m.values()))
                how = "compiled" if first["compiled"] else f"eager ({first['eager_reason']})"
                mem.append(f"KV cache {_fmt_bytes(first['cache_bytes'])} (batch "
                           f"{first['batch']}), step {how}")
            else:
                peak = m.get("peak_bytes")
                txt = f"peak {_fmt_bytes(peak)}" if peak is not None else "peak n/a (CUDA only)"
                if "activation_bytes" in m:
                    txt += f", activations saved {_fmt_bytes(m['activation_bytes'])}"
                mem.append(txt)
        print(f"  memory: baseline {mem[0]}; smelt {mem[1]}")
    print("")
    print(LEGEND.format(tol=res["tolerance"]))
    return "\n".join(lines)


def plot(res: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    markers = {"baseline": "o", "smelt": "s"}
    colors = {"baseline": "tab:blue", "smelt": "tab:orange"}
    first_mode = next(iter(res["summary"]))
    for mode, rows in res["summary"].items():
        for row in rows:
            for arch in ARCHS:
                p = row[arch]
                ax.scatter(p["flops"], p["median_ms"], marker=markers[arch], s=40,
                           color=colors[arch], label=arch if mode == first_mode else None)
                ax.annotate(f"{arch} {row['mode']}", (p["flops"], p["median_ms"]), fontsize=7,
                            xytext=(6, 3) if arch == "smelt" else (6, -9),
                            textcoords="offset points")
            b = row["baseline"]
            xs = [b["flops"] * 0.8, b["flops"] * 1.4]
            ax.plot(xs, [b["median_ms"] * x / b["flops"] for x in xs], lw=0.6, color="gray")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("useful FLOPs per call (ledger)")
    ax.set_ylabel("wall-clock per call (ms)")
    ax.set_title(f"{res['preset']} on {res['device']}: gray = baseline's FLOP rate")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=130)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, as for every other bad option
        raise UsageError(message)


def parse_args(argv=None):
    ap = _Parser(description=__doc__.split("\n\n")[0],
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", help=f"a matched pair: {', '.join(presets.pairs())}")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--backend", default="auto", choices=("auto", "torch", "cpu", "triton", "cuda"))
    ap.add_argument("--dtype", default=None, choices=("fp32", "bf16", "fp16"),
                    help="default: fp32 on the CPU, bf16 on CUDA")
    ap.add_argument("--tokens", type=int, default=None,
                    help="tokens per training/prefill step (default 4096 CPU, 32768 CUDA)")
    ap.add_argument("--seq-len", type=int, default=None,
                    help="context length (default 2048 CPU, 4096 CUDA)")
    ap.add_argument("--mean-doc-len", type=float, default=None,
                    help="packed document length (default 800, as in the paper)")
    ap.add_argument("--mode", default="all", choices=MODES + ("all",))
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed repeats per architecture, over all rounds (default 6)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="alternating blocks per architecture (ABBA order; default 2)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed calls before each block")
    ap.add_argument("--tolerance", type=float, default=0.15,
                    help="how far components may exceed the step before a remeasure (0.15)")
    ap.add_argument("--max-tries", type=int, default=3,
                    help="measurements of a step and its components before giving up (3)")
    ap.add_argument("--decode-prompt", type=int, default=None, help="prompt length for decode")
    ap.add_argument("--decode-steps", type=int, default=None,
                    help="timed decode steps per architecture, over all rounds")
    ap.add_argument("--decode-batch", type=int, nargs="+", default=None,
                    help="decode batch sizes (default 1 8; 1 64 on CUDA)")
    ap.add_argument("--eager-decode", action="store_true",
                    help="decode with the eager model instead of the compiled decode step")
    ap.add_argument("--recompute", default="none", choices=("none", "visit1", "all"))
    ap.add_argument("--no-capture", dest="capture", action="store_false",
                    help="do not capture CUDA graphs (CUDA only)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--json", help="write every number here")
    ap.add_argument("--markdown", help="write the tables here as Markdown")
    ap.add_argument("--plot", help="write a wall-clock vs FLOPs plot here (matplotlib)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    defaults = dict(dtype="bf16" if cuda else "fp32", tokens=32768 if cuda else 4096,
                    seq_len=4096 if cuda else 2048, mean_doc_len=800.0, repeats=6,
                    decode_prompt=512 if cuda else 256, decode_steps=32 if cuda else 48,
                    decode_batch=[1, 64] if cuda else [1, 8])
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.preset not in presets.pairs():
        raise UsageError(f"--preset {args.preset!r} is not a pair; choose from "
                         f"{', '.join(presets.pairs())}")
    make_workload(args)
    check_environment(args)
    return args


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        if args.threads:
            torch.set_num_threads(args.threads)
        res = run_pair(args)
    except UsageError as e:
        print(f"looped_vs_baseline: error: {e}", file=sys.stderr)
        return 2
    res.update(preset=args.preset, device=args.device, dtype=args.dtype, backend=args.backend,
               tolerance=args.tolerance, environment=environment(args.device))
    text = format_tables(res)
    print("\n" + text)
    if args.markdown:
        env = res["environment"]
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(
            f"# looped vs baseline: {args.preset} on {args.device}\n\n"
            f"{env['date']} · {env['device_name']} · {env['cpu_count']} CPUs · torch "
            f"{env['torch']} · triton {env['triton']}\n\n"
            f"Command: `python bench/looped_vs_baseline.py {' '.join(argv or sys.argv[1:])}`\n\n"
            f"```\n{text}\n```\n")
        print(f"wrote {args.markdown}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2, default=str) + "\n")
        print(f"\nwrote {args.json}")
    if args.plot:
        plot(res, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
