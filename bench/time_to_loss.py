"""Time to loss: train a matched pair to the same FLOP budget and compare how much compute,
in ledger FLOPs and in wall-clock seconds, each needs to reach the baseline's final
validation loss.

    python bench/time_to_loss.py                          # tiny pair, stdlib corpus, CPU
    python bench/time_to_loss.py --budget-flops 3e12 --preset tiny --data python-stdlib

Both models train on the identical data order (same seed, same packed contexts, same step
schedule); their optimizer steps are interleaved one at a time so both see the same machine
load. Seconds count only the training steps (evaluation excluded). A model reaches a loss
at the first evaluation at or below it, interpolated linearly (in FLOPs and in seconds)
from the evaluation before. Writes ``<out>.json``, ``<out>.md`` and ``<out>.png``: by
default into the temporary folder the runs train in (its path is printed); ``--out STEM``
chooses the place, e.g. ``--out bench/results/time_to_loss_cpu`` for the committed results.

The runs are ``python -m smelt_model.train``'s (:mod:`smelt_model.train.lockstep`): the
context length, tokens per step and learning rate below are sized for a small FLOP budget
(many short steps); the warm-up, schedule, weight decay and clipping are the pair's
recipe (:func:`smelt_model.presets.recipe`). Errors follow :mod:`smelt_tools.cli`.
"""

from __future__ import annotations

import json
import math
import platform
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
from output_paths import output_file

from smelt_model import presets
from smelt_model.plotting import require
from smelt_model.train import cli as train_cli
from smelt_model.train import plot as plot_mod
from smelt_model.train.lockstep import Progress, build_trainers, run_lockstep
from smelt_model.train.plot import read_log
from smelt_tools import cli
from smelt_tools.timing import cpu_name

PROG = "time_to_loss"

REPO = Path(__file__).resolve().parents[1]


def reach(evals: list[dict], target: float) -> Optional[dict]:
    """FLOPs and seconds at which the validation curve first reaches ``target``."""
    prev = None
    for r in evals:
        if r["val_loss"] <= target:
            if prev is None or prev["val_loss"] == r["val_loss"]:
                return {"flops": r["flops"], "seconds": r["seconds"], "step": r["step"]}
            w = (prev["val_loss"] - target) / (prev["val_loss"] - r["val_loss"])
            return {k: prev[k] + w * (r[k] - prev[k]) for k in ("flops", "seconds", "step")}
        prev = r
    return None


def parse_args(argv: Optional[Sequence[str]] = None):
    """The options, each checked (a :class:`UsageError` naming the first bad one)."""

    ap = cli.Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--preset", default="tiny", help=f"a matched pair: {', '.join(presets.pairs())}"
    )
    ap.add_argument("--data", default="python-stdlib")
    ap.add_argument("--budget-flops", type=float, default=1e12)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--tokens-per-step", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--evals", type=int, default=6, help="evaluations per run")
    ap.add_argument("--eval-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    cli.add_threads(ap, default=1)
    ap.add_argument(
        "--out",
        default=None,
        help="output path without suffix (default: in the temporary folder the "
        "runs train in, printed at the end)",
    )
    args = ap.parse_args(argv)
    try:
        args.preset = presets.pair_name(args.preset)
    except presets.PresetError as e:
        raise cli.UsageError(f"--preset: {e}") from None
    for name in ("budget_flops", "lr"):
        v = getattr(args, name)
        if not (v > 0 and math.isfinite(v)):
            raise cli.UsageError(f"--{name.replace('_', '-')} must be a positive number, got {v}")
    for name in ("tokens_per_step", "evals", "eval_tokens"):
        if getattr(args, name) < 1:
            raise cli.UsageError(
                f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}"
            )
    cli.threads(args.threads)
    if args.seq_len < 2:
        raise cli.UsageError(f"--seq-len must be at least 2, got {args.seq_len}")
    if args.out is not None:
        if not args.out or Path(args.out).suffix:
            raise cli.UsageError(
                f"--out {args.out!r}: give a path without suffix (.json, .md, .png are added)"
            )
        if Path(args.out).is_dir():
            raise cli.UsageError(f"--out {args.out}: is a folder, expected a path to add .json to")
        for suffix in (".json", ".md", ".png"):
            output_file(Path(args.out + suffix), "--out")
    require("the loss plot")
    return args


