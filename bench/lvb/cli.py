"""The main job's options and entry point: ``python bench/looped_vs_baseline.py --help``.

It follows the one command convention (:mod:`smelt_tools.cli`): a bad option, an unusable
backend or device, an output path that cannot be written, a missing plotting package or a
run that would not fit in memory is one line on stderr and exit status 2, before anything
is built; a results file that cannot be written is one line and exit status 1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from smelt_kernels import backends
from smelt_model import presets
from smelt_model.schedule import RECOMPUTE_POLICIES, check_recompute
from smelt_tools import cli
from smelt_tools.timing import environment
from smelt_tools.watch import CONTENTION_LIMIT

from . import driver, report
from .estimate import CONFIDENCE
from .verdict import RESOLUTION
from .workload import MODES, check_environment, make_workload

__all__ = ["DESCRIPTION", "PROG", "parse_args", "main"]

DESCRIPTION = (
    "Wall-clock against the FLOPs match: a budget-matched baseline / SMELT pair, side by side."
)
PROG = "looped_vs_baseline"


def _parser() -> cli.Parser:
    ap = cli.Parser(prog="looped_vs_baseline.py", description=DESCRIPTION)
    add = ap.add_argument
    add("--preset", default="tiny", help=f"a matched pair: {', '.join(presets.pairs())}")
    add("--device", default="cpu", choices=("cpu", "cuda"))
    add("--backend", default="auto", choices=backends.choices())
    add("--dtype", default=None, choices=tuple(driver.DTYPES), help="default: fp32 CPU, bf16 CUDA")
    add(
        "--tokens",
        type=int,
        default=None,
        help="tokens per training/prefill step (default 4096 CPU, 32768 CUDA)",
    )
    add("--seq-len", type=int, default=None, help="context length (default 2048 CPU, 4096 CUDA)")
    add(
        "--mean-doc-len",
        type=float,
        default=None,
        help="packed document length (default 800, as in the paper)",
    )
    add("--mode", default="all", choices=MODES + ("all",))
    add(
        "--repeats",
        type=int,
        default=2,
        help="timed steps per block (default 2; a block counts its fastest)",
    )
    add(
        "--min-rounds",
        type=int,
        default=1,
        help="rounds to run even when every row is settled sooner (default 1)",
    )
    add("--max-rounds", type=int, default=100, help="rounds at most (default 100)")
    add(
        "--account-rounds",
        type=int,
        default=3,
        help="rounds whose blocks, after timing the steps, also profile them for the account "
        "of where each step's time goes; later blocks time the steps alone, so more pairs "
        "fit --max-time (default 3)",
    )
    add(
        "--account-steps",
        type=int,
        default=2,
        help="profiled steps per block in the account rounds (default 2; the account takes "
        "each part's median)",
    )
    add(
        "--max-time",
        type=float,
        default=900.0,
        help="seconds at most: no round starts that would end later (default 900)",
    )
    add(
        "--confidence",
        type=float,
        default=CONFIDENCE,
        help=f"of each row's interval (default {CONFIDENCE})",
    )
    add(
        "--resolution",
        type=float,
        default=RESOLUTION,
        help=f"stop a row whose interval lies within this of its target (default {RESOLUTION})",
    )
    add(
        "--busy-limit",
        type=float,
        default=CONTENTION_LIMIT,
        help="a block is contended when others held more than this share of the cores its "
        f"threads needed (default {CONTENTION_LIMIT})",
    )
    add("--warmup", type=int, default=1, help="untimed calls before each block")
    add(
        "--tolerance",
        type=float,
        default=0.15,
        help="how far a profiled step may exceed the plain step before the account is "
        "taken again (default 0.15)",
    )
    add(
        "--max-tries",
        type=int,
        default=3,
        help="accounts taken of a step before the last one is kept as it is (default 3)",
    )
    _add_decode_and_outputs(ap)
    return ap


def _add_decode_and_outputs(ap: cli.Parser) -> None:
    """The decode, recompute, thread and output options."""
    add = ap.add_argument
    add("--decode-prompt", type=int, default=None, help="prompt length for decode")
    add(
        "--decode-steps",
        type=int,
        default=None,
        help="timed decode steps per block (default 128 on the CPU, 32 on CUDA)",
    )
    add(
        "--decode-batch",
        type=int,
        nargs="+",
        default=None,
        help="decode batch sizes (default 1 8; 1 64 on CUDA)",
    )
    add(
        "--eager-decode",
        action="store_true",
        help="decode with the eager model, not the compiled decode step",
    )
    add(
        "--recompute",
        default="none",
        type=cli.checked(check_recompute),
        metavar="{" + ",".join(RECOMPUTE_POLICIES) + ",all-but-N}",
    )
    add(
        "--no-capture",
        dest="capture",
        action="store_false",
        help="do not capture CUDA graphs (CUDA only)",
    )
    cli.add_threads(ap)
    add("--json", help="write every number here (.json)")
    add("--markdown", help="write the tables here (.md)")
    add(
        "--plot",
        help="write each row's gap, interval and target and wall-clock vs FLOPs here "
        "(.png, .svg, .pdf; matplotlib)",
    )
    add("--quiet", action="store_true", help="no progress lines on stderr")


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
        decode_prompt=512 if cuda else 256,
        decode_steps=32 if cuda else 128,
        decode_batch=[1, 64] if cuda else [1, 8],
    )
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    try:
        args.preset = presets.pair_name(args.preset)
    except presets.PresetError as e:
        raise cli.UsageError(f"--preset: {e}") from None
    make_workload(args)
    check_environment(args)
    return args


def _run(argv: Optional[Sequence[str]] = None) -> int:
    """Run the main job; 0 when it ran (whatever the verdicts)."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    res = driver.run_pair(args, log=None if args.quiet else driver._log)
    res.update(
        preset=args.preset,
        mode=args.mode,
        device=args.device,
        dtype=args.dtype,
        backend=args.backend,
        tolerance=args.tolerance,
        environment=environment(args.device),
    )
    text = report.format_tables(res)
    print("\n" + text)
    if args.markdown:
        cmd = list(argv) if argv is not None else sys.argv[1:]
        Path(args.markdown).write_text(report.markdown(res, text, cmd))
        print(f"wrote {args.markdown}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        report.plot(res, args.plot)
        print(f"wrote {args.plot}")
    print(report.next_step(res))
    return 0


main = cli.command(PROG, _run)
