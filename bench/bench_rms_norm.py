"""The row-wise ops: RMSNorm and the rotary embedding, smelt's op against its pure-torch
reference at the paper's 200M shapes and the tiny pair's, forward and backward.

    python bench/bench_rms_norm.py                      # CPU, fp32, 2048 tokens: prints only
    python bench/bench_rms_norm.py --quick              # 256 tokens, 3 rounds: seconds
    python bench/bench_rms_norm.py --out runs/bench     # ... and writes runs/bench/
    python bench/bench_rms_norm.py --device cuda        # bf16, 32k tokens per step

Ops (``--ops``): ``rms_norm`` on (tokens, H) with a weight of H; ``rotary`` on the queries
(1, tokens, heads, head_dim) with float32 cos/sin tables per position. Shapes
(smelt_model/presets.py): the paper's SMELT (H 1056, 12 x 88) and baseline (H 1280,
10 x 128) cells, the tiny SMELT (H 320, 5 x 64) and tiny baseline (H 384, 4 x 96).

Methods (same inputs): ``smelt`` (the op with the registry's auto choice: the fused native
kernel on the CPU where it is built, the notes say which ran) and ``torch`` (the op with
``backend="torch"``, the reference's eager ops, which is also what runs on CUDA). Passes:
``fwd`` and ``bwd`` (``autograd.grad`` of a retained graph with a random upstream
gradient). The methods and passes of one op and shape are timed round-robin (A, B, A, B,
...), so drift hits them alike. Both ops are memory-bound: each row gives ``GB/s``, the
bytes a pass must move (inputs read once, outputs written once) over its median, beside
``ms``, ``p20_ms``, ``p80_ms``, ``spread`` and ``vs_smelt``, the method's time over smelt's
for the same pass (above 1: smelt is faster).

With ``--out DIR`` writes ``DIR/rms_norm_<device>.{json,md}`` (``--out`` alone: into
bench/results); without it nothing is written. CPU timings on a shared machine are noisy;
compare the ratios of one run.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from smelt_kernels.layers import Rotary
from smelt_kernels.norm import implementation as norm_implementation
from smelt_kernels.norm import rms_norm
from smelt_kernels.rotary import apply_rotary
from smelt_kernels.rotary import implementation as rotary_implementation
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

PROG = "bench_rms_norm"

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# (hidden size, query heads, head dim)
SHAPES = {
    "SMELT 200M": (1056, 12, 88),
    "baseline 200M": (1280, 10, 128),
    "tiny SMELT": (320, 5, 64),
    "tiny baseline": (384, 4, 96),
}
OPS = ("rms_norm", "rotary")
METHODS = ("smelt", "torch")
PASSES = ("fwd", "bwd")
DTYPES = ("float32", "bfloat16", "float16")
COLUMNS = [
    "op",
    "shape",
    "tokens",
    "method",
    "pass",
    "ms",
    "p20_ms",
    "p80_ms",
    "spread",
    "GB/s",
    "vs_smelt",
]


# ----------------------------------------------------------------------------- workload
def rms_norm_case(shape: str, tokens: int, dtype, device):
    """(call(backend) -> y, leaves, bytes moved per pass, which path smelt takes)."""
    H = SHAPES[shape][0]
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(tokens, H, generator=gen) * 3).to(device, dtype).requires_grad_()
    w = (torch.rand(H, generator=gen) + 0.5).to(device, dtype).requires_grad_()
    es = x.element_size()
    moved = {"fwd": 2 * x.numel() * es + H * es, "bwd": 3 * x.numel() * es + 2 * H * es}
    return (lambda b: rms_norm(x, w, 1e-5, backend=b)), (x, w), moved, norm_implementation(x, w)


def rotary_case(shape: str, tokens: int, dtype, device):
    """(call(backend) -> y, leaves, bytes moved per pass, which path smelt takes)."""
    _, heads, d = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    cos, sin = Rotary(d).tables(0, tokens, device)
    x = torch.randn(1, tokens, heads, d, generator=gen).to(device, dtype).requires_grad_()
    tables = 2 * cos.numel() * cos.element_size()
    moved = dict.fromkeys(PASSES, 2 * x.numel() * x.element_size() + tables)
    return (
        (lambda b: apply_rotary(x, cos, sin, backend=b)),
        (x,),
        moved,
        rotary_implementation(x, cos, sin),
    )


CASES: dict[str, Callable] = {"rms_norm": rms_norm_case, "rotary": rotary_case}


# ----------------------------------------------------------------------------- timing
def _passes(call, leaves) -> dict[str, Callable[[], object]]:
    """fwd (no graph kept) and bwd (the gradient of a retained graph) of one method."""
    y = call()
    dy = torch.randn_like(y)

    def fwd():
        with torch.no_grad():
            return call()

    return {"fwd": fwd, "bwd": lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True)}


def time_case(op: str, shape: str, args, device) -> tuple[list[dict], str]:
    """The rows of one op at one shape (every method and pass timed round-robin), and which
    path smelt's call took."""
    call, leaves, moved, path = CASES[op](shape, args.tokens, getattr(torch, args.dtype), device)
    fns = {}
    for method in METHODS:
        backend = None if method == "smelt" else "torch"
        for p, fn in _passes(lambda b=backend: call(b), leaves).items():
            fns[(method, p)] = fn
    t = measure_interleaved(fns, device=device, warmup=args.warmup, repeats=args.repeats)
    rows = []
    for method in METHODS:
        for p in PASSES:
            timing = t[(method, p)]
            row = {"op": op, "shape": shape, "tokens": args.tokens, "method": method, "pass": p}
            row.update(result_row(timing, versus=("smelt", t[("smelt", p)])))
            row["GB/s"] = moved[p] / (timing.median_ms * 1e-3) / 1e9
            row["timing"] = timing.to_dict()
            rows.append(row)
            print(
                f"{op:8s} {shape:14s} {method:6s} {p}: {timing.median_ms:8.3f} ms "
                f"({row['GB/s']:6.1f} GB/s, spread {timing.spread:.0%})",
                flush=True,
            )
    return rows, path


