"""Grouped top-k MoE GEMMs: wall-clock and TFLOP/s against the reference, the
``torch._grouped_mm`` composite and a dense SwiGLU FFN doing the same FLOPs.

    python bench/bench_moe_gemm.py                      # CPU, the default shapes, fp32 and bf16
    python bench/bench_moe_gemm.py --out runs/bench     # ... and write runs/bench/moe_gemm_cpu.*
    python bench/bench_moe_gemm.py --device cuda        # GPU (paper micro-batch T = 32k)
    python bench/bench_moe_gemm.py --shapes cpu-target --dtypes float32 --modes fwd
    python bench/bench_moe_gemm.py --quick              # CPU smoke run: one small shape, fp32

On a 2-core CPU the default run takes about 12 minutes and 8.7 GB of memory (2026-12:
11:52, peak RSS 8.68 GB), most of both in the 200M shapes; it estimates its peak
(:func:`peak_bytes`) and refuses to start where the machine has less available. ``--quick``
(the cpu-target shape at 256 tokens, fp32, short timings, the reference's slow backward
left out, decode at 1 and 8 tokens) runs in under a minute.

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

Each implementation X has ``X_ms``, ``X_p20_ms``, ``X_p80_ms``, ``X_spread`` and
``X_vs_smelt`` = X time / smelt time (:func:`smelt_tools.timing.result_row`);
``dense_vs_smelt`` is smelt's achieved FLOP rate as a fraction of the dense FFN's (the CPU
target is >= 0.8). CPU timings on a shared machine
are noisy: the implementations of a row are timed round-robin (one call each per round)
so that load drifts hit them alike; compare ratios within a row, and see p20/p80.

Decode rows (``--decode-shapes``, CPU): the inference forward at T = 1, 8, 64 tokens
(``--decode-tokens``), all batch sizes and implementations interleaved, per-token time:
smelt as selected (experts with at most 6-48 rows, by expert size and CPU, take the few-rows
path), smelt with that path off (``SMELT_CPU_DECODE=0``: the packed-panel kernels), and the
dense FFN of the same FLOPs; ``GB/s`` is the bytes of the distinct selected experts' weights
over smelt's time.

Nothing is written unless asked: ``--out DIR`` writes ``DIR/moe_gemm_<device>.{json,md}``
(``--out`` alone: into bench/results, where the committed results live), the Markdown with
the command that produced it.
"""

from __future__ import annotations

import json
import os
import shlex
import sys

import torch
import torch.nn.functional as F
from output_paths import out_folder

from smelt_kernels import backends, moe_gemm
from smelt_model.budget.memory import GiB
from smelt_model.budget.memory import available as available_memory
from smelt_tools import cli
from smelt_tools.cli import UsageError
from smelt_tools.timing import (
    check_device,
    environment,
    markdown_table,
    measure_interleaved,
    result_row,
    write_results,
)

PROG = "bench_moe_gemm"

