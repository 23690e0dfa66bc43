"""Segment attention: smelt's kernels against SDPA with a mask and FlexAttention with a
document block mask, at the paper's 200M head shapes and the tiny pair's, forward and
backward; on the CPU also the native kernel against the ATen-chunked path, and the head-dim
target (below).

    python bench/bench_attention.py                      # CPU, fp32, batch 1: prints only
    python bench/bench_attention.py --out runs/bench     # ... and writes runs/bench/
    python bench/bench_attention.py --device cuda        # bf16, batch 8 (32k tokens per step)

Shapes: paper baseline 10/2 query/KV heads x 128 and SMELT 12/2 x 88 at T = 4096; tiny
baseline 4/1 x 96 and tiny SMELT 5/1 x 64 (smelt_model/presets.py) at T = 2048 (the tiny
main job's sequence length); ``--seq`` sets one T for all. Document layouts
per row: one document filling the row, mixed lengths (mean about 800) and short documents
(mean about 128). Useful FLOPs count only what the segment mask keeps: forward
4 * d_h * n_q * sum over documents of l(l+1)/2, backward 2.5x the forward.

Methods (same device, same inputs): ``smelt-<backend>`` (:func:`segment_attention`; on
CUDA the Triton kernels and, when built, the CUDA forward; on the CPU the native kernel,
or the chunked path where the native one is not built: the notes say which),
``cpu-chunked`` (CPU: the "cpu" backend's ATen-chunked path, the native kernel's
predecessor), ``sdpa-mask``
(``F.scaled_dot_product_attention`` with the boolean (T, T) mask built once per batch,
inputs pre-laid-out as (B, H, T, D)), ``flex`` (compiled ``flex_attention`` with a
document-causal block mask built once; no backward on CPU). The backward pass is timed
alone (``autograd.grad`` on a retained graph). Each row gives ``ms``, ``p20_ms``,
``p80_ms``, ``spread``, ``tflops`` and ``vs_smelt``, the method's time over smelt's for the
same pass: above 1 means smelt is faster (:func:`smelt_tools.timing.result_row`).

Head-dim target (CPU, native kernel): its achieved FLOP rate at the tiny SMELT heads
(d_h 64, 5:1 GQA) over its rate at the tiny baseline heads (d_h 96, 4:1) at the same T and
documents, forward and backward, timed interleaved (A, B, A, B, ...); the issue asks for
at least 0.95. Reported as medians with the p20-p80 spread.

With ``--out DIR`` writes ``DIR/attention_<device>.{json,md}`` (``--out`` alone: into
bench/results, where the committed results live); without it nothing is written. CPU
timings on a machine shared with other work are noisy; the ratios come from one process run.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from output_paths import out_folder

from smelt_kernels import backends
from smelt_kernels.attention import cpu as attention_cpu
from smelt_kernels.attention import segment_attention, segment_bounds
from smelt_tools import cli
from smelt_tools.cli import UsageError
from smelt_tools.timing import (
    check_device,
    environment,
    markdown_table,
    measure,
    measure_interleaved,
    result_row,
    write_results,
)

PROG = "bench_attention"

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# (query heads, KV heads, head dim, default T)
SHAPES = {
    "baseline 10/2x128": (10, 2, 128, 4096),
    "SMELT 12/2x88": (12, 2, 88, 4096),
    "tiny baseline 4/1x96": (4, 1, 96, 2048),
    "tiny SMELT 5/1x64": (5, 1, 64, 2048),
}
TARGET = ("tiny SMELT 5/1x64", "tiny baseline 4/1x96")  # rate of the first over the second
TARGET_RATIO = 0.95
LAYOUTS = ("one", "mixed", "short")
DTYPES = ("float32", "bfloat16", "float16")
COLUMNS = [
    "shape",
    "T",
    "layout",
    "mean doc",
    "method",
    "pass",
    "ms",
    "p20_ms",
    "p80_ms",
    "tflops",
    "vs_smelt",
]
TARGET_COLUMNS = [
    "T",
    "layout",
    "pass",
    "d64 5:1 ms",
    "d96 4:1 ms",
    "d64 GFLOP/s",
    "d96 GFLOP/s",
    "spread",
    "rate ratio",
    "target",
]


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
    ids = torch.stack(
        [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows]
    )
    return ids.to(device), rows


def useful_flops(rows: list[list[int]], n_q: int, d_h: int) -> float:
    """Forward FLOPs the segment mask keeps: 4 d_h n_q sum l(l+1)/2."""
    return 4.0 * d_h * n_q * sum(l * (l + 1) / 2 for r in rows for l in r)


# ----------------------------------------------------------------------------- methods
def _sdpa(q, k, v, ids):
    """Inputs in SDPA's (B, H, T, D) layout and the boolean mask, both prepared once."""
    T = ids.shape[1]
    pos = torch.arange(T, device=ids.device)
    mask = ((ids[:, :, None] == ids[:, None, :]) & (pos[None, None, :] <= pos[None, :, None]))[
        :, None
    ]
    qh, kh, vh = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    return (
        lambda: F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True),
        (qh, kh, vh),
    )


