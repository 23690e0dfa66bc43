"""``smelt-train`` (``python -m smelt_model.train``): train a baseline, a SMELT model or a
matched pair on text, in one process (the CPU or one GPU).

    smelt-train --preset tiny --steps 20 --out runs/tiny --plot runs/tiny/loss.png
    smelt-train --init runs/tiny-smelt-trained --preset tiny-smelt --steps 20 --out runs/more

What to train: ``--preset`` a pair name (``tiny``: both models on the same data order;
``--arch`` picks one) or a model name (``tiny-smelt``); ``--config`` a ``ModelConfig`` JSON
file; or ``--init`` the weights and config of a ``SmeltLM.save_pretrained`` folder or a
trainer's checkpoint (what ``smelt-export`` writes from a torchtitan run; with
``--preset``, the named model must be the folder's). A preset keeps its own
vocabulary, so it is the model ``smelt_model.titan`` trains under the same name, unless the
tokenizer needs more ids. The learning rate and its schedule, the context length, the batch,
weight decay and clipping default to the preset's :func:`smelt_model.presets.recipe` (the
tiny pair's without a preset), the same recipe ``smelt_model.titan`` starts from.

Runs on several processes go through torchtitan (``torchrun ... -m smelt_model.titan
--config PRESET``); started under torchrun (one process or several) this command refuses
with exit status 2, and only rank 0 says so.

Errors follow :mod:`smelt_tools.cli`: a bad option (``--seq-len`` below 2, an unknown
preset) is one line and exit status 2 before any work; a failure the run meets (a missing
path, an empty corpus, a config whose vocabulary is smaller than the tokenizer's, a model
that would not fit in memory, ``--resume`` of a different run, a damaged run file) one line
and exit status 1, before any training. ``--resume`` compares ``run.json`` before anything is
built, never starts a run over and leaves the run's files untouched when it refuses; with a
larger ``--steps`` it extends a finished run.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from smelt_kernels import backends
from smelt_model import presets
from smelt_model.data import tokenizer as tok_mod
from smelt_model.plotting import plot_path
from smelt_model.schedule import RECOMPUTE_POLICIES, check_recompute
from smelt_model.train import plot as plot_mod
from smelt_model.train.lockstep import (
    Progress,
    build_trainers,
    merge_endpoints,
    run_lockstep,
    summary_line,
)
from smelt_model.train.options import configs, recipe_fields, resume_checks
from smelt_model.train.runspec import compare
from smelt_model.train.trainer import check_memory
from smelt_tools import cli

__all__ = ["PROG", "main", "build_parser", "parse_args"]

PROG = "smelt-train"

#: options whose default is the preset's recipe: (option, Recipe field)
_RECIPE = {
    "lr": "lr",
    "warmup_steps": "warmup_steps",
    "min_lr_ratio": "min_lr_factor",
    "seq_len": "seq_len",
    "tokens_per_step": "tokens_per_step",
    "weight_decay": "weight_decay",
    "grad_clip": "grad_clip",
}


def build_parser() -> cli.Parser:

    ap = cli.Parser(
        prog=PROG, description="Train baseline / SMELT models on packed documents, one process."
    )
    recipe = " (default: the preset's recipe)"
    what = ap.add_argument_group("what to train")
    what.add_argument("--preset", help="a pair (tiny, 200M-S95) or one model (tiny-smelt)")
    what.add_argument(
        "--arch",
        choices=("baseline", "smelt", "both"),
        help="which model of a pair (default both: the two on the same data order)",
    )
    what.add_argument("--config", help="a ModelConfig JSON file (instead of --preset)")
    what.add_argument(
        "--init",
        metavar="FOLDER",
        help="start from these weights: a save_pretrained folder or a trainer checkpoint",
    )
    what.add_argument("--seed", type=int, default=0)
    data = ap.add_argument_group("data")
    data.add_argument(
        "--data",
        default="python-stdlib",
        help="a folder, a .txt (blank-line separated) or .jsonl file, or python-stdlib (default)",
    )
    data.add_argument("--seq-len", type=int, help="tokens per context" + recipe)
    data.add_argument("--val-fraction", type=float, default=0.05)
    data.add_argument("--tokenizer", default="bytes", help="bytes (default) or bpe:N")
    opt = ap.add_argument_group("optimisation")
    opt.add_argument("--lr", type=float, help="peak learning rate" + recipe)
    opt.add_argument("--weight-decay", type=float, help="AdamW's, on weight matrices" + recipe)
    opt.add_argument("--warmup-steps", type=int, help="linear warm-up" + recipe)
    opt.add_argument(
        "--min-lr-ratio",
        type=float,
        help="where the cosine ends, as a fraction of --lr" + recipe,
    )
    opt.add_argument("--grad-clip", type=float, help="0 disables clipping" + recipe)
    opt.add_argument("--tokens-per-step", type=int, help="tokens per optimizer step" + recipe)
    opt.add_argument(
        "--batch-size",
        type=int,
        help="contexts per micro-batch (default: the whole step, no accumulation)",
    )
    opt.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    opt.add_argument(
        "--recompute",
        type=cli.checked(check_recompute),
        default=RECOMPUTE_POLICIES[0],
        metavar="{" + ",".join(RECOMPUTE_POLICIES) + ",all-but-N}",
        help="which executed layers the backward recomputes (all-but-N: all but the last N)",
    )
    stop = ap.add_argument_group("when to stop (the first reached)")
    stop.add_argument("--steps", type=int)
    stop.add_argument("--tokens", type=float)
    stop.add_argument("--budget-flops", type=float, help="ledger training FLOPs")
    out = ap.add_argument_group("output")
    out.add_argument("--out", required=True, help="run folder")
    out.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out (a larger --steps extends it)",
    )
    out.add_argument(
        "--allow-nonbitwise",
        action="store_true",
        help="let --resume use another --threads or --backend than the run (the "
        "result is then no longer bitwise equal to an uninterrupted run)",
    )
    out.add_argument(
        "--eval-every",
        type=int,
        help="steps (default: a tenth of the run, at least 10; also at the start and the end)",
    )
    out.add_argument(
        "--eval-tokens", type=int, default=32768, help="validation tokens per evaluation"
    )
    out.add_argument(
        "--save-every", type=int, help="steps (default: the evaluation cadence; always at the end)"
    )
    out.add_argument("--keep", type=int, default=2, help="checkpoints to keep")
    out.add_argument("--plot", help="draw validation loss against FLOPs and seconds (.png)")
    out.add_argument(
        "--backend",
        default="auto",
        choices=backends.choices(),
        help="kernel backend (default auto)",
    )
    out.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    cli.add_threads(out)
    out.add_argument("--quiet", action="store_true", help="no progress lines")
    return ap


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The options, checked (a :class:`smelt_tools.cli.UsageError` naming the first bad
    one), with the recipe's defaults filled in and ``args.models`` set: ``{arch: name}``
    of the presets to train (empty for ``--config`` / ``--init`` alone)."""

    args = build_parser().parse_args(argv)
    given = [o for o in ("preset", "config") if getattr(args, o) is not None]
    if len(given) > 1 or (args.config is not None and args.init is not None):
        raise cli.UsageError("give one of --preset and --config (--init may name a preset)")
    if not given and args.init is None:
        raise cli.UsageError("give --preset, --config or --init (what to train)")
    args.models = _models(args.preset, args.arch) if args.preset is not None else {}
    args.warmup_given = args.warmup_steps is not None  # else a resumed run keeps its own
    recipe = presets.recipe(args.preset)
    for option, field in _RECIPE.items():
        if getattr(args, option) is None:
            setattr(args, option, getattr(recipe, field))
    _check_numbers(args)
    cli.threads(args.threads)
    args.plot = plot_path(args.plot)
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise cli.UsageError(f"--out {args.out}: is a file, expected a run folder")
    return args