# name: (H, d_e, E, k, tokens on CPU, tokens on GPU)
SHAPES = {
    "cpu-target": (256, 64, 288, 8, 4096, 32768),
    "200M-base": (1280, 432, 192, 8, 4096, 32768),
    "200M-smelt": (1056, 352, 288, 8, 4096, 32768),
    "100M-smelt": (576, 424, 288, 8, 4096, 32768),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: what --quick sets: one small shape, fp32, short timings (a smoke run of every path)
QUICK = dict(
    shapes="cpu-target",
    dtypes="float32",
    tokens=256,
    repeats=2,
    reference_bwd_params=0.0,
    min_time=0.1,
    decode_shapes="cpu-target",
    decode_tokens="1,8",
)
#: what the process holds besides the layer's tensors (torch, the interpreter)
BASE_BYTES = GiB // 2


def peak_bytes(shape: str, T: int, dtype: torch.dtype, modes, with_reference: bool) -> int:
    """About the most memory one shape's rows hold at once: the inputs' expert weights, a
    copy per implementation timed (with its weight gradients in a backward mode), and each
    implementation's gathered activations and their gradients. On the 200M-base shape in
    float32 at 4096 tokens it gives 7.9 GiB (8.5 GB) against 8.68 GB peak RSS measured."""
    H, de, E, k = SHAPES[shape][:4]
    size = dtype.itemsize
    weights = 3 * E * H * de * size
    acts = 2 * T * k * (H + 4 * de) * size
    worst = 0
    for mode in modes:
        grads = mode != "fwd"
        impls = 2 + (with_reference and (not grads or 3 * E * H * de <= 20e6))
        worst = max(worst, weights + impls * ((1 + grads) * weights + grads * acts))
    return worst + BASE_BYTES


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
    """Round-robin timing (one sample of every step per round, so slow drifts of a shared
    machine's load hit all implementations alike), at least ``repeats`` rounds and at most
    50, until each step has ``min_time_s`` seconds of samples. Returns name -> Timing."""
    return measure_interleaved(
        steps, device=device, warmup=2, repeats=repeats, min_time_s=min_time_s, max_repeats=50
    )


def _print_row(row: dict) -> None:
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))


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
        if "dense" not in args.skip:
            steps[f"dense@{T}"] = dense
        experts = torch.unique(inp["ids"]).numel()
        meta[T] = experts * 3 * H * de * inp["w1"].element_size()
    t = time_interleaved(steps, device, args.repeats, args.min_time)
    rows = []
    for T in tokens:
        s = t[f"smelt@{T}"]
        row = dict(shape=shape, T=T, H=H, d_e=de, E=E, k=k, dtype=dtype_name, mode="decode")
        row.update(result_row(s, "smelt_"))
        row.update(
            smelt_ms_per_token=s.median_ms / T, gb_per_s=meta[T] / (s.median_ms * 1e-3) / 1e9
        )
        for name in ("panels", "dense"):
            if f"{name}@{T}" in t:
                o = t[f"{name}@{T}"]
                row.update(result_row(o, f"{name}_", versus=("smelt", s)))
                row[f"{name}_ms_per_token"] = o.median_ms / T
        rows.append(row)
        _print_row(row)
    return rows


class Impl:
    def __init__(self, name, fn):
        self.name, self.fn = name, fn

    def __call__(self, *args):
        return self.fn(*args)


MODES = ("fwd", "bwd", "fwd+bwd")
IMPLS = ("reference", "grouped_mm", "dense")


def _names(value: str, option: str, known) -> list[str]:
    """A comma list of names, each one of ``known`` (a UsageError naming ``option``)."""
    names = [v for v in value.split(",") if v]
    for name in names:
        if name not in known:
            raise cli.unknown(option, name, list(known))
    return names


def _check(args) -> torch.device:
    """Every option checked before anything runs (a :class:`UsageError` naming the first bad
    one); returns the device."""
    device = check_device(args.device)
    if args.backend is not None:
        why = backends.unavailable_reason(args.backend, device)
        if why is not None:
            raise UsageError(f"--backend {args.backend} cannot run on {device.type}: {why}")
    try:
        args.decode_tokens = [int(v) for v in args.decode_tokens.split(",") if v]
    except ValueError:
        raise UsageError(
            f"--decode-tokens must be a comma list of positive ints, got {args.decode_tokens!r}"
        ) from None
    if any(v <= 0 for v in args.decode_tokens):
        raise UsageError(f"--decode-tokens must be positive, got {args.decode_tokens}")
    args.shapes = _names(args.shapes, "--shapes shape", SHAPES)
    args.decode_shapes = _names(args.decode_shapes, "--decode-shapes shape", SHAPES)
    args.dtypes = _names(args.dtypes, "--dtypes dtype", DTYPES)
    args.modes = _names(args.modes, "--modes mode", MODES)
    args.skip = set(_names(args.skip, "--skip implementation", IMPLS))
    if args.repeats < 1 or (args.tokens is not None and args.tokens < 1):
        raise UsageError("--repeats and --tokens must be at least 1")
    if not args.min_time >= 0:
        raise UsageError(f"--min-time must be >= 0, got {args.min_time}")
    cli.threads(args.threads)
    out_folder(args.out)
    _check_memory(args, device)
    return device