def run(args) -> tuple[list[dict], dict[str, str]]:
    """Every row, and per op the path smelt's call took (``native`` or ``torch``)."""
    device = torch.device(args.device)
    rows, paths = [], {}
    for op in args.ops:
        for shape in args.shapes:
            got, paths[op] = time_case(op, shape, args, device)
            rows += got
    return rows, paths


# ----------------------------------------------------------------------------- command line
def _parser() -> cli.Parser:
    ap = cli.Parser(prog="bench_rms_norm.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument(
        "--dtype", default=None, choices=DTYPES, help="default: float32 on CPU, bfloat16 on CUDA"
    )
    ap.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="default: 2048 on CPU (--quick: 256), 32768 on CUDA",
    )
    ap.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--quick", action="store_true", help="256 tokens, 1 warm-up, 3 rounds")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    cli.add_threads(ap)
    ap.add_argument("--note", default="", help="a line added to the results' notes")
    ap.add_argument(
        "--out",
        nargs="?",
        const=RESULTS,
        default=None,
        metavar="DIR",
        help="write rms_norm_<device>.{json,md} into DIR (alone: bench/results); "
        "without --out nothing is written",
    )
    return ap


def _check(args) -> torch.device:
    """Every option checked before anything runs; returns the device."""
    for name in ("tokens", "repeats"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup is not None and args.warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {args.warmup}")
    cli.threads(args.threads)
    dev = check_device(args.device)
    if args.out is not None:
        cli.output_path(os.path.join(args.out, f"rms_norm_{dev.type}.json"), "--out")
    return dev


def _defaults(args, dev: torch.device) -> None:
    cuda = dev.type == "cuda"
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.tokens = args.tokens or (32768 if cuda else 256 if args.quick else 2048)
    if args.warmup is None:
        args.warmup = 1 if args.quick else (3 if cuda else 2)
    args.repeats = args.repeats or (3 if args.quick else 20 if cuda else 7)


def _run(argv=None):
    args = _parser().parse_args(argv)
    dev = _check(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    _defaults(args, dev)
    rows, paths = run(args)
    env = environment(dev)
    env.update(dtype=args.dtype, tokens=args.tokens)
    notes = (
        f"{args.tokens} tokens, {args.dtype}, {torch.get_num_threads()} CPU thread(s); median "
        f"of {args.repeats} rounds after {args.warmup} warm-up, methods and passes timed "
        "round-robin. GB/s: the bytes a pass must move over its median. vs_smelt = method "
        "time / smelt time for the same pass (> 1: smelt faster). smelt ran: "
        + ", ".join(f"{op} {path}" for op, path in paths.items())
        + "."
    )
    if args.note:
        notes += f" {args.note}"
    if args.out is None:
        print(markdown_table(rows, COLUMNS) + "\n\n" + notes)
        return
    _, m = write_results(
        f"rms_norm_{dev.type}",
        rows,
        COLUMNS,
        args.out,
        env,
        title=f"Row-wise ops on {dev.type}",
        notes=notes,
    )
    print(open(m).read())


main = cli.command(PROG, _run)


if __name__ == "__main__":
    raise SystemExit(main())