def _models(preset: str, arch: Optional[str]) -> dict[str, str]:
    """{arch: model preset name} that ``--preset`` and ``--arch`` select."""

    try:
        found = presets.resolve(preset)
    except presets.PresetError as e:
        raise cli.UsageError(f"--preset: {e}") from None
    by_arch = {name.rsplit("-", 1)[1]: name for name in found}
    if arch in (None, "both"):
        if arch == "both" and len(by_arch) == 1:
            model = found[0]
            pair, arch_of = model.rsplit("-", 1)
            other = f"{pair}-{'smelt' if arch_of == 'baseline' else 'baseline'}"
            raise cli.UsageError(
                f"--arch both: {model} is a model; this needs a pair name: "
                f"{pair} (holds {model} and {other})"
            )
        return by_arch
    if arch not in by_arch:
        other = found[0].rsplit("-", 1)[0] + f"-{arch}"
        raise cli.UsageError(f"--preset {preset} is not the {arch} model; that is {other}")
    return {arch: by_arch[arch]}


def _check_numbers(args) -> None:
    if args.steps is None and args.tokens is None and args.budget_flops is None:
        raise cli.UsageError("give --steps, --tokens or --budget-flops (when to stop)")
    if args.steps is not None and args.steps < 1:
        raise cli.UsageError(f"--steps must be >= 1, got {args.steps}")
    for name in ("tokens", "budget_flops"):
        v = getattr(args, name)
        if v is not None and not (v > 0 and math.isfinite(v)):
            raise cli.UsageError(f"--{name.replace('_', '-')} must be a positive number, got {v}")
    if args.seq_len < 2:
        raise cli.UsageError(f"--seq-len must be >= 2, got {args.seq_len}")
    for name in ("tokens_per_step", "eval_tokens"):
        if getattr(args, name) < 1:
            raise cli.UsageError(f"--{name.replace('_', '-')} must be positive")
    for name in ("batch_size", "eval_every", "save_every", "warmup_steps"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise cli.UsageError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if not args.lr > 0:
        raise cli.UsageError(f"--lr must be > 0, got {args.lr}")
    if not 0 <= args.min_lr_ratio <= 1:
        raise cli.UsageError(f"--min-lr-ratio must be in [0, 1], got {args.min_lr_ratio}")
    if not (args.weight_decay >= 0 and args.grad_clip >= 0):
        raise cli.UsageError("--weight-decay and --grad-clip must be >= 0")
    if args.device not in (None, "cpu", "cuda"):
        raise cli.UsageError(f"--device must be cpu or cuda, got {args.device!r}")


#: what torchrun sets in every process it starts (one process included)
TORCHRUN_ENV = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "WORLD_SIZE")


