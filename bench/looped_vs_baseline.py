"""Wall-clock against the FLOPs match: a budget-matched baseline / SMELT pair, side by side.

    python bench/looped_vs_baseline.py                       # CPU, the tiny pair, ~2 minutes
    python bench/looped_vs_baseline.py --preset 200M-S95 --device cuda --tokens 32768

For each architecture it measures (warm-up, repeats, median and spread) a training step
(forward + backward + AdamW), prefill, and per-token decode latency at batch 1 and a larger
batch, with tokens/s and memory. One table per mode puts the ledger's FLOPs ratio next to
the wall-clock ratio; their quotient is the efficiency gap (1.00: the loop costs exactly
its FLOPs). A per-component breakdown (attention, MoE GEMMs, routing, norms, embedding and
head, other) times each component in isolation at the same shapes, so what limits the gap
is visible. ``--json`` writes every number with the environment; ``--plot`` draws
wall-clock against FLOPs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import Timing, environment, measure  # noqa: E402

from smelt_model import budget, presets  # noqa: E402
from smelt_model.config import ModelConfig  # noqa: E402

MODES = ("train", "prefill", "decode")


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
    seq = min(args.seq_len, args.tokens)
    if args.tokens % seq:
        raise SystemExit(f"--tokens ({args.tokens}) must be a multiple of the sequence length ({seq})")
    return Workload(batch=args.tokens // seq, seq_len=seq, mean_doc_len=args.mean_doc_len,
                    decode_prompt=args.decode_prompt, decode_steps=args.decode_steps,
                    decode_batches=tuple(args.decode_batch))


# ----------------------------------------------------------------------------- measurements
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_reset(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    return 0


def _peak(device: torch.device, base: int) -> Optional[int]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    return None


def _timing(fn, device, args, setup=None) -> Timing:
    return measure(fn, device=device, warmup=args.warmup, repeats=args.repeats, setup=setup)


def measure_train(model, wl: Workload, device, args) -> dict[str, Any]:
    from smelt_kernels.executor import activation_memory, maybe_capture

    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, model.cfg.vocab_size, (wl.batch, wl.seq_len), generator=g).to(device)
    seg = packed_segments(wl.batch, wl.seq_len, wl.mean_doc_len, device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, capturable=device.type == "cuda")

    def step(i, s):
        out = model(i, s, labels=i)
        loss = out.loss + out.aux_loss if out.aux_loss is not None else out.loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=device.type != "cuda")
        return out.loss.detach()

    runner = maybe_capture(step, [ids, seg], capture=args.capture and device.type == "cuda")
    base = _peak_reset(device)
    t = _timing(lambda: runner(ids, seg), device, args)
    peak = _peak(device, base)
    params = [p for p in model.parameters()]
    _, act = activation_memory(lambda: model(ids, seg, labels=ids).loss, device=device,
                               exclude=params)
    model.zero_grad(set_to_none=True)
    return {"timing": t, "tokens": wl.tokens, "peak_bytes": peak,
            "activation_bytes": act.saved_bytes, "captured": runner.graph is not None,
            "capture_note": getattr(runner, "reason", None)}


def measure_prefill(model, wl: Workload, device, args) -> dict[str, Any]:
    from smelt_kernels.executor import maybe_capture

    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, model.cfg.vocab_size, (wl.batch, wl.seq_len), generator=g).to(device)
    seg = packed_segments(wl.batch, wl.seq_len, wl.mean_doc_len, device)
    model.eval()

    def fwd(i, s):
        with torch.no_grad():
            return model(i, s).logits

    runner = maybe_capture(fwd, [ids, seg], capture=args.capture and device.type == "cuda")
    base = _peak_reset(device)
    t = _timing(lambda: runner(ids, seg), device, args)
    return {"timing": t, "tokens": wl.tokens, "peak_bytes": _peak(device, base),
            "captured": runner.graph is not None}


def measure_decode(model, wl: Workload, device, args) -> dict[str, Any]:
    from smelt_model.generation import KVCache

    model.eval()
    out: dict[str, Any] = {}
    for B in wl.decode_batches:
        g = torch.Generator(device="cpu").manual_seed(2)
        P, n = wl.decode_prompt, wl.decode_steps
        prompt = torch.randint(0, model.cfg.vocab_size, (B, P), generator=g).to(device)
        seg1 = torch.zeros(B, 1, dtype=torch.long, device=device)
        cache = KVCache.for_model(model, B, P + n + args.warmup + 1)
        base = _peak_reset(device)
        with torch.no_grad():
            logits = model(prompt, torch.zeros_like(prompt), cache=cache, cache_pos=0).logits
            tok = logits[:, -1].argmax(-1, keepdim=True)
            pos = [P]

            def one():
                nonlocal tok
                lg = model(tok, seg1, cache=cache, cache_pos=pos[0]).logits
                tok = lg[:, -1].argmax(-1, keepdim=True)
                pos[0] += 1

            t = measure(one, device=device, warmup=args.warmup, repeats=n)
        out[f"batch{B}"] = {"timing": t, "batch": B, "context": P + n // 2,
                            "peak_bytes": _peak(device, base), "cache_bytes": cache.nbytes}
    return out


# ----------------------------------------------------------------------------- components
def component_timings(model, wl: Workload, device, args, train: bool) -> dict[str, float]:
    """Milliseconds per step spent in each component, timed in isolation at the step's shapes
    (one layer's component times the number of executed layers)."""
    from smelt_kernels.executor import Step
    from smelt_kernels.moe_gemm import moe_ffn, route
    from smelt_model.layers import ForwardContext

    cfg = model.cfg
    B, T, H = wl.batch, wl.seq_len, cfg.hidden_size
    dtype = next(model.parameters()).dtype
    L_exec = model.plan.executed_layers
    blk = model.layer(0)
    backend = None if model.backend == "auto" else model.backend
    seg = packed_segments(B, T, wl.mean_doc_len, device)
    cos, sin = model.rotary.tables(0, T, device)
    ctx = ForwardContext(cos=cos, sin=sin, segment_ids=seg, backend=backend)
    step = Step(0, 0, 0, 1.0, False)
    g = torch.Generator(device="cpu").manual_seed(3)

    def rnd(*shape, grad=False):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype).requires_grad_(grad)

    h = rnd(B, T, H, grad=train)
    x2 = rnd(B * T, H, grad=train)
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

    comps = {
        "attention": (lambda: blk.attn(h, ctx, step), L_exec),
        "moe_gemm": (lambda: moe_ffn(x2, blk.moe.w1, blk.moe.w2, weights, ids, backend=backend),
                     L_exec),
        "routing": (lambda: route(blk.moe.router(x2).float(), cfg.top_k,
                                  cfg.router_renormalize)[0], L_exec),
        "norms": (lambda: blk.attn_norm(h), 2 * L_exec + 1),
        "embed_head": (lambda: model.lm_loss(model.lm_head(model.embed(
            torch.zeros(B, T, dtype=torch.long, device=device))), torch.zeros(
            B, T, dtype=torch.long, device=device)) if train else model.lm_head(h), 1),
    }
    out = {}
    for name, (fn, count) in comps.items():
        t = measure(run(fn), device=device, warmup=1, repeats=max(2, args.repeats))
        out[name] = t.median_ms * count
        model.zero_grad(set_to_none=True)
    return out


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