def _check_memory(args, device) -> None:
    """Refuse a run whose largest shape would not fit in the memory the device has left."""
    have = available_memory(device)
    if have is None:
        return
    need, what = max(
        (
            peak_bytes(
                s,
                args.tokens or SHAPES[s][5 if device.type == "cuda" else 4],
                DTYPES[d],
                args.modes,
                "reference" not in args.skip,
            ),
            f"{s} in {d}",
        )
        for s in args.shapes
        for d in args.dtypes
    )
    if need > have:
        raise UsageError(
            f"--shapes {what} needs about {need / GiB:.1f} GiB, {have / GiB:.1f} GiB is "
            f"available on {device.type}: pick smaller --shapes, --dtypes bfloat16, fewer "
            "--tokens, or --quick"
        )


def _parser() -> cli.Parser:
    p = cli.Parser(prog="bench_moe_gemm.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run in under a minute on 2 cores: the cpu-target shape at 256 tokens, "
        "float32, short timings, no reference backward, decode at 1 and 8 tokens (replaces "
        "--shapes, --dtypes, --tokens, --repeats, --min-time, --reference-bwd-params, "
        "--decode-shapes, --decode-tokens). "
        "The default run takes about 12 minutes and 8.7 GB on a 2-core CPU and is refused "
        "where less memory is available",
    )
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
    cli.add_threads(p)
    p.add_argument(
        "--out",
        nargs="?",
        default=None,
        const=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
        help="write the results into this folder (alone: bench/results); without it, print only",
    )
    p.add_argument("--name", default=None, help="results file stem (default moe_gemm_<device>)")
    return p


def _impls(args, device, dtype) -> list[Impl]:
    # ids come from route(): the timed call skips the (device-synchronising) id check
    impls = [
        Impl("smelt", lambda *a: moe_gemm.moe_ffn(*a, backend=args.backend, check_values=False))
    ]
    if "reference" not in args.skip:
        impls.append(Impl("reference", lambda *a: moe_gemm.moe_ffn(*a, backend="torch")))
    if "grouped_mm" not in args.skip and grouped_mm_available(device, dtype):
        impls.append(Impl("grouped_mm", grouped_mm_ffn))
    if "dense" not in args.skip:
        impls.append(Impl("dense", dense_ffn))
    return impls


def layer_rows(args, device) -> list[dict]:
    """One row per shape, dtype and mode: smelt against every other implementation."""
    rows = []
    backend_used = moe_gemm.select_backend(torch.empty(1, 1, device=device), args.backend)
    for shape in args.shapes:
        H, de, E, k, t_cpu, t_gpu = SHAPES[shape]
        T = args.tokens or (t_gpu if device.type == "cuda" else t_cpu)
        for dname in args.dtypes:
            dtype = DTYPES[dname]
            inp = make_inputs(H, de, E, k, T, dtype, device)
            impls = _impls(args, device, dtype)
            for mode in args.modes:
                flops = 6.0 * T * k * H * de * {"fwd": 1, "bwd": 2, "fwd+bwd": 3}[mode]
                steps = {}
                for impl in impls:
                    big = 3 * E * H * de > args.reference_bwd_params
                    if impl.name == "reference" and mode != "fwd" and big:
                        continue
                    try:
                        steps[impl.name] = make_step(impl, inp, mode)
                        steps[impl.name]()
                    except Exception as e:  # e.g. an op without backward on this device
                        steps.pop(impl.name, None)
                        print(f"  {impl.name} {mode}: {type(e).__name__}: {e}", file=sys.stderr)
                t = time_interleaved(steps, device, args.repeats, args.min_time)
                s = t["smelt"]
                row = dict(shape=shape, T=T, H=H, d_e=de, E=E, k=k, dtype=dname, mode=mode)
                row["backend"] = _backend_label(backend_used, H, de, dtype)
                row.update(result_row(s, "smelt_", flops=flops))
                for name in IMPLS:
                    if name in t:
                        fl = flops if name == "dense" else None
                        row.update(result_row(t[name], f"{name}_", flops=fl, versus=("smelt", s)))
                rows.append(row)
                _print_row(row)
    return rows


