"""The main job's options and ``main``: ``python bench/looped_vs_baseline.py --help``.

A bad option, an unusable backend or device, a missing plotting package or a run that would
not fit in memory is one line on stderr and exit status 2, before anything is built.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from smelt_kernels import backends
from smelt_model import presets
from smelt_model.executor import RECOMPUTE_POLICIES
from smelt_tools.cli import Parser, UsageError
from smelt_tools.timing import environment

from . import driver, report
from .workload import MODES, check_environment, make_workload

__all__ = ["DESCRIPTION", "parse_args", "main"]

DESCRIPTION = (
    "Wall-clock against the FLOPs match: a budget-matched baseline / SMELT pair, side by side."
)
PROG = "looped_vs_baseline"


def _parser() -> Parser:
    ap = Parser(prog="looped_vs_baseline.py", description=DESCRIPTION)
    ap.add_argument(
        "--preset", default="tiny", help=f"a matched pair: {', '.join(presets.pairs())}"
    )
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--backend", default="auto", choices=backends.choices())
    ap.add_argument(
        "--dtype",
        default=None,
        choices=tuple(driver.DTYPES),
        help="default: fp32 on the CPU, bf16 on CUDA",
    )
    ap.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="tokens per training/prefill step (default 4096 CPU, 32768 CUDA)",
    )
    ap.add_argument(
        "--seq-len", type=int, default=None, help="context length (default 2048 CPU, 4096 CUDA)"
    )
    ap.add_argument(
        "--mean-doc-len",
        type=float,
        default=None,
        help="packed document length (default 800, as in the paper)",
    )
    ap.add_argument("--mode", default="all", choices=MODES + ("all",))
    ap.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed repeats per architecture, over all rounds (default 6)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="alternating blocks per architecture (ABBA order; default 2)",
    )
    ap.add_argument("--warmup", type=int, default=1, help="untimed calls before each block")
    ap.add_argument(
        "--tolerance",
        type=float,
        default=0.15,
        help="how far components may exceed the step before a remeasure (0.15)",
    )
    ap.add_argument(
        "--max-tries",
        type=int,
        default=3,
        help="measurements of a step and its components before giving up (3)",
    )
    ap.add_argument("--decode-prompt", type=int, default=None, help="prompt length for decode")
    ap.add_argument(
        "--decode-steps",
        type=int,
        default=None,
        help="timed decode steps per architecture, over all rounds",
    )
    ap.add_argument(
        "--decode-batch",
        type=int,
        nargs="+",
        default=None,
        help="decode batch sizes (default 1 8; 1 64 on CUDA)",
    )
    ap.add_argument(
        "--eager-decode",
        action="store_true",
        help="decode with the eager model instead of the compiled decode step",
    )
    ap.add_argument("--recompute", default="none", choices=tuple(RECOMPUTE_POLICIES))
    ap.add_argument(
        "--no-capture",
        dest="capture",
        action="store_false",
        help="do not capture CUDA graphs (CUDA only)",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--json", help="write every number here")
    ap.add_argument("--markdown", help="write the tables here as Markdown")
    ap.add_argument("--plot", help="write a wall-clock vs FLOPs plot here (matplotlib)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap


def parse_args(argv: Optional[Sequence[str]] = None):
    """The options with the device's defaults filled in, every one checked (a
    :class:`~smelt_tools.cli.UsageError` naming the first bad one)."""
    args = _parser().parse_args(argv)
    cuda = args.device == "cuda"
    defaults = dict(
        dtype="bf16" if cuda else "fp32",
        tokens=32768 if cuda else 4096,
        seq_len=4096 if cuda else 2048,
        mean_doc_len=800.0,
        repeats=6,
        decode_prompt=512 if cuda else 256,
        decode_steps=32 if cuda else 48,
        decode_batch=[1, 64] if cuda else [1, 8],
    )
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.preset not in presets.pairs():
        raise UsageError(
            f"--preset {args.preset!r} is not a pair; choose from {', '.join(presets.pairs())}"
        )
    make_workload(args)
    check_environment(args)
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the main job; 0 when it ran, 2 (one line on stderr) when it could not start."""
    try:
        args = parse_args(argv)
        if args.threads:
            torch.set_num_threads(args.threads)
        res = driver.run_pair(args)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    res.update(
        preset=args.preset,
        device=args.device,
        dtype=args.dtype,
        backend=args.backend,
        tolerance=args.tolerance,
        environment=environment(args.device),
    )
    text = report.format_tables(res)
    print("\n" + text)
    try:
        _write(res, text, args, argv)
    except OSError as e:
        print(f"{PROG}: error: could not write the results: {e}", file=sys.stderr)
        return 1
    return 0


def _write(res, text: str, args, argv: Optional[Sequence[str]]) -> None:
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        cmd = list(argv) if argv is not None else sys.argv[1:]
        Path(args.markdown).write_text(report.markdown(res, text, cmd))
        print(f"wrote {args.markdown}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2, default=str) + "\n")
        print(f"\nwrote {args.json}")
    if args.plot:
        report.plot(res, args.plot)
        print(f"wrote {args.plot}")