def torchrun_rank() -> Optional[int]:
    """This process's rank when torchrun started it (any of :data:`TORCHRUN_ENV` is set:
    ``RANK``, else ``LOCAL_RANK``, else 0), None otherwise."""
    if not any(name in os.environ for name in TORCHRUN_ENV):
        return None
    for name in ("RANK", "LOCAL_RANK"):
        try:
            return int(os.environ[name])
        except (KeyError, ValueError):
            continue
    return 0


def _under_torchrun(argv: Optional[Sequence[str]]) -> cli.UsageError:
    """The refusal of a start under torchrun, naming the command that trains there (with
    the preset of ``argv`` when it names one)."""
    try:
        names = list(parse_args(argv).models.values())
    except (ValueError, TypeError):  # a bad option: the refusal names a placeholder instead
        names = []
    names = names or ["PRESET"]
    target = names[0] + (f" (or {names[1]})" if len(names) > 1 else "")
    return cli.UsageError(
        "trains in one process (the CPU or one GPU) and was started under torchrun; there use "
        f"torchrun --nproc_per_node N -m smelt_model.titan --config {target}"
    )


def _device(args) -> str:

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise cli.UsageError("--device cuda: no CUDA device is available")
    return device


def _run(argv: Optional[Sequence[str]] = None) -> int:
    """Train (see the module docstring)."""
    rank = torchrun_rank()
    if rank is not None:
        if rank != 0:
            return 2  # rank 0 says why, once
        raise _under_torchrun(argv)
    args = parse_args(argv)
    try:
        tok_mod.parse_spec(args.tokenizer)
    except ValueError as e:
        raise cli.UsageError(str(e)) from None
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = _device(args)
    out = Path(args.out)
    # the configs first (cheap: a bad one stops before any tokenising), then the run on disk
    spec_vocab = tok_mod.parse_spec(args.tokenizer)[1]
    archs = list(configs(args, spec_vocab))
    dirs = {a: (out / a if len(archs) > 1 else out) for a in archs}
    saved, _, vocab = resume_checks(args, dirs, spec_vocab)
    cfgs = configs(args, vocab)
    for a, spec in saved.items():
        compare(recipe_fields(args, a, cfgs[a]), spec, dirs[a], args.allow_nonbitwise)
    rows = args.tokens_per_step // args.seq_len
    what = next(
        f"--{o} {getattr(args, o)}" for o in ("preset", "config", "init") if getattr(args, o)
    )
    check_memory(
        cfgs,
        batch_size=args.batch_size or max(1, rows),
        seq_len=args.seq_len,
        dtype=args.dtype,
        device=device,
        what=what,
    )
    trainers, corpus = build_trainers(args, dirs, device)
    if not args.quiet:
        print(
            f"data: {corpus.n_train_docs} train / {corpus.n_val_docs} val documents, "
            f"{len(corpus.train)} x {args.seq_len}-token contexts, mean document "
            f"{corpus.train.mean_doc_len:.0f} tokens, tokenizer {corpus.tokenizer.spec}",
            file=sys.stderr,
        )
    run_lockstep(trainers, Progress(enabled=not args.quiet))
    lines = [summary_line(t) for t in trainers]
    if len(dirs) > 1:
        merge_endpoints([d / "endpoints.csv" for d in dirs.values()], out / "endpoints.csv")
        lines.append(f"endpoints of both: {out / 'endpoints.csv'}")
    if args.plot:
        plot_mod.plot_runs(list(dirs.values()), args.plot)
        lines.append(f"plot: {args.plot}")
    print("\n".join(lines))
    return 0


main = cli.command(PROG, _run)