_FLEX: dict[str, Callable] = {}


def _flex(q, k, v, ids):
    # FlexAttention's module is loaded only when that method runs (--skip-flex never does)
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


class _Chunked(torch.autograd.Function):
    """The "cpu" backend's ATen-chunked path as an autograd function (the comparison)."""

    @staticmethod
    def forward(ctx, q, k, v, start, end, scale):
        o, lse, _ = attention_cpu.chunked_forward(q, k, v, start, scale, False)
        ctx.save_for_backward(q, k, v, o, lse, start, end)
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, start, end = ctx.saved_tensors
        dq, dk, dv = attention_cpu.chunked_backward(do, q, k, v, o, lse, start, end, ctx.scale)
        return dq, dk, dv, None, None, None


def _chunked(q, k, v, ids):
    leaves = tuple(x.detach().clone().requires_grad_() for x in (q, k, v))
    start, end = segment_bounds(ids)
    scale = q.shape[-1] ** -0.5
    return (lambda: _Chunked.apply(*leaves, start, end, scale)), leaves


def methods_for(
    device: torch.device, skip_flex: bool, only: Optional[list[str]] = None
) -> list[tuple[str, Callable, bool]]:
    """(name, builder, time the backward) per method; smelt's first."""
    out = []
    if device.type == "cuda":
        out.append(("smelt-triton", _smelt("triton"), True))
        if backends.unavailable_reason("cuda", device) is None:
            # the CUDA kernel is forward-only (its backward is the Triton one above)
            out.append(("smelt-cuda", _smelt("cuda"), False))
    else:
        out.append(("smelt-cpu", _smelt("cpu"), True))
        out.append(("cpu-chunked", _chunked, True))
    out.append(("sdpa-mask", _sdpa, True))
    if not skip_flex:
        out.append(("flex", _flex, device.type != "cpu"))
    if only:
        out = [m for i, m in enumerate(out) if i == 0 or m[0] in only]
    return out


# ----------------------------------------------------------------------------- measuring
def time_method(build, backward, q, k, v, ids, device, args) -> dict[str, Optional[object]]:
    fwd, leaves = build(q, k, v, ids)
    res: dict[str, Optional[object]] = {}
    with torch.no_grad():
        res["fwd"] = measure(fwd, device=device, warmup=args.warmup, repeats=args.repeats)
    if not backward:
        res["bwd"] = None
        res["bwd_error"] = "no backward on CPU" if device.type == "cpu" else "forward-only kernel"
    elif not args.forward_only:
        out = fwd()
        do = torch.randn_like(out)
        try:
            res["bwd"] = measure(
                lambda: torch.autograd.grad(out, leaves, do, retain_graph=True),
                device=device,
                warmup=args.warmup,
                repeats=args.repeats,
            )
        except (RuntimeError, NotImplementedError) as e:  # e.g. a forward-only kernel
            res["bwd"] = None
            res["bwd_error"] = f"{type(e).__name__}: {e}"
        del out
    return res