def _train(args) -> tuple[dict, list, float]:
    """Both models of the pair trained in lockstep to the FLOP budget: (their run folders,
    their trainers, the wall seconds)."""
    work = Path(tempfile.mkdtemp(prefix="time_to_loss_"))
    options = {
        "--preset": args.preset,
        "--arch": "both",
        "--data": args.data,
        "--seq-len": args.seq_len,
        "--tokens-per-step": args.tokens_per_step,
        "--lr": args.lr,
        "--budget-flops": args.budget_flops,
        "--eval-tokens": args.eval_tokens,
        "--seed": args.seed,
        "--out": work,
        "--device": "cpu",
    }
    targs = train_cli.parse_args([str(x) for kv in options.items() for x in kv])
    # eval-every is set per run below from its step count, so both get the same evaluations
    dirs = {a: work / a for a in ("baseline", "smelt")}
    try:
        trainers, corpus = build_trainers(targs, dirs, "cpu")
    except (ValueError, OSError):
        shutil.rmtree(work, ignore_errors=True)
        raise
    for t in trainers:
        t.spec.eval_every = t.spec.save_every = max(1, t.spec.steps // args.evals)
    print(
        f"data: {corpus.n_train_docs} train / {corpus.n_val_docs} val documents, "
        f"{len(corpus.train)} contexts of {args.seq_len} tokens; steps: "
        + ", ".join(f"{t.spec.arch} {t.spec.steps}" for t in trainers),
        file=sys.stderr,
    )
    t0 = time.time()
    run_lockstep(trainers, Progress())
    return dirs, trainers, time.time() - t0


def _summarise(trainers) -> tuple[dict, float, Optional[dict]]:
    """(each run's steps, FLOPs, seconds and evaluations, the baseline's final validation
    loss as the target, SMELT's FLOP and second ratios to reach it or None)."""
    runs = {}
    for t in trainers:
        steps, evals = read_log(t.out)
        runs[t.spec.arch] = {
            "steps": t.spec.steps,
            "flops_per_token": t.flops_per_token,
            "tokens": t.tokens,
            "flops": t.flops,
            "seconds": t.seconds,
            "final_val_loss": evals[-1]["val_loss"],
            "evals": evals,
            "train_loss": [r["loss"] for r in steps],
        }
    target = runs["baseline"]["final_val_loss"]
    for r in runs.values():
        r["to_target"] = reach(r["evals"], target)
    b, s = runs["baseline"]["to_target"], runs["smelt"]["to_target"]
    ratios = None
    if s is not None:
        ratios = {"flops": s["flops"] / b["flops"], "seconds": s["seconds"] / b["seconds"]}
        ratios.update({"flops_saved": 1 - ratios["flops"], "seconds_saved": 1 - ratios["seconds"]})
    return runs, target, ratios


def _run(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dirs, trainers, wall = _train(args)
    runs, target, ratios = _summarise(trainers)
    command = "python bench/time_to_loss.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    work = dirs["baseline"].parent
    out = Path(args.out) if args.out is not None else work / "time_to_loss_cpu"
    opts = dict(vars(args))
    try:  # record the output inside the repository relative to it, never a machine's path
        opts["out"] = str(out.resolve().relative_to(REPO))
    except ValueError:
        opts["out"] = out.name
    result = {
        "command": command.strip(),
        "args": opts,
        "target_loss": target,
        "runs": runs,
        "ratios": ratios,
        "wall_seconds": wall,
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "processor": cpu_name() or platform.machine(),
            "threads": args.threads,
        },
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    plot_mod.plot_runs(
        [dirs["baseline"], dirs["smelt"]],
        out.with_suffix(".png"),
        title=f"{args.preset} pair, {args.data}, {args.budget_flops:.2g} FLOPs",
    )
    md = markdown(result, out.with_suffix(".png").name)
    out.with_suffix(".md").write_text(md)
    print(md)
    print(
        f"wrote {out.with_suffix('.json')}, .md and .png"
        + ("" if args.out else " (a temporary folder: --out chooses the place)"),
        file=sys.stderr,
    )
    return 0


def markdown(r: dict, image: str) -> str:
    def fmt(x, f):
        return "not reached" if x is None else format(x, f)

    lines = [
        f"# Time to loss: {r['args']['preset']} pair on {r['args']['data']} (CPU)",
        "",
        f"Command: `{r['command']}`  ",
        f"Date: {r['date']}, torch {r['machine']['torch']}, "
        f"{r['machine']['threads']} thread(s), total wall-clock {r['wall_seconds']:.0f} s",
        "",
        f"Both models trained to {r['args']['budget_flops']:.3g} ledger FLOPs on the same "
        f"data order; target = the baseline's final validation loss "
        f"({r['target_loss']:.4f}). Seconds count training steps only.",
        "",
        "| arch | steps | tokens | FLOPs | seconds | final val loss | FLOPs to target "
        "| seconds to target |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arch, x in r["runs"].items():
        t = x["to_target"]
        lines.append(
            f"| {arch} | {x['steps']} | {x['tokens']} | {x['flops']:.3e} | "
            f"{x['seconds']:.1f} | {x['final_val_loss']:.4f} | "
            f"{fmt(t and t['flops'], '.3e')} | {fmt(t and t['seconds'], '.1f')} |"
        )
    q = r["ratios"]
    lines.append("")
    if q is None:
        lines.append(
            "SMELT did not reach the baseline's final validation loss within the "
            "budget: no compute saving to report."
        )
    else:
        lines.append(
            f"SMELT / baseline to reach the target: FLOPs {q['flops']:.3f} "
            f"(compute saved {100 * q['flops_saved']:+.1f}%), seconds "
            f"{q['seconds']:.3f} (saved {100 * q['seconds_saved']:+.1f}%)."
        )
    lines += ["", f"![validation loss]({image})", ""]
    return "\n".join(lines)


main = cli.command(PROG, _run)

if __name__ == "__main__":
    raise SystemExit(main())
