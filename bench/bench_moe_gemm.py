"""Grouped top-k MoE GEMMs: wall-clock and TFLOP/s against the reference, the
``torch._grouped_mm`` composite and a dense SwiGLU FFN doing the same FLOPs.

    python bench/bench_moe_gemm.py                 # CPU, the default shapes, fp32 and bf16
    python bench/bench_moe_gemm.py --out           # ... and write bench/results/moe_gemm_cpu.*
    python bench/bench_moe_gemm.py --device cuda   # GPU (paper micro-batch T = 32k)
    python bench/bench_moe_gemm.py --shapes cpu-target --dtypes float32 --modes fwd

Useful FLOPs: forward 6*T*k*H*d_e (gate, up, down), backward twice that.
Modes: ``fwd`` (inference: under no_grad), ``bwd`` (the backward of a retained graph, with
a random upstream gradient), ``fwd+bwd`` (a training step of the layer). Each row times:

* smelt -- ``moe_ffn`` with the auto-selected backend (``cpu`` on CPU, ``triton`` on CUDA;
  ``--backend`` overrides);
* reference -- ``moe_ffn(backend="torch")``, a loop over experts (the common HF style). Its
  backward builds a full-size weight gradient per expert (select_backward), seconds per
  call, so it is timed backward only where the expert weights are small (at most
  ``--reference-bwd-params``, default 20M: the cpu-target shape);
* grouped_mm -- a sort + gather + ``torch._grouped_mm`` x2 + index_add composite, where
  ``torch._grouped_mm`` exists for the device and dtype;
* dense -- a SwiGLU FFN with hidden size k*d_e (the same FLOPs per token).

``dense_ratio`` = dense time / smelt time, i.e. smelt's achieved FLOP rate as a fraction of
the dense FFN's (the CPU target is >= 0.8). CPU timings on a shared machine
are noisy: the implementations of a row are timed round-robin (one call each per round)
so that load drifts hit them alike; compare ratios within a row, and see p20/p80.

Decode rows (``--decode-shapes``, CPU): the inference forward at T = 1, 8, 64 tokens
(``--decode-tokens``), all batch sizes and implementations interleaved, per-token time:
smelt as selected (experts with at most 6-48 rows, by expert size and CPU, take the few-rows
path), smelt with that path off (``SMELT_CPU_DECODE=0``: the packed-panel kernels), and the
dense FFN of the same FLOPs; ``GB/s`` is the bytes of the distinct selected experts' weights
over smelt's time.

Nothing is written unless asked: ``--out`` writes ``bench/results/moe_gemm_<device>.{json,md}``
(``--out DIR``: into DIR), the Markdown with the command that produced it.
"""

from __future__ import annotations

import json
import os
import shlex
import sys

import torch
import torch.nn.functional as F

from smelt_kernels import backends, moe_gemm
from smelt_tools.cli import Parser, UsageError, run_cli
from smelt_tools.timing import (
    Timing,
    check_device,
    environment,
    markdown_table,
    measure,
    tflops,
    write_results,
)

