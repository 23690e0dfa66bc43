"""What the options of ``smelt-train`` (:mod:`smelt_model.train.cli`) make of a run: the
model configs, the initial weights of ``--init``, the run's length and cadence, and the
checks of ``--resume`` against the run on disk. :mod:`.loop` builds the trainers from them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from smelt_model import presets
from smelt_model.config import ModelConfig
from smelt_model.data import tokenizer as tok_mod
from smelt_model.train import checkpoint
from smelt_model.train.runspec import read_run_file
from smelt_tools import cli

__all__ = [
    "default_every",
    "steps_for",
    "init_folder",
    "configs",
    "init_weights",
    "resume_checks",
    "recipe_fields",
]


def default_every(steps: int) -> int:
    """Evaluation (and checkpoint) cadence when none is given: a tenth of the run, but not
    more often than every 10 steps (a run also evaluates at its start and end and saves at
    its end)."""
    return max(10, math.ceil(steps / 10))


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


def init_folder(path: str) -> Path:
    """The folder ``--init`` names: a save_pretrained folder, or the checkpoint that a run
    folder, ``RUN/checkpoints/latest`` or ``step_N`` points at."""

    if not Path(path).exists():
        raise ValueError(f"--init {path}: no such folder")
    return checkpoint.resolve(Path(path))


def _from_file(args, vocab: int):
    """The ModelConfig of ``--config`` or of the ``--init`` folder, its vocabulary checked
    against the tokenizer's ``vocab``."""

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
