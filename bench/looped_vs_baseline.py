"""Wall-clock against the FLOPs match: a budget-matched baseline / SMELT pair, side by side.

    python bench/looped_vs_baseline.py                       # CPU, the tiny pair, 1-2 minutes
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
from timing import Timing, environment, measure_interleaved  # noqa: E402

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


# ----------------------------------------------------------------------------- runners
# Each runner builds the inputs and state for one architecture and returns a callable that
# performs one measured call, plus facts about it. The two architectures' callables are then
# timed round-robin (timing.measure_interleaved), so drift of a shared machine cancels out
# of their ratio.
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
        opt.zero_grad(set_to_none=not cuda)
        return out.loss.detach()

    runner = maybe_capture(step, [ids, seg], capture=args.capture and cuda)
    info = {"tokens": wl.tokens, "captured": runner.graph is not None,
            "capture_note": getattr(runner, "reason", None)}
    return (lambda: runner(ids, seg)), info, (ids, seg)


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
    """One greedy decode step per call, on a cache prefilled with a ``decode_prompt`` prompt."""
    from smelt_model.generation import KVCache

    model.eval()
    g = torch.Generator(device="cpu").manual_seed(2)
    P = wl.decode_prompt
    calls = 2 * args.warmup + wl.decode_steps + 2
    prompt = torch.randint(0, model.cfg.vocab_size, (B, P), generator=g).to(device)
    seg1 = torch.zeros(B, 1, dtype=torch.long, device=device)
    cache = KVCache.for_model(model, B, P + calls)
    with torch.no_grad():
        logits = model(prompt, torch.zeros_like(prompt), cache=cache, cache_pos=0).logits
    state = {"tok": logits[:, -1].argmax(-1, keepdim=True), "pos": P}

    def one():
        with torch.no_grad():
            lg = model(state["tok"], seg1, cache=cache, cache_pos=state["pos"]).logits
        state["tok"] = lg[:, -1].argmax(-1, keepdim=True)
        state["pos"] += 1

    info = {"batch": B, "context": P + wl.decode_steps // 2, "cache_bytes": cache.nbytes}
    return one, info


# ----------------------------------------------------------------------------- components
def component_runners(model, wl: Workload, device, train: bool) -> dict[str, tuple[Callable, int]]:
    """Per component: a callable running it once at the step's shapes (forward, plus backward
    when ``train``), and how many times a step runs it."""
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

    return {
        "attention": (run(lambda: blk.attn(h, ctx, step)), L_exec),
        "moe_gemm": (run(lambda: moe_ffn(x2, blk.moe.w1, blk.moe.w2, weights, ids,
                                         backend=backend, check_values=False)), L_exec),
        "routing": (run(lambda: route(blk.moe.router(x2).float(), cfg.top_k,
                                      cfg.router_renormalize)[0]), L_exec),
        "norms": (run(lambda: blk.attn_norm(h)), 2 * L_exec),
        "embed_head": (run(head), 1),
    }


def component_flops(cfg, led: budget.Ledger, tokens: int, train: bool) -> dict[str, float]:
    """The ledger's FLOPs of each timed component over one step (``embed_head``: the ledger
    counts no embedding or head FLOPs, so 0). They sum to the step's FLOPs less the final
    norm's."""
    p = budget.layer_params(cfg)
    per_token = 6.0 * cfg.executed_layers
    f = {
        "attention": per_token * p["attention"] + led.attention_flops_per_token,
        "moe_gemm": per_token * p["experts_active"],
        "routing": per_token * p["router"],
        "norms": per_token * p["norms"],
        "embed_head": 0.0,
    }
    scale = tokens * (1.0 if train else 1.0 / 3.0)
    return {k: v * scale for k, v in f.items()}


# ----------------------------------------------------------------------------- driver
ARCHS = ("baseline", "smelt")


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


def _components(models, wl, device, args, train: bool) -> dict[str, dict[str, float]]:
    runners = {a: component_runners(models[a], wl, device, train) for a in ARCHS}
    out: dict[str, dict[str, float]] = {a: {} for a in ARCHS}
    for name in runners["baseline"]:
        t = measure_interleaved({a: runners[a][name][0] for a in ARCHS}, device=device,
                                warmup=1, repeats=max(3, args.repeats))
        for a in ARCHS:
            out[a][name] = t[a].median_ms * runners[a][name][1]
    for m in models.values():
        m.zero_grad(set_to_none=True)
    return out