COLUMNS = [
    "shape",
    "T",
    "dtype",
    "mode",
    "backend",
    "smelt_ms",
    "smelt_tflops",
    "reference_ms",
    "reference_vs_smelt",
    "grouped_mm_ms",
    "grouped_mm_vs_smelt",
    "dense_ms",
    "dense_tflops",
    "dense_vs_smelt",
]
DECODE_COLUMNS = [
    "shape",
    "T",
    "dtype",
    "smelt_ms",
    "smelt_spread",
    "smelt_ms_per_token",
    "gb_per_s",
    "panels_ms_per_token",
    "panels_vs_smelt",
    "dense_ms_per_token",
    "dense_vs_smelt",
]


def parse_args(argv=None):
    """The options, with --quick's values put in, every one checked (a
    :class:`UsageError` naming the first bad one); returns them and the device."""
    args = _parser().parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    return args, _check(args)


def _run(argv=None):
    args, device = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = layer_rows(args, device)
    decode = []
    if device.type == "cpu":
        for shape in args.decode_shapes:
            for dname in args.dtypes:
                decode += decode_rows(shape, dname, args.decode_tokens, args, device)
    if args.out is None:
        print("(not written: pass --out DIR to write the results)")
        return
    notes = (
        "X_vs_smelt = X time / smelt time (> 1: smelt is faster); dense_vs_smelt is smelt's "
        "FLOP rate as a fraction of a dense SwiGLU FFN doing the same FLOPs (target >= 0.8 on "
        "the CPU). fwd: no_grad forward; bwd: backward of a retained graph; fwd+bwd: one "
        f"training step. Threads: {torch.get_num_threads()}. Shared CPU machines are noisy: "
        "compare ratios within a row (its implementations are timed round-robin); p20/p80 "
        "are in the JSON."
    )
    command = "python bench/bench_moe_gemm.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    notes += f"\n\nCommand: `{command.strip()}`"
    name = args.name or f"moe_gemm_{device.type}"
    title = f"Grouped top-k MoE GEMMs ({device.type})"
    jpath, mpath = write_results(
        name, rows, COLUMNS, args.out, env=environment(device), title=title, notes=notes
    )
    if decode:
        data = json.loads(jpath.read_text())
        data["decode_rows"] = decode
        data["command"] = command.strip()
        jpath.write_text(json.dumps(data, indent=2, default=str) + "\n")
        with open(mpath, "a") as f:
            f.write(
                "\n## Decode: inference forward per token by batch size\n\n"
                + markdown_table(decode, DECODE_COLUMNS)
                + "\n\n"
                "smelt: experts with at most 6-48 rows (by expert size and CPU) take the "
                "few-rows path; panels: the same op with it off (SMELT_CPU_DECODE=0); dense: a "
                "SwiGLU FFN of the same FLOPs. X_vs_smelt = X time / smelt time. gb_per_s: "
                "bytes of the distinct selected experts' weights / smelt time. spread = "
                "(p80 - p20) / median of the samples.\n"
            )
    print(f"wrote {jpath} and {mpath}")


main = cli.command(PROG, _run)


if __name__ == "__main__":
    raise SystemExit(main())