def run_pair(args) -> dict[str, Any]:
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    base_cfg, smelt_cfg = presets.pair(args.preset)
    wl = make_workload(args)
    leds = {a: budget.ledger(c, wl.mean_doc_len, wl.seq_len, kv_dtype_bytes=dtype.itemsize)
            for a, c in (("baseline", base_cfg), ("smelt", smelt_cfg))}
    ratios = budget.compare(base_cfg, smelt_cfg, wl.mean_doc_len, wl.seq_len)
    modes = MODES if args.mode == "all" else (args.mode,)
    tasks = [(a, m) for a in ("baseline", "smelt") for m in modes]
    try:
        from tqdm import tqdm
        n_tasks = len(tasks) + 2 * sum(m != "decode" for m in modes)  # + component timings
        bar = tqdm(total=n_tasks, desc="measuring", unit="task", file=sys.stderr,
                   disable=args.quiet)
    except ImportError:
        bar = None

    results: dict[str, Any] = {"arch": {}}
    for arch, cfg in (("baseline", base_cfg), ("smelt", smelt_cfg)):
        model = build(cfg, device, dtype, args.backend, args.recompute)
        from smelt_kernels import backends as bk
        r: dict[str, Any] = {"config": cfg.to_dict(), "ledger": leds[arch].__dict__,
                             "params_total": model.num_params("total"),
                             "params_active": model.num_params("active"),
                             "backend_requested": args.backend,
                             "backends_available": bk.report(device)}
        for mode in modes:
            if bar is not None:
                bar.set_postfix_str(f"{arch} {mode}")
            if mode == "train":
                m = measure_train(model, wl, device, args)
            elif mode == "prefill":
                m = measure_prefill(model, wl, device, args)
            else:
                m = measure_decode(model, wl, device, args)
            if bar is not None:
                bar.update(1)
            if mode != "decode":
                m["components_ms"] = component_timings(model, wl, device, args, mode == "train")
                if bar is not None:
                    bar.update(1)
            r[mode] = m
        results["arch"][arch] = r
        del model
    if bar is not None:
        bar.close()
    results["ratios"] = {"flops": ratios.flops, "params": ratios.params, "kv": ratios.kv}
    results["workload"] = wl.__dict__
    return summarize(results, leds, wl, modes)


