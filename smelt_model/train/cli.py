"""``smelt-train`` (``python -m smelt_model.train``): train a baseline, a SMELT model or a
matched pair on text, in one process (the CPU or one GPU).

    smelt-train --preset tiny --steps 20 --out runs/tiny --plot runs/tiny/loss.png
    smelt-train --init runs/tiny-smelt-trained --preset tiny-smelt --steps 20 --out runs/more

What to train: ``--preset`` a pair name (``tiny``: both models on the same data order;
``--arch`` picks one) or a model name (``tiny-smelt``); ``--config`` a ``ModelConfig`` JSON
file; or ``--init`` the weights and config of a ``SmeltLM.save_pretrained`` folder or a
trainer's checkpoint (what ``python -m smelt_model.titan.export`` writes from a torchtitan
run; with ``--preset``, the named model must be the folder's). A preset keeps its own
vocabulary, so it is the model ``smelt_model.titan`` trains under the same name, unless the
tokenizer needs more ids. The learning rate and its schedule, the context length, the batch,
weight decay and clipping default to the preset's :func:`smelt_model.presets.recipe` (the
tiny pair's without a preset), the same recipe ``smelt_model.titan`` starts from.

Runs on several processes go through torchtitan (``torchrun ... -m smelt_model.titan
--config PRESET``); started under torchrun this command refuses and says so.

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

from smelt_tools import cli

__all__ = ["PROG", "main", "build_parser", "parse_args", "default_every"]

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


def default_every(steps: int) -> int:
    """Evaluation (and checkpoint) cadence when none is given: a tenth of the run, but not
    more often than every 10 steps (a run also evaluates at its start and end and saves at
    its end)."""
    return max(10, math.ceil(steps / 10))


def build_parser() -> cli.Parser:
    from smelt_kernels import backends
    from smelt_model.executor import RECOMPUTE_POLICIES

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
        choices=RECOMPUTE_POLICIES,
        default=RECOMPUTE_POLICIES[0],
        help="what the looped span recomputes in backward",
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
    from .. import presets

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
    args.plot = cli.output_path(args.plot, "--plot", (".png", ".pdf", ".svg"))
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise cli.UsageError(f"--out {args.out}: is a file, expected a run folder")
    return args


def _models(preset: str, arch: Optional[str]) -> dict[str, str]:
    """{arch: model preset name} that ``--preset`` and ``--arch`` select."""
    from .. import presets

    try:
        found = presets.resolve(preset)
    except cli.UsageError as e:
        raise cli.UsageError(f"--preset: {e}") from None
    by_arch = {name.rsplit("-", 1)[1]: name for name in found}
    if arch in (None, "both"):
        if arch == "both" and len(by_arch) == 1:
            raise cli.UsageError(f"--arch both: --preset {preset} is one model; name a pair")
        return by_arch
    if arch not in by_arch:
        other = found[0].rsplit("-", 1)[0] + f"-{arch}"
        raise cli.UsageError(f"--preset {preset} is not the {arch} model; that is {other}")
    return {arch: by_arch[arch]}


def _check_numbers(args) -> None:
    if args.steps is not None and args.steps < 1:
        raise cli.UsageError(f"--steps must be >= 1, got {args.steps}")
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


def steps_for(args, tokens_per_step: int, flops_per_token: float) -> int:
    """The run's length: the first of ``--steps``, ``--tokens`` and ``--budget-flops``."""
    limits = []
    if args.steps is not None:
        limits.append(args.steps)
    if args.tokens is not None:
        limits.append(math.ceil(args.tokens / tokens_per_step))
    if args.budget_flops is not None:
        limits.append(math.ceil(args.budget_flops / (tokens_per_step * flops_per_token)))
    if not limits:
        raise cli.UsageError("give --steps, --tokens or --budget-flops")
    steps = min(limits)
    if steps < 1:
        raise cli.UsageError("--steps, --tokens and --budget-flops must be positive")
    return steps


def _single_process(args) -> None:
    """Refuse a start under torchrun: several processes train through torchtitan."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    names = list(args.models.values()) or ["PRESET"]
    target = names[0] + (f" (or {names[1]})" if len(names) > 1 else "")
    raise cli.UsageError(
        "trains in one process (the CPU or one GPU); on several processes use "
        f"torchrun --nproc_per_node N -m smelt_model.titan --config {target}"
    )


def _device(args) -> str:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise cli.UsageError("--device cuda: no CUDA device is available")
    return device


def init_folder(path: str) -> Path:
    """The folder ``--init`` names: a save_pretrained folder, or the checkpoint that a run
    folder, ``RUN/checkpoints/latest`` or ``step_N`` points at."""
    from . import checkpoint

    if not Path(path).exists():
        raise ValueError(f"--init {path}: no such folder")
    return checkpoint.resolve(Path(path))


def _from_file(args, vocab: int):
    """The ModelConfig of ``--config`` or of the ``--init`` folder, its vocabulary checked
    against the tokenizer's ``vocab``."""
    from ..config import ModelConfig

    if args.config is not None:
        where, path = f"--config {args.config}", Path(args.config)
    else:
        where, path = f"--init {args.init}", init_folder(args.init) / "config.json"
    if not path.is_file():
        raise ValueError(f"{where}: {path} not found")
    try:
        cfg = ModelConfig.from_json(path)
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{where}: {e}") from None
    if cfg.vocab_size < vocab:
        raise ValueError(
            f"{where}: vocab_size {cfg.vocab_size} is smaller than the tokenizer's {vocab}"
        )
    return cfg