def run(args) -> list[dict]:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    B = args.batch
    rows = []
    for shape in args.shapes:
        n_q, n_kv, d_h, T = SHAPES[shape]
        T = args.seq or T
        gen = torch.Generator().manual_seed(1)
        q = torch.randn(B, T, n_q, d_h, generator=gen).to(device, dtype)
        k = torch.randn(B, T, n_kv, d_h, generator=gen).to(device, dtype)
        v = torch.randn(B, T, n_kv, d_h, generator=gen).to(device, dtype)
        for layout in args.layouts:
            ids, docs = workload(layout, B, T, device, seed=2)
            flops = useful_flops(docs, n_q, d_h)
            mean_doc = B * T / sum(len(r) for r in docs)
            per_pass: dict[str, dict[str, object]] = {}
            for name, build, backward in methods_for(device, args.skip_flex, args.methods):
                try:
                    per_pass[name] = time_method(build, backward, q, k, v, ids, device, args)
                except Exception as e:  # a baseline that cannot run here is reported, not fatal
                    per_pass[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                print(
                    f"{shape:18s} {layout:6s} {name:16s} "
                    + "  ".join(
                        f"{p} {t.median_ms:9.1f} ms"
                        for p, t in per_pass[name].items()
                        if hasattr(t, "median_ms")
                    ),
                    flush=True,
                )
            ours = next(iter(per_pass.values()))
            for name, res in per_pass.items():
                for p, mult in (("fwd", 1.0), ("bwd", 2.5)):
                    t = res.get(p)
                    row = {
                        "shape": shape,
                        "T": T,
                        "layout": layout,
                        "mean doc": round(mean_doc),
                        "method": name,
                        "pass": p,
                        "useful_gflop": flops * mult / 1e9,
                    }
                    if t is None or not hasattr(t, "median_ms"):
                        row["ms"] = None
                        row["note"] = res.get("error") or res.get("bwd_error") or "not supported"
                    else:
                        base = ours.get(p)
                        versus = ("smelt", base) if hasattr(base, "median_ms") else None
                        row.update(result_row(t, flops=flops * mult, versus=versus))
                        row["timing"] = t.to_dict()
                    rows.append(row)
    return rows


def target_rows(args) -> list[dict]:
    """The head-dim target: the native kernel's FLOP rate at the tiny SMELT heads over its
    rate at the tiny baseline heads, same T and documents, forward and backward, all four
    timed interleaved."""
    a, b = TARGET
    out = []
    for layout in args.layouts:
        fns, flops = {}, {}
        for shape in (a, b):
            n_q, n_kv, d_h, T = SHAPES[shape]
            T = args.seq or T
            gen = torch.Generator().manual_seed(1)
            q = torch.randn(args.batch, T, n_q, d_h, generator=gen)
            k = torch.randn(args.batch, T, n_kv, d_h, generator=gen)
            v = torch.randn(args.batch, T, n_kv, d_h, generator=gen)
            do = torch.randn_like(q)
            ids, docs = workload(layout, args.batch, T, "cpu", seed=2)
            start, end = segment_bounds(ids)
            scale = d_h**-0.5
            o, lse, _ = attention_cpu.native_forward(q, k, v, start, scale, False)
            fns[(shape, "fwd")] = lambda q=q, k=k, v=v, s=start, c=scale: (
                attention_cpu.native_forward(q, k, v, s, c, False)
            )
            saved = (do, q, k, v, o, lse, start, end, scale)
            fns[(shape, "bwd")] = lambda saved=saved: attention_cpu.native_backward(*saved)
            flops[(shape, "fwd")] = useful_flops(docs, n_q, d_h)
            flops[(shape, "bwd")] = 2.5 * flops[(shape, "fwd")]
        t = measure_interleaved(fns, warmup=args.warmup, repeats=args.repeats)
        for p in ("fwd", "bwd"):
            ta, tb = t[(a, p)], t[(b, p)]
            ra = flops[(a, p)] / (ta.median_ms * 1e-3) / 1e9
            rb = flops[(b, p)] / (tb.median_ms * 1e-3) / 1e9
            ratio = ra / rb
            out.append(
                {
                    "kind": "target",
                    "T": args.seq or SHAPES[a][3],
                    "layout": layout,
                    "pass": p,
                    "d64 5:1 ms": ta.median_ms,
                    "d96 4:1 ms": tb.median_ms,
                    "d64 GFLOP/s": ra,
                    "d96 GFLOP/s": rb,
                    "spread": f"{ta.spread:.0%} / {tb.spread:.0%}",
                    "rate ratio": ratio,
                    "target": (
                        "met" if ratio >= TARGET_RATIO else f"missed by {TARGET_RATIO - ratio:.2f}"
                    ),
                    "timing": {"d64": ta.to_dict(), "d96": tb.to_dict()},
                }
            )
            print(
                f"target {layout:6s} {p}: d64 5:1 {ra:7.1f} GFLOP/s, d96 4:1 {rb:7.1f} GFLOP/s, "
                f"ratio {ratio:.3f} ({out[-1]['target']})",
                flush=True,
            )
    return out


def _parser() -> cli.Parser:
    ap = cli.Parser(prog="bench_attention.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument(
        "--dtype", default=None, choices=DTYPES, help="default: float32 on CPU, bfloat16 on CUDA"
    )
    ap.add_argument("--batch", type=int, default=None, help="default: 1 on CPU, 8 on CUDA")
    ap.add_argument(
        "--seq",
        type=int,
        default=None,
        help="sequence length for every shape (default: 4096 paper, 2048 tiny)",
    )
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    ap.add_argument(
        "--methods",
        nargs="+",
        default=None,
        help="only these comparison methods (smelt's always runs): cpu-chunked, sdpa-mask, flex",
    )
    ap.add_argument("--skip-target", action="store_true", help="skip the CPU head-dim target")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--forward-only", action="store_true")
    ap.add_argument("--skip-flex", action="store_true", help="skip FlexAttention (compiles)")
    cli.add_threads(ap)
    ap.add_argument("--note", default="", help="a line added to the results' notes")
    ap.add_argument(
        "--out",
        nargs="?",
        const=RESULTS,
        default=None,
        metavar="DIR",
        help="write attention_<device>.{json,md} into DIR (alone: bench/results); "
        "without --out nothing is written",
    )
    return ap


def _check(args) -> torch.device:
    """Every option checked before anything runs; returns the device."""
    for name in ("seq", "batch", "repeats"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name} must be at least 1")
    if args.warmup is not None and args.warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {args.warmup}")
    cli.threads(args.threads)
    known = ("cpu-chunked", "sdpa-mask", "flex")
    for name in args.methods or ():
        if name not in known:
            raise cli.unknown("--methods method", name, known)
    dev = check_device(args.device)
    out_folder(args.out)
    return dev


def _run(argv=None):
    args = _parser().parse_args(argv)
    dev = _check(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.batch = args.batch or (8 if cuda else 1)
    args.warmup = args.warmup if args.warmup is not None else (3 if cuda else 2)
    args.repeats = args.repeats or (20 if cuda else 5)
    impl = ""
    if dev.type == "cpu":
        ran = attention_cpu.implementation(getattr(torch, args.dtype), 64)
        isa = attention_cpu.native_isa()
        impl = (
            f"smelt-cpu ran the native kernel ({isa})"
            if ran == "native"
            else f"smelt-cpu ran the chunked path (native kernel: {attention_cpu.native_missing()})"
        )
        print(impl, flush=True)
    rows = run(args)
    targets = []
    if dev.type == "cpu" and not args.skip_target and attention_cpu.native_missing() is None:
        targets = target_rows(args)
    env = environment(dev)
    env.update(dtype=args.dtype, batch=args.batch, seq=args.seq)
    notes = (
        f"B={args.batch}, {args.dtype}, {torch.get_num_threads()} CPU "
        f"thread(s); median of {args.repeats} after "
        f"{args.warmup} warm-up. tflops counts useful FLOPs only (backward 2.5x forward). "
        "vs_smelt = method time / smelt time for the same pass (> 1: smelt faster)."
    )
    if dev.type == "cpu":
        notes += (
            " CPU: measured on a 2-core machine shared with other jobs, so absolute "
            "times are noisy; FlexAttention has no CPU backward."
        )
        notes += f" {impl}."
    if args.note:
        notes += f" {args.note}"
    seen = set()
    for r in rows:
        key = (r["method"], r["pass"], r.get("note"))
        if r.get("note") and key not in seen:
            seen.add(key)
            notes += f"\n- {r['method']} {r['pass']}: {r['note']}"
    if targets:
        notes += (
            f"\n\n## Head-dim target (native kernel)\n\nFLOP rate at d_h 64 with 5:1 GQA "
            f"over the rate at d_h 96 with 4:1, same T and documents; the four calls "
            f"timed interleaved, {args.repeats} rounds; spread = (p80 - p20) / median "
            f"(d64 / d96). Target: ratio >= {TARGET_RATIO}.\n\n"
            + markdown_table(targets, TARGET_COLUMNS)
        )
    title = f"Segment attention on {dev.type}"
    if args.out is None:
        print(markdown_table(rows, COLUMNS) + "\n\n" + notes)
        return
    j, m = write_results(
        f"attention_{dev.type}", rows, COLUMNS, args.out, env, title=title, notes=notes
    )
    if targets:  # the target rows go beside the table's rows in the JSON
        data = json.loads(j.read_text())
        data["target"] = targets
        j.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(open(m).read())


main = cli.command(PROG, _run)


if __name__ == "__main__":
    raise SystemExit(main())