def summarize(results, leds, wl: Workload, modes) -> dict[str, Any]:
    F = results["ratios"]["flops"]
    summary = {}
    for mode in modes:
        rows = []
        keys = ["batch%d" % b for b in wl.decode_batches] if mode == "decode" else [None]
        for key in keys:
            per = {}
            for arch in ("baseline", "smelt"):
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
            rows.append(row)
        summary[mode] = rows
    results["summary"] = summary
    return results


# ----------------------------------------------------------------------------- output
def _fmt_bytes(n: Optional[int]) -> str:
    if n is None:
        return "-"
    return f"{n / 2**20:.1f} MiB"


def print_tables(res: dict[str, Any]) -> None:
    r = res["ratios"]
    wl = res["workload"]
    print(f"\npair {res['preset']}  device {res['device']}  dtype {res['dtype']}  backend "
          f"{res['backend']}  tokens/step {wl['batch'] * wl['seq_len']} "
          f"({wl['batch']} x {wl['seq_len']}, docs of {wl['mean_doc_len']:g})")
    print(f"ledger ratios (smelt / baseline): F {r['flops']:.4f}   params {r['params']:.4f}   "
          f"KV {r['kv']:.4f}")
    for mode, rows in res["summary"].items():
        print(f"\n== {mode} ==")
        print(f"{'':18} {'baseline':>12} {'smelt':>12} {'ratio':>8}")
        for row in rows:
            b, s = row["baseline"], row["smelt"]
            label = row["mode"]
            print(f"{label:18} {b['median_ms']:>10.2f}ms {s['median_ms']:>10.2f}ms "
                  f"{row['wall_ratio']:>8.3f}   (spread {b['spread']:.2f} / {s['spread']:.2f})")
            print(f"{'  tokens/s':18} {b['tokens_per_s']:>12.0f} {s['tokens_per_s']:>12.0f}")
            print(f"{'  GFLOP/s':18} {b['achieved_flops_per_s'] / 1e9:>12.1f} "
                  f"{s['achieved_flops_per_s'] / 1e9:>12.1f}")
            fr = row.get("decode_flops_ratio", row["flops_ratio"])
            print(f"{'  F ratio':18} {'':>12} {'':>12} {fr:>8.3f}")
            print(f"{'  gap (wall / F)':18} {'':>12} {'':>12} {row['wall_ratio'] / fr:>8.3f}")
        arch = res["arch"]
        if mode != "decode":
            cb, cs = arch["baseline"][mode]["components_ms"], arch["smelt"][mode]["components_ms"]
            tb = res["summary"][mode][0]["baseline"]["median_ms"]
            ts = res["summary"][mode][0]["smelt"]["median_ms"]
            print(f"  components (isolated, ms per step; other = step - components):")
            for name in list(cb) + ["other"]:
                vb = cb[name] if name != "other" else tb - sum(cb.values())
                vs = cs[name] if name != "other" else ts - sum(cs.values())
                ratio = vs / vb if vb > 0 else float("nan")
                print(f"    {name:14} {vb:>10.2f} ({100 * vb / tb:4.1f}%) {vs:>10.2f} "
                      f"({100 * vs / ts:4.1f}%) {ratio:>8.3f}")
        mem = []
        for a in ("baseline", "smelt"):
            m = arch[a][mode]
            if mode == "decode":
                first = next(iter(m.values()))
                mem.append(f"KV cache {_fmt_bytes(first['cache_bytes'])} (batch {first['batch']})")
            else:
                txt = f"peak {_fmt_bytes(m.get('peak_bytes'))}"
                if "activation_bytes" in m:
                    txt += f", activations saved {_fmt_bytes(m['activation_bytes'])}"
                mem.append(txt)
        print(f"  memory: baseline {mem[0]}; smelt {mem[1]}")