# name: (H, d_e, E, k, tokens on CPU, tokens on GPU)
SHAPES = {
    "cpu-target": (256, 64, 288, 8, 4096, 32768),
    "200M-base": (1280, 432, 192, 8, 4096, 32768),
    "200M-smelt": (1056, 352, 288, 8, 4096, 32768),
    "100M-smelt": (576, 424, 288, 8, 4096, 32768),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_inputs(H, de, E, k, T, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(device, dtype)
    w1 = (torch.randn(E, 2 * de, H, generator=g) * H**-0.5).to(device, dtype)
    w2 = (torch.randn(E, H, de, generator=g) * de**-0.5).to(device, dtype)
    logits = torch.randn(T, E, generator=g).to(device)
    tw, ids = moe_gemm.route(logits, k)
    dense_w1 = (torch.randn(2 * k * de, H, generator=g) * H**-0.5).to(device, dtype)
    dense_w2 = (torch.randn(H, k * de, generator=g) * (k * de) ** -0.5).to(device, dtype)
    return dict(x=x, w1=w1, w2=w2, tw=tw, ids=ids, dense_w1=dense_w1, dense_w2=dense_w2)


def dense_ffn(x, w1, w2):
    a = x @ w1.t()
    n = a.shape[1] // 2
    return (F.silu(a[:, :n]) * a[:, n:]) @ w2.t()


def grouped_mm_ffn(x, w1, w2, tw, ids):
    """Sort by expert, gather, two torch._grouped_mm calls, weight, index_add."""
    E, two_de, _ = w1.shape
    de, k = two_de // 2, ids.shape[1]
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    tok = order // k
    a = torch._grouped_mm(x[tok], w1.transpose(1, 2), offs=offs)
    h = F.silu(a[:, :de]) * a[:, de:]
    o = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
    o = o * tw.reshape(-1)[order, None].to(o.dtype)
    return torch.zeros_like(x).index_add_(0, tok, o)


def grouped_mm_available(device, dtype) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        a = torch.randn(4, 16, device=device, dtype=dtype)
        b = torch.randn(2, 16, 16, device=device, dtype=dtype)
        torch._grouped_mm(a, b, offs=torch.tensor([2, 4], dtype=torch.int32, device=device))
        return True
    except Exception:
        return False


def make_step(impl, inp, mode):
    """The callable one timed sample runs for ``impl`` in ``mode``."""
    leaves_for = {
        "dense": ("x", "dense_w1", "dense_w2"),
        "smelt": ("x", "w1", "w2", "tw"),
        "reference": ("x", "w1", "w2", "tw"),
        "grouped_mm": ("x", "w1", "w2", "tw"),
    }
    names = leaves_for[impl.name]
    leaves = [inp[n].detach().clone().requires_grad_(mode != "fwd") for n in names]
    extra = [] if impl.name == "dense" else [inp["ids"]]

    def fwd():
        return impl(*leaves, *extra)

    dy = torch.randn_like(inp["x"])
    if mode == "fwd":

        def fn():
            with torch.no_grad():
                fwd()
    elif mode == "bwd":
        y = fwd()

        def fn():
            torch.autograd.grad(y, leaves, dy, retain_graph=True)
    else:

        def fn():
            torch.autograd.grad(fwd(), leaves, dy)

    return fn


def _backend_label(backend, H, de, dtype):
    """The backend, with the CPU forward's kernel for this expert shape (e.g. ``cpu/rows``)."""
    if backend != "cpu":
        return backend
    return f"cpu/{moe_gemm.cpu_forward_kernel(H, de, dtype)}"


def time_interleaved(steps, device, repeats, min_time_s):
    """Round-robin timing: one sample of every step per round, so slow drifts of a shared
    machine's load hit all implementations alike. Returns name -> Timing."""
    samples = {name: [] for name in steps}
    for fn in steps.values():  # warm-up (JIT kernels, allocator)
        measure(fn, device=device, warmup=1, repeats=1)
    while True:
        for name, fn in steps.items():
            samples[name].append(measure(fn, device=device, warmup=0, repeats=1).median_ms)
        done = min(len(v) for v in samples.values()) >= repeats
        if done and min(sum(v) for v in samples.values()) >= min_time_s * 1e3:
            break
        if done and len(next(iter(samples.values()))) >= 50:
            break
    return {name: Timing.of(v) for name, v in samples.items()}


def _decode_off(fn):
    """fn with the CPU forward's few-rows path turned off (the packed-panel kernels)."""

    def run():
        before = os.environ.get("SMELT_CPU_DECODE")
        os.environ["SMELT_CPU_DECODE"] = "0"
        try:
            fn()
        finally:
            if before is None:
                os.environ.pop("SMELT_CPU_DECODE", None)
            else:
                os.environ["SMELT_CPU_DECODE"] = before

    return run


def decode_rows(shape, dtype_name, tokens, args, device):
    """Per-token inference-forward time at each batch size in ``tokens``, every (batch,
    implementation) pair timed round-robin in one loop."""
    H, de, E, k = SHAPES[shape][:4]
    dtype = DTYPES[dtype_name]
    steps, meta = {}, {}
    for T in tokens:
        inp = make_inputs(H, de, E, k, T, dtype, device, seed=T)
        args_ = (inp["x"], inp["w1"], inp["w2"], inp["tw"], inp["ids"])

        def smelt(a=args_):
            with torch.no_grad():
                moe_gemm.moe_ffn(*a, backend=args.backend, check_values=False)

        def dense(x=inp["x"], w1=inp["dense_w1"], w2=inp["dense_w2"]):
            with torch.no_grad():
                dense_ffn(x, w1, w2)

        steps[f"smelt@{T}"] = smelt
        if device.type == "cpu":
            steps[f"panels@{T}"] = _decode_off(smelt)
        if "dense" not in args.skip.split(","):
            steps[f"dense@{T}"] = dense
        experts = torch.unique(inp["ids"]).numel()
        meta[T] = experts * 3 * H * de * inp["w1"].element_size()
    t = time_interleaved(steps, device, args.repeats, args.min_time)
    rows = []
    for T in tokens:
        s = t[f"smelt@{T}"]
        row = dict(
            shape=shape,
            T=T,
            H=H,
            d_e=de,
            E=E,
            k=k,
            dtype=dtype_name,
            mode="decode",
            smelt_ms=s.median_ms,
            smelt_p20=s.p20_ms,
            smelt_p80=s.p80_ms,
            spread=s.spread,
            smelt_ms_per_token=s.median_ms / T,
            gb_per_s=meta[T] / (s.median_ms * 1e-3) / 1e9,
        )
        for name in ("panels", "dense"):
            if f"{name}@{T}" in t:
                o = t[f"{name}@{T}"]
                row[f"{name}_ms_per_token"] = o.median_ms / T
                row[f"{name}_spread"] = o.spread
                row[f"vs_{name}"] = o.median_ms / s.median_ms
        rows.append(row)
        print(
            " ".join(
                f"{k_}={v:.4g}" if isinstance(v, float) else f"{k_}={v}" for k_, v in row.items()
            ),
            flush=True,
        )
    return rows


class Impl:
    def __init__(self, name, fn):
        self.name, self.fn = name, fn

    def __call__(self, *args):
        return self.fn(*args)


MODES = ("fwd", "bwd", "fwd+bwd")
IMPLS = ("reference", "grouped_mm", "dense")


def _check(args) -> torch.device:
    """Every option checked before anything runs (a :class:`UsageError` naming the first bad
    one); returns the device."""
    device = check_device(args.device)
    if args.backend is not None:
        why = backends.unavailable_reason(args.backend, device)
        if why is not None:
            raise UsageError(f"--backend {args.backend} cannot run on {device.type}: {why}")
    try:
        decode_tokens = [int(v) for v in args.decode_tokens.split(",") if v]
    except ValueError:
        raise UsageError(
            f"--decode-tokens must be a comma list of positive ints, got {args.decode_tokens!r}"
        ) from None
    if any(v <= 0 for v in decode_tokens):
        raise UsageError(f"--decode-tokens must be positive, got {args.decode_tokens!r}")
    for name in filter(None, args.shapes.split(",") + args.decode_shapes.split(",")):
        if name not in SHAPES:
            raise UsageError(f"unknown shape {name!r} (known: {', '.join(SHAPES)})")
    for name in args.dtypes.split(","):
        if name not in DTYPES:
            raise UsageError(f"--dtypes: unknown dtype {name!r} (known: {', '.join(DTYPES)})")
    for name in args.modes.split(","):
        if name not in MODES:
            raise UsageError(f"--modes: unknown mode {name!r} (known: {', '.join(MODES)})")
    for name in filter(None, args.skip.split(",")):
        if name not in IMPLS:
            raise UsageError(f"--skip: unknown {name!r} (known: {', '.join(IMPLS)})")
    if args.repeats < 1 or (args.tokens is not None and args.tokens < 1):
        raise UsageError("--repeats and --tokens must be at least 1")
    if not args.min_time >= 0:
        raise UsageError(f"--min-time must be >= 0, got {args.min_time}")
    return device


def main(argv=None):
    p = Parser(prog="bench_moe_gemm.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--shapes", default="cpu-target,200M-base,200M-smelt")
    p.add_argument("--modes", default="fwd,bwd,fwd+bwd")
    p.add_argument("--tokens", type=int, default=None, help="override T for every shape")
    p.add_argument("--backend", default=None, help="smelt backend (default: auto)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--min-time", type=float, default=1.0, help="seconds of timed calls per row")
    p.add_argument(
        "--reference-bwd-params",
        type=float,
        default=20e6,
        help="time the reference backward only up to this many expert parameters",
    )
    p.add_argument("--skip", default="", help="comma list of reference,grouped_mm,dense to skip")
    p.add_argument(
        "--decode-shapes",
        default="cpu-target,100M-smelt",
        help="shapes of the decode rows ('' for none; CPU only)",
    )
    p.add_argument("--decode-tokens", default="1,8,64", help="batch sizes of the decode rows")
    p.add_argument(
        "--out",
        nargs="?",
        default=None,
        const=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
        help="write the results (default folder bench/results); without it, print only",
    )
    p.add_argument("--name", default=None, help="results file stem (default moe_gemm_<device>)")
    args = p.parse_args(argv)
    device = _check(args)
    skip = set(filter(None, args.skip.split(",")))
    rows = []
    backend_used = moe_gemm.select_backend(torch.empty(1, 1, device=device), args.backend)
    decode_tokens = [int(v) for v in args.decode_tokens.split(",") if v]
    for shape in filter(None, args.shapes.split(",")):
        H, de, E, k, t_cpu, t_gpu = SHAPES[shape]
        T = args.tokens or (t_gpu if device.type == "cuda" else t_cpu)
        fl_fwd = 6.0 * T * k * H * de
        for dname in args.dtypes.split(","):
            dtype = DTYPES[dname]
            inp = make_inputs(H, de, E, k, T, dtype, device)
            # ids come from route(): the timed call skips the (device-synchronising) id check
            impls = [
                Impl(
                    "smelt",
                    lambda *a: moe_gemm.moe_ffn(*a, backend=args.backend, check_values=False),
                )
            ]
            if "reference" not in skip:
                impls.append(Impl("reference", lambda *a: moe_gemm.moe_ffn(*a, backend="torch")))
            if "grouped_mm" not in skip and grouped_mm_available(device, dtype):
                impls.append(Impl("grouped_mm", grouped_mm_ffn))
            if "dense" not in skip:
                impls.append(Impl("dense", dense_ffn))
            for mode in args.modes.split(","):
                flops = fl_fwd * {"fwd": 1, "bwd": 2, "fwd+bwd": 3}[mode]
                steps = {}
                for impl in impls:
                    if (
                        impl.name == "reference"
                        and mode != "fwd"
                        and 3 * E * H * de > args.reference_bwd_params
                    ):
                        continue
                    try:
                        steps[impl.name] = make_step(impl, inp, mode)
                        steps[impl.name]()
                    except Exception as e:  # e.g. an op without backward on this device
                        steps.pop(impl.name, None)
                        print(f"  {impl.name} {mode}: {type(e).__name__}: {e}", file=sys.stderr)
                t = time_interleaved(steps, device, args.repeats, args.min_time)
                s = t["smelt"]
                row = dict(
                    shape=shape,
                    T=T,
                    H=H,
                    d_e=de,
                    E=E,
                    k=k,
                    dtype=dname,
                    mode=mode,
                    backend=_backend_label(backend_used, H, de, dtype),
                    smelt_ms=s.median_ms,
                    smelt_p20=s.p20_ms,
                    smelt_p80=s.p80_ms,
                    smelt_tflops=tflops(flops, s.median_ms),
                )
                for name in ("reference", "grouped_mm", "dense"):
                    if name in t:
                        row[f"{name}_ms"] = t[name].median_ms
                        row[f"vs_{name}"] = t[name].median_ms / s.median_ms
                if "dense" in t:
                    row["dense_tflops"] = tflops(flops, t["dense"].median_ms)
                rows.append(row)
                print(
                    " ".join(
                        f"{k_}={v:.4g}" if isinstance(v, float) else f"{k_}={v}"
                        for k_, v in row.items()
                    ),
                    flush=True,
                )
    decode = []
    if device.type == "cpu":
        for shape in filter(None, args.decode_shapes.split(",")):
            for dname in args.dtypes.split(","):
                decode += decode_rows(shape, dname, decode_tokens, args, device)
    if args.out is None:
        print("(not written: pass --out to write bench/results/)")
        return
    cols = [
        "shape",
        "T",
        "dtype",
        "mode",
        "backend",
        "smelt_ms",
        "smelt_tflops",
        "reference_ms",
        "vs_reference",
        "grouped_mm_ms",
        "vs_grouped_mm",
        "dense_ms",
        "dense_tflops",
        "vs_dense",
    ]
    notes = (
        "vs_X = X time / smelt time (> 1: smelt is faster); vs_dense is smelt's FLOP rate as a "
        "fraction of a dense SwiGLU FFN doing the same FLOPs (target >= 0.8 on the CPU). "
        "fwd: no_grad forward; bwd: backward of a retained graph; fwd+bwd: one training step. "
        f"Threads: {torch.get_num_threads()}. Shared CPU machines are noisy: compare ratios "
        "within a row (its implementations are timed round-robin); p20/p80 are in the JSON."
    )
    command = "python bench/bench_moe_gemm.py " + " ".join(
        shlex.quote(a) for a in (argv or sys.argv[1:])
    )
    notes += f"\n\nCommand: `{command.strip()}`"
    name = args.name or f"moe_gemm_{device.type}"
    jpath, mpath = write_results(
        name,
        rows,
        cols,
        args.out,
        env=environment(device),
        title=f"Grouped top-k MoE GEMMs ({device.type})",
        notes=notes,
    )
    if decode:
        data = json.loads(jpath.read_text())
        data["decode_rows"] = decode
        data["command"] = command.strip()
        jpath.write_text(json.dumps(data, indent=2, default=str) + "\n")
        dcols = [
            "shape",
            "T",
            "dtype",
            "smelt_ms",
            "spread",
            "smelt_ms_per_token",
            "gb_per_s",
            "panels_ms_per_token",
            "vs_panels",
            "dense_ms_per_token",
            "vs_dense",
        ]
        with open(mpath, "a") as f:
            f.write(
                "\n## Decode: inference forward per token by batch size\n\n"
                + markdown_table(decode, dcols)
                + "\n\n"
                "smelt: experts with at most 6-48 rows (by expert size and CPU) take the "
                "few-rows path; panels: the same "
                "op with it off (SMELT_CPU_DECODE=0); dense: a SwiGLU FFN of the same FLOPs. "
                "vs_X = X time / smelt time. gb_per_s: bytes of the distinct selected experts' "
                "weights / smelt time. spread = (p80 - p20) / median of the samples.\n"
            )
    print(f"wrote {jpath} and {mpath}")


if __name__ == "__main__":
    raise SystemExit(run_cli("bench_moe_gemm", main))
