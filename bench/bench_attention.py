"""Segment attention: smelt's kernels against SDPA with a mask and FlexAttention with a
document block mask, at the paper's 200M head shapes, forward and backward.

    python bench/bench_attention.py                   # CPU, fp32, batch 1: a few minutes
    python bench/bench_attention.py --device cuda     # bf16, batch 8 (32k tokens per step)

Shapes: baseline 10/2 query/KV heads x 128, SMELT 12/2 x 88, T = 4096. Document layouts
per row: one 4096-token document, mixed lengths (mean about 800) and short documents
(mean about 128). Useful FLOPs count only what the segment mask keeps: forward
4 * d_h * n_q * sum over documents of l(l+1)/2, backward 2.5x the forward.

Methods (same device, same inputs): ``smelt-<backend>`` (:func:`segment_attention`; on
CUDA the Triton kernels and, when built, the CUDA forward), ``sdpa-mask``
(``F.scaled_dot_product_attention`` with the boolean (T, T) mask built once per batch,
inputs pre-laid-out as (B, H, T, D)), ``flex`` (compiled ``flex_attention`` with a
document-causal block mask built once; no backward on CPU). The backward pass is timed
alone (``autograd.grad`` on a retained graph). ``vs smelt`` is the method's time over
smelt's for the same pass: above 1 means smelt is faster.

Writes ``bench/results/attention_<device>.{json,md}``. CPU timings on a machine shared
with other work are noisy; the ratios come from one process run.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import environment, measure, tflops, write_results  # noqa: E402

from smelt_kernels import backends  # noqa: E402
from smelt_kernels.attention import segment_attention  # noqa: E402

SHAPES = {"baseline 10/2x128": (10, 2, 128), "SMELT 12/2x88": (12, 2, 88)}
LAYOUTS = ("one", "mixed", "short")
COLUMNS = ["shape", "layout", "mean doc", "method", "pass", "ms", "p20", "p80", "TFLOP/s",
           "vs smelt"]


# ----------------------------------------------------------------------------- workload
def doc_lengths(layout: str, T: int, gen: torch.Generator) -> list[int]:
    """Document lengths filling one row of T tokens."""
    if layout == "one":
        return [T]
    lens: list[int] = []
    while sum(lens) < T:
        if layout == "mixed":  # exponential, mean about 800, at least 16 tokens
            n = 16 + int(torch.empty(1).exponential_(1 / 784, generator=gen).item())
        elif layout == "short":
            n = int(torch.randint(64, 193, (1,), generator=gen))
        else:
            raise ValueError(f"unknown layout {layout!r}")
        lens.append(min(n, T - sum(lens)))
    return lens


def workload(layout: str, B: int, T: int, device, seed: int = 0):
    """(segment_ids (B, T), per-row document lengths)."""
    gen = torch.Generator().manual_seed(seed)
    rows = [doc_lengths(layout, T, gen) for _ in range(B)]
    ids = torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows])
    return ids.to(device), rows


def useful_flops(rows: list[list[int]], n_q: int, d_h: int) -> float:
    """Forward FLOPs the segment mask keeps: 4 d_h n_q sum l(l+1)/2."""
    return 4.0 * d_h * n_q * sum(l * (l + 1) / 2 for r in rows for l in r)


# ----------------------------------------------------------------------------- methods
def _sdpa(q, k, v, ids):
    """Inputs in SDPA's (B, H, T, D) layout and the boolean mask, both prepared once."""
    T = ids.shape[1]
    pos = torch.arange(T, device=ids.device)
    mask = ((ids[:, :, None] == ids[:, None, :]) & (pos[None, None, :] <= pos[None, :, None]))[:, None]
    qh, kh, vh = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    return (lambda: F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True),
            (qh, kh, vh))


_FLEX: dict[str, Callable] = {}


def _flex(q, k, v, ids):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    B, T = ids.shape

    def document_causal(b, h, qi, ki):
        return (ids[b, qi] == ids[b, ki]) & (ki <= qi)

    block_mask = create_block_mask(document_causal, B, None, T, T, device=ids.device)
    qh, kh, vh = (x.detach().transpose(1, 2).contiguous() for x in (q, k, v))
    if ids.device.type != "cpu":  # FlexAttention has no backward on CPU
        qh, kh, vh = (x.requires_grad_() for x in (qh, kh, vh))
    fn = _FLEX["fn"]
    return (lambda: fn(qh, kh, vh, block_mask=block_mask, enable_gqa=True)), (qh, kh, vh)


def _smelt(name):
    def build(q, k, v, ids):
        leaves = tuple(x.detach().clone().requires_grad_() for x in (q, k, v))
        return (lambda: segment_attention(*leaves, ids, backend=name, check_values=False)), leaves
    return build


def methods_for(device: torch.device, skip_flex: bool) -> list[tuple[str, Callable, bool]]:
    """(name, builder, time the backward) per method; smelt's first."""
    out = []
    if device.type == "cuda":
        out.append(("smelt-triton", _smelt("triton"), True))
        if backends.unavailable_reason("cuda", device) is None:
            # the CUDA kernel is forward-only (its backward is the Triton one above)
            out.append(("smelt-cuda", _smelt("cuda"), False))
    else:
        out.append(("smelt-cpu", _smelt("cpu"), True))
    out.append(("sdpa-mask", _sdpa, True))
    if not skip_flex:
        out.append(("flex", _flex, device.type != "cpu"))
    return out