def plot(res: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib (pip install matplotlib, or the [plot] extra)")
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    markers = {"baseline": "o", "smelt": "s"}
    for mode, rows in res["summary"].items():
        for row in rows:
            for arch in ("baseline", "smelt"):
                p = row[arch]
                ax.scatter(p["flops"], p["median_ms"], marker=markers[arch], s=40)
                ax.annotate(f"{arch} {row['mode']}", (p["flops"], p["median_ms"]), fontsize=7,
                            xytext=(4, 2), textcoords="offset points")
            b = row["baseline"]
            xs = [b["flops"] * 0.8, b["flops"] * 1.4]
            ax.plot(xs, [b["median_ms"] * x / b["flops"] for x in xs], lw=0.6, color="gray")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("useful FLOPs per call (ledger)")
    ax.set_ylabel("wall-clock per call (ms)")
    ax.set_title(f"{res['preset']} on {res['device']}: gray = baseline's FLOP rate")
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", help=f"a matched pair: {', '.join(presets.pairs())}")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--backend", default="auto", choices=("auto", "torch", "cpu", "triton", "cuda"))
    ap.add_argument("--dtype", default=None, choices=("fp32", "bf16", "fp16"),
                    help="default: fp32 on the CPU, bf16 on CUDA")
    ap.add_argument("--tokens", type=int, default=None,
                    help="tokens per training/prefill step (default 2048 CPU, 32768 CUDA)")
    ap.add_argument("--seq-len", type=int, default=None,
                    help="context length (default 1024 CPU, 4096 CUDA)")
    ap.add_argument("--mean-doc-len", type=float, default=None,
                    help="packed document length (default 800, as in the paper)")
    ap.add_argument("--mode", default="all", choices=MODES + ("all",))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--decode-prompt", type=int, default=None, help="prompt length for decode")
    ap.add_argument("--decode-steps", type=int, default=None, help="timed decode steps")
    ap.add_argument("--decode-batch", type=int, nargs="+", default=None,
                    help="decode batch sizes (default 1 8; 1 64 on CUDA)")
    ap.add_argument("--recompute", default="none", choices=("none", "visit1", "all"))
    ap.add_argument("--no-capture", dest="capture", action="store_false",
                    help="do not capture CUDA graphs (CUDA only)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--json", help="write every number here")
    ap.add_argument("--plot", help="write a wall-clock vs FLOPs plot here (matplotlib)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    defaults = dict(dtype="bf16" if cuda else "fp32", tokens=32768 if cuda else 2048,
                    seq_len=4096 if cuda else 1024, mean_doc_len=800.0,
                    decode_prompt=512 if cuda else 128, decode_steps=32 if cuda else 8,
                    decode_batch=[1, 64] if cuda else [1, 8])
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.preset not in presets.pairs():
        ap.error(f"unknown pair {args.preset!r}; choose from {', '.join(presets.pairs())}")
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda but no CUDA device is available")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    res = run_pair(args)
    res.update(preset=args.preset, device=args.device, dtype=args.dtype, backend=args.backend,
               environment=environment(args.device))
    print_tables(res)
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