def run_pair(args) -> dict[str, Any]:
    from smelt_kernels import backends as bk
    from smelt_kernels.executor import activation_memory

    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    cfgs = dict(zip(ARCHS, presets.pair(args.preset)))
    wl = make_workload(args)
    leds = {a: budget.ledger(c, wl.mean_doc_len, wl.seq_len, kv_dtype_bytes=dtype.itemsize)
            for a, c in cfgs.items()}
    ratios = budget.compare(cfgs["baseline"], cfgs["smelt"], wl.mean_doc_len, wl.seq_len)
    modes = MODES if args.mode == "all" else (args.mode,)
    models = {a: build(c, device, dtype, args.backend, args.recompute) for a, c in cfgs.items()}
    results: dict[str, Any] = {"arch": {a: {
        "config": cfgs[a].to_dict(), "ledger": leds[a].__dict__,
        "params_total": models[a].num_params("total"),
        "params_active": models[a].num_params("active"),
        "backend_requested": args.backend, "backends_available": bk.report(device),
    } for a in ARCHS}}

    n_tasks = sum(2 if m != "decode" else len(wl.decode_batches) for m in modes)
    bar = _progress(n_tasks, args.quiet)
    timed = dict(device=device, warmup=args.warmup, repeats=args.repeats)
    for mode in modes:
        res = {a: results["arch"][a] for a in ARCHS}
        if mode == "train":
            made = {a: train_runner(models[a], wl, device, args) for a in ARCHS}
            bar.set_postfix_str("train")
            t = measure_interleaved({a: made[a][0] for a in ARCHS}, **timed)
            for a in ARCHS:
                fn, info, (ids, seg) = made[a]
                params = list(models[a].parameters())
                _, act = activation_memory(lambda: models[a](ids, seg, labels=ids).loss,
                                           device=device, exclude=params)
                res[a]["train"] = dict(info, timing=t[a], peak_bytes=_peak_of(fn, device),
                                       activation_bytes=act.saved_bytes)
            del made
        elif mode == "prefill":
            made = {a: prefill_runner(models[a], wl, device, args) for a in ARCHS}
            bar.set_postfix_str("prefill")
            t = measure_interleaved({a: made[a][0] for a in ARCHS}, **timed)
            for a in ARCHS:
                res[a]["prefill"] = dict(made[a][1], timing=t[a],
                                         peak_bytes=_peak_of(made[a][0], device))
            del made
        else:
            for a in ARCHS:
                res[a]["decode"] = {}
            for B in wl.decode_batches:
                made = {a: decode_runner(models[a], wl, B, device, args) for a in ARCHS}
                bar.set_postfix_str(f"decode batch {B}")
                t = measure_interleaved({a: made[a][0] for a in ARCHS}, device=device,
                                        warmup=args.warmup, repeats=wl.decode_steps)
                for a in ARCHS:
                    res[a]["decode"][f"batch{B}"] = dict(made[a][1], timing=t[a],
                                                         peak_bytes=None)
                bar.update(1)
                del made
            continue
        bar.update(1)
        bar.set_postfix_str(f"{mode} components")
        comps = _components(models, wl, device, args, mode == "train")
        for a in ARCHS:
            res[a][mode]["components_ms"] = comps[a]
            res[a][mode]["components_flops"] = component_flops(cfgs[a], leds[a], wl.tokens,
                                                               mode == "train")
        bar.update(1)
    bar.close()
    results["ratios"] = {"flops": ratios.flops, "params": ratios.params, "kv": ratios.kv}
    results["workload"] = wl.__dict__
    return summarize(results, leds, wl, modes)


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


def format_tables(res: dict[str, Any]) -> str:
    lines: list[str] = []
    print = lines.append  # noqa: A001 - the tables are built line by line
    r = res["ratios"]
    wl = res["workload"]
    print(f"pair {res['preset']}  device {res['device']}  dtype {res['dtype']}  backend "
          f"{res['backend']}  tokens/step {wl['batch'] * wl['seq_len']} "
          f"({wl['batch']} x {wl['seq_len']}, docs of {wl['mean_doc_len']:g})")
    print(f"ledger ratios (smelt / baseline): F {r['flops']:.4f}   params {r['params']:.4f}   "
          f"KV {r['kv']:.4f}")
    for mode, rows in res["summary"].items():
        print("")
        print(f"== {mode} ==")
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
            fb = arch["baseline"][mode].get("components_flops", {})
            fs = arch["smelt"][mode].get("components_flops", {})
            print("  components (each timed alone at the step's shapes, ms per step;"
                  " other = step - components, and absorbs their timing error;"
                  " F ratio: the component's ledger FLOPs, smelt / baseline):")
            for name in list(cb) + ["other"]:
                vb = cb[name] if name != "other" else tb - sum(cb.values())
                vs = cs[name] if name != "other" else ts - sum(cs.values())
                ratio = f"{vs / vb:.3f}" if vb > 0 and vs > 0 else "-"
                f_ratio = f"{fs[name] / fb[name]:.3f}" if fb.get(name, 0) > 0 else "-"
                print(f"    {name:14} {vb:>10.2f} ({100 * vb / tb:4.1f}%) {vs:>10.2f} "
                      f"({100 * vs / ts:4.1f}%) {ratio:>8}   F {f_ratio}")
        mem = []
        for a in ("baseline", "smelt"):
            m = arch[a][mode]
            if mode == "decode":
                first = next(iter(m.values()))
                mem.append(f"KV cache {_fmt_bytes(first['cache_bytes'])} (batch {first['batch']})")
            else:
                peak = m.get("peak_bytes")
                txt = f"peak {_fmt_bytes(peak)}" if peak is not None else "peak n/a (CUDA only)"
                if "activation_bytes" in m:
                    txt += f", activations saved {_fmt_bytes(m['activation_bytes'])}"
                mem.append(txt)
        print(f"  memory: baseline {mem[0]}; smelt {mem[1]}")
    return "\n".join(lines)


def plot(res: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib (pip install matplotlib, or the [plot] extra)")
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    markers = {"baseline": "o", "smelt": "s"}
    colors = {"baseline": "tab:blue", "smelt": "tab:orange"}
    for mode, rows in res["summary"].items():
        for row in rows:
            for arch in ("baseline", "smelt"):
                p = row[arch]
                ax.scatter(p["flops"], p["median_ms"], marker=markers[arch], s=40,
                           color=colors[arch], label=arch if mode == "train" else None)
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


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
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
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats (default 5)")
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
    ap.add_argument("--markdown", help="write the tables here as Markdown")
    ap.add_argument("--plot", help="write a wall-clock vs FLOPs plot here (matplotlib)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    defaults = dict(dtype="bf16" if cuda else "fp32", tokens=32768 if cuda else 4096,
                    seq_len=4096 if cuda else 2048, mean_doc_len=800.0, repeats=5,
                    decode_prompt=512 if cuda else 256, decode_steps=32 if cuda else 16,
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