# ----------------------------------------------------------------------------- measuring
def time_method(build, backward, q, k, v, ids, device, args) -> dict[str, Optional[object]]:
    fwd, leaves = build(q, k, v, ids)
    res: dict[str, Optional[object]] = {}
    with torch.no_grad():
        res["fwd"] = measure(fwd, device=device, warmup=args.warmup, repeats=args.repeats)
    if not backward:
        res["bwd"] = None
        res["bwd_error"] = ("no backward on CPU" if device.type == "cpu"
                            else "forward-only kernel")
    elif not args.forward_only:
        out = fwd()
        do = torch.randn_like(out)
        try:
            res["bwd"] = measure(lambda: torch.autograd.grad(out, leaves, do, retain_graph=True),
                                 device=device, warmup=args.warmup, repeats=args.repeats)
        except (RuntimeError, NotImplementedError) as e:  # e.g. a forward-only kernel
            res["bwd"] = None
            res["bwd_error"] = f"{type(e).__name__}: {e}"
        del out
    return res


def run(args) -> list[dict]:
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("bench_attention.py: --device cuda but no CUDA device is available")
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    B = args.batch
    rows = []
    for shape, (n_q, n_kv, d_h) in SHAPES.items():
        gen = torch.Generator().manual_seed(1)
        q = torch.randn(B, args.seq, n_q, d_h, generator=gen).to(device, dtype)
        k = torch.randn(B, args.seq, n_kv, d_h, generator=gen).to(device, dtype)
        v = torch.randn(B, args.seq, n_kv, d_h, generator=gen).to(device, dtype)
        for layout in args.layouts:
            ids, docs = workload(layout, B, args.seq, device, seed=2)
            flops = useful_flops(docs, n_q, d_h)
            mean_doc = B * args.seq / sum(len(r) for r in docs)
            per_pass: dict[str, dict[str, object]] = {}
            for name, build, backward in methods_for(device, args.skip_flex):
                try:
                    per_pass[name] = time_method(build, backward, q, k, v, ids, device, args)
                except Exception as e:  # a baseline that cannot run here is reported, not fatal
                    per_pass[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                print(f"{shape:18s} {layout:6s} {name:16s} " + "  ".join(
                    f"{p} {t.median_ms:9.1f} ms" for p, t in per_pass[name].items()
                    if hasattr(t, "median_ms")), flush=True)
            ours = next(iter(per_pass.values()))
            for name, res in per_pass.items():
                for p, mult in (("fwd", 1.0), ("bwd", 2.5)):
                    t = res.get(p)
                    row = {"shape": shape, "layout": layout, "mean doc": round(mean_doc),
                           "method": name, "pass": p, "useful_gflop": flops * mult / 1e9}
                    if t is None or not hasattr(t, "median_ms"):
                        row["ms"] = None
                        row["note"] = res.get("error") or res.get("bwd_error") or "not supported"
                    else:
                        base = ours.get(p)
                        row.update({"ms": t.median_ms, "p20": t.p20_ms, "p80": t.p80_ms,
                                    "TFLOP/s": tflops(flops * mult, t.median_ms),
                                    "vs smelt": (t.median_ms / base.median_ms
                                                 if hasattr(base, "median_ms") else None),
                                    "timing": t.to_dict()})
                    rows.append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--batch", type=int, default=None, help="default: 1 on CPU, 8 on CUDA")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--forward-only", action="store_true")
    ap.add_argument("--skip-flex", action="store_true", help="skip FlexAttention (compiles)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: torch's); 1 gives stable numbers on a "
                         "machine whose cores other jobs share")
    ap.add_argument("--note", default="", help="a line added to the results' notes")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.batch = args.batch or (8 if cuda else 1)
    args.warmup = args.warmup if args.warmup is not None else (3 if cuda else 2)
    args.repeats = args.repeats or (20 if cuda else 5)
    rows = run(args)
    dev = torch.device(args.device)
    env = environment(dev)
    env.update(dtype=args.dtype, batch=args.batch, seq=args.seq)
    notes = (f"B={args.batch}, T={args.seq}, {args.dtype}, {torch.get_num_threads()} CPU "
             f"thread(s); median of {args.repeats} after "
             f"{args.warmup} warm-up. TFLOP/s counts useful FLOPs only (backward 2.5x forward). "
             "'vs smelt' = method time / smelt time for the same pass (> 1: smelt faster).")
    if dev.type == "cpu":
        notes += (" CPU: measured on a 2-core machine shared with other jobs, so absolute "
                  "times are noisy; FlexAttention has no CPU backward.")
    if args.note:
        notes += f" {args.note}"
    seen = set()
    for r in rows:
        key = (r["method"], r["pass"], r.get("note"))
        if r.get("note") and key not in seen:
            seen.add(key)
            notes += f"\n- {r['method']} {r['pass']}: {r['note']}"
    j, m = write_results(f"attention_{dev.type}", rows, COLUMNS, args.out, env,
                         title=f"Segment attention on {dev.type}", notes=notes)
    print(open(m).read())


if __name__ == "__main__":
    main()