def configs(args, vocab: int) -> dict:
    """{arch: ModelConfig} of the run, for a tokenizer of ``vocab`` ids: a preset keeps its
    vocabulary unless the tokenizer needs more; a file's must hold the tokenizer's."""
    from .. import presets

    if not args.models:  # --config, or --init alone
        cfg = _from_file(args, vocab)
        arch = "smelt" if cfg.is_looped else "baseline"
        if args.arch not in (None, arch):
            raise cli.UsageError(
                f"--arch {args.arch}: the model of {args.config or args.init} is the {arch}"
            )
        return {arch: cfg}
    found = {}
    for arch, name in args.models.items():
        cfg = presets.get(name)
        found[arch] = cfg.replace(vocab_size=max(cfg.vocab_size, vocab))
    if args.init is not None:
        if len(found) != 1:
            raise cli.UsageError(
                f"--init starts one model, and --preset {args.preset} is a pair: add --arch "
                "or name the model"
            )
        (arch, want), have = next(iter(found.items())), _from_file(args, vocab)
        if have.replace(vocab_size=want.vocab_size) != want:
            a, b = have.to_dict(), want.to_dict()
            differ = [k for k in a if a[k] != b.get(k)]
            raise ValueError(
                f"--init {args.init}: holds another model than --preset {args.preset} "
                f"({', '.join(differ)} differ)"
            )
        found[arch] = have
    return found


def init_weights(args) -> Optional[dict]:
    """The ``--init`` folder's weights (safetensors: nothing in them can run code)."""
    if args.init is None:
        return None
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = init_folder(args.init) / "model.safetensors"
    if not path.is_file():
        raise ValueError(f"--init {args.init}: {path} not found")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None


def resume_checks(args, dirs: dict, vocab_spec: int):
    """On ``--resume``: each run's ``run.json`` (a damaged one is refused naming it) and the
    run's own tokenizer; the recipe the arguments ask for is compared here, before any data
    or model. Returns ``(saved specs by arch or {}, tokenizer or None, vocabulary size)``."""
    from . import tokenizer as tok_mod
    from .runspec import read_run_file

    if not args.resume:
        for d in dirs.values():
            if (d / "run.json").exists():
                raise ValueError(
                    f"--out {d} already holds a run; pass --resume to continue "
                    "it or choose another --out"
                )
        return {}, None, vocab_spec
    saved = {}
    for a, d in dirs.items():
        if not (d / "run.json").exists():
            raise ValueError(f"--resume: no run in {d} (run.json not found)")
        saved[a] = read_run_file(d / "run.json")
    first = next(iter(dirs.values()))
    tokenizer = tok_mod.load(first) if (first / tok_mod.FILE).exists() else None
    return saved, tokenizer, (tokenizer.vocab_size if tokenizer else vocab_spec)


def recipe_fields(args, arch: str, cfg) -> dict:
    """The RunSpec fields the command line fixes without reading the data."""
    import torch

    now = {
        "arch": arch,
        "config": cfg.to_dict(),
        "seed": args.seed,
        "data": args.data,
        "tokenizer": args.tokenizer,
        "seq_len": args.seq_len,
        "val_fraction": args.val_fraction,
        "tokens_per_step": args.tokens_per_step,
        "lr": args.lr,
        "weight_decay": args.weight_decay,
        "min_lr_ratio": args.min_lr_ratio,
        "grad_clip": args.grad_clip,
        "dtype": args.dtype,
        "recompute": args.recompute,
        "threads": torch.get_num_threads(),
        "backend": args.backend,
    }
    if args.warmup_given:
        now["warmup_steps"] = args.warmup_steps
    return now


def _run(argv: Optional[Sequence[str]] = None) -> int:
    """Train (see the module docstring)."""
    from . import plot as plot_mod
    from . import tokenizer as tok_mod
    from .loop import Progress, build_trainers, merge_endpoints, summary_line, train_loop
    from .runspec import compare
    from .trainer import check_memory

    args = parse_args(argv)
    _single_process(args)
    try:
        tok_mod.parse_spec(args.tokenizer)
    except ValueError as e:
        raise cli.UsageError(str(e)) from None
    if args.plot:
        plot_mod.require()
    if args.threads is not None:
        import torch

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
    what = f"--preset {args.preset}" if args.preset else f"--config {args.config or args.init}"
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
    train_loop(trainers, Progress(enabled=not args.quiet))
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
