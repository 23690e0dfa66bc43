"""``python -m smelt_model.train``: train a baseline, a SMELT model or a matched pair on text.

    python -m smelt_model.train --preset tiny --arch both --data python-stdlib \\
        --budget-flops 2e13 --out runs/tiny --plot runs/tiny/loss.png
    torchrun --nproc_per_node 2 -m smelt_model.train --preset tiny --arch smelt ...

Bad input (a missing path, an empty corpus, ``--seq-len`` below 2, a config whose vocabulary
is smaller than the tokenizer's, a model that would not fit in memory, ``--resume`` of a
different run, a damaged run file) stops with one line on stderr and a non-zero exit before
any training. ``--resume`` compares ``run.json`` before anything is built, never starts a run
over and leaves the run's files untouched when it refuses; with a larger ``--steps`` it
extends a finished run.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from smelt_tools.cli import ExitParser

__all__ = ["main", "build_parser"]


def default_every(steps: int) -> int:
    """Evaluation (and checkpoint) cadence when none is given: a tenth of the run, but not
    more often than every 10 steps (a run also evaluates at its start and end and saves at
    its end)."""
    return max(10, math.ceil(steps / 10))


def build_parser() -> argparse.ArgumentParser:
    from smelt_kernels import backends
    from smelt_model.executor import RECOMPUTE_POLICIES

    ap = ExitParser(
        prog="python -m smelt_model.train",
        description="Train baseline / SMELT models on packed documents.",
    )
    what = ap.add_argument_group("what to train")
    what.add_argument("--preset", help="a matched pair (e.g. tiny, 200M-S95)")
    what.add_argument(
        "--arch",
        choices=("baseline", "smelt", "both"),
        default="both",
        help="which model of the pair (both: the two on the same data order)",
    )
    what.add_argument("--config", help="a ModelConfig JSON file (instead of --preset)")
    what.add_argument("--seed", type=int, default=0)
    data = ap.add_argument_group("data")
    data.add_argument(
        "--data",
        default="python-stdlib",
        help="a folder, a .txt (blank-line separated) or .jsonl file, or python-stdlib (default)",
    )
    data.add_argument("--seq-len", type=int, default=256)
    data.add_argument("--val-fraction", type=float, default=0.05)
    data.add_argument("--tokenizer", default="bytes", help="bytes (default) or bpe:N")
    opt = ap.add_argument_group("optimisation")
    opt.add_argument("--lr", type=float, default=2e-3)
    opt.add_argument("--weight-decay", type=float, default=0.1)
    opt.add_argument("--warmup-steps", type=int, help="default: 5%% of the steps (at least 1)")
    opt.add_argument(
        "--min-lr-ratio",
        type=float,
        default=0.1,
        help="final learning rate of the cosine, as a fraction of --lr",
    )
    opt.add_argument("--grad-clip", type=float, default=1.0, help="0 disables clipping")
    opt.add_argument("--tokens-per-step", type=int, default=8192)
    opt.add_argument(
        "--batch-size",
        type=int,
        help="contexts per micro-batch and process (default: no accumulation)",
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
    out.add_argument("--plot", help="draw validation loss against FLOPs and seconds")
    out.add_argument(
        "--backend",
        default="auto",
        choices=backends.choices(),
        help="kernel backend (default auto)",
    )
    out.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    out.add_argument(
        "--threads",
        type=int,
        help="CPU threads for torch and the kernels (default: torch's choice)",
    )
    out.add_argument("--quiet", action="store_true", help="no progress line")
    return ap


def _configs(args, vocab: int) -> dict:
    """{arch: ModelConfig} with the vocabulary set from the tokenizer."""
    from .. import presets
    from ..config import ModelConfig

    if (args.preset is None) == (args.config is None):
        raise ValueError("give exactly one of --preset and --config")
    if args.config is not None:
        path = Path(args.config)
        if not path.exists():
            raise ValueError(f"--config {args.config}: no such file")
        try:
            cfg = ModelConfig.from_json(path)
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"--config {args.config}: {e}") from None
        if cfg.vocab_size < vocab:
            raise ValueError(
                f"--config {args.config}: vocab_size {cfg.vocab_size} is smaller "
                f"than the tokenizer's {vocab}"
            )
        return {"smelt" if cfg.is_looped else "baseline": cfg}
    if args.preset not in presets.pairs():
        raise ValueError(
            f"--preset: unknown pair {args.preset!r}; known: {', '.join(presets.pairs())}"
        )
    base, smelt = presets.pair(args.preset)
    cfgs = {"baseline": base.replace(vocab_size=vocab), "smelt": smelt.replace(vocab_size=vocab)}
    return cfgs if args.arch == "both" else {args.arch: cfgs[args.arch]}


def _steps(args, tokens_per_step: int, flops_per_token: float) -> int:
    limits = []
    if args.steps is not None:
        limits.append(args.steps)
    if args.tokens is not None:
        limits.append(math.ceil(args.tokens / tokens_per_step))
    if args.budget_flops is not None:
        limits.append(math.ceil(args.budget_flops / (tokens_per_step * flops_per_token)))
    if not limits:
        raise ValueError("give --steps, --tokens or --budget-flops")
    steps = min(limits)
    if steps < 1:
        raise ValueError("--steps, --tokens and --budget-flops must be positive")
    return steps


def _check_numbers(args) -> None:
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.seq_len < 2:
        raise ValueError(f"--seq-len must be >= 2, got {args.seq_len}")
    for name in ("tokens_per_step", "eval_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    for name in ("batch_size", "eval_every", "save_every", "warmup_steps", "threads"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if not args.lr > 0:
        raise ValueError(f"--lr must be > 0, got {args.lr}")
    if not 0 <= args.min_lr_ratio <= 1:
        raise ValueError(f"--min-lr-ratio must be in [0, 1], got {args.min_lr_ratio}")
    if args.weight_decay < 0 or args.grad_clip < 0:
        raise ValueError("--weight-decay and --grad-clip must be >= 0")


def _init_distributed(args):
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    if world > 1 and not dist.is_initialized():
        if device == "cuda":
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            device = f"cuda:{local}"
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return device


def _resume_checks(args, dirs: dict, vocab_spec: int):
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


def _recipe(args, arch: str, cfg) -> dict:
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
    if args.warmup_steps is not None:
        now["warmup_steps"] = args.warmup_steps
    return now


def run(args) -> int:
    from . import plot as plot_mod
    from . import tokenizer as tok_mod
    from .runspec import compare
    from .trainer import check_memory

    _check_numbers(args)
    tok_mod.parse_spec(args.tokenizer)
    if args.plot:
        plot_mod.require()
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    device = _init_distributed(args)
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    out = Path(args.out)
    both = args.preset is not None and args.arch == "both"
    # the configs first (cheap: a bad one stops before any tokenising), then the run on disk
    archs = list(_configs(args, tok_mod.parse_spec(args.tokenizer)[1]))
    dirs = {a: (out / a if both else out) for a in archs}
    saved, _, vocab = _resume_checks(args, dirs, tok_mod.parse_spec(args.tokenizer)[1])
    cfgs = _configs(args, vocab)
    for a, spec in saved.items():
        compare(_recipe(args, a, cfgs[a]), spec, dirs[a], args.allow_nonbitwise)
    rows = args.tokens_per_step // args.seq_len
    what = f"--preset {args.preset}" if args.preset else f"--config {args.config}"
    check_memory(
        cfgs,
        batch_size=args.batch_size or max(1, rows // world),
        seq_len=args.seq_len,
        dtype=args.dtype,
        world=world,
        local_world=int(os.environ.get("LOCAL_WORLD_SIZE", world)),
        device=device,
        what=what,
    )
    trainers, corpus = build_trainers(args, dirs, device, rank)
    if rank == 0 and not args.quiet:
        print(
            f"data: {corpus.n_train_docs} train / {corpus.n_val_docs} val documents, "
            f"{len(corpus.train)} x {args.seq_len}-token contexts, mean document "
            f"{corpus.train.mean_doc_len:.0f} tokens, tokenizer {corpus.tokenizer.spec}",
            file=sys.stderr,
        )
    progress = _Progress(enabled=rank == 0 and not args.quiet)
    train_loop(trainers, progress)
    if rank == 0:
        if both:
            merge_endpoints([d / "endpoints.csv" for d in dirs.values()], out / "endpoints.csv")
        if args.plot:
            plot_mod.plot_runs(list(dirs.values()), args.plot)
        print("\n".join(_summary_line(t) for t in trainers))
    if dist.is_initialized():
        # an orderly teardown: every rank past its last file write, and the sharded models
        # (which hold the process group) released while the interpreter is fully alive, so
        # no rank's communication threads are torn down at interpreter exit
        dist.barrier()
        trainers.clear()
        gc.collect()
        dist.destroy_process_group()
    return 0


def _summary_line(t) -> str:
    last = f"{t.last_val:.4f}" if t.last_val is not None else "n/a"
    return (
        f"{t.spec.arch}: {t.step_count} steps, {t.tokens} tokens, {t.flops:.3e} "
        f"FLOPs, {t.seconds:.1f} s, val loss {last} -> {t.out}"
    )


def build_trainers(args, dirs: dict, device: str, rank: int = 0):
    """Load and pack the data once, and make one :class:`Trainer` per architecture of
    ``args`` (writing into ``dirs[arch]``). Returns ``(trainers, corpus)``. With
    ``args.resume`` the runs' own tokenizer is used, and settings the command line leaves
    out (the warm-up) come from their ``run.json``."""
    import torch
    import torch.distributed as dist

    from .. import budget
    from .data import prepare
    from .trainer import RunSpec, Trainer

    saved, tokenizer, _ = _resume_checks(args, dirs, 0)
    corpus = prepare(
        args.data, args.tokenizer, args.seq_len, args.val_fraction, args.seed, tokenizer
    )
    cfgs = _configs(args, corpus.tokenizer.vocab_size)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rows = args.tokens_per_step // args.seq_len
    batch = args.batch_size or max(1, rows // world)

    trainers = []
    for arch, cfg in cfgs.items():
        fpt = budget.ledger(cfg, corpus.train.mean_doc_len, args.seq_len).flops_per_token
        steps = _steps(args, args.tokens_per_step, fpt)
        every = args.eval_every or default_every(steps)
        old = saved.get(arch)
        warmup = args.warmup_steps or (old.warmup_steps if old else max(1, round(0.05 * steps)))
        spec = RunSpec(
            arch=arch,
            config=cfg.to_dict(),
            seed=args.seed,
            data=args.data,
            tokenizer=args.tokenizer,
            seq_len=args.seq_len,
            val_fraction=args.val_fraction,
            tokens_per_step=args.tokens_per_step,
            batch_size=batch,
            steps=steps,
            lr=args.lr,
            weight_decay=args.weight_decay,
            warmup_steps=warmup,
            min_lr_ratio=args.min_lr_ratio,
            grad_clip=args.grad_clip,
            dtype=args.dtype,
            recompute=args.recompute,
            eval_every=every,
            save_every=args.save_every or every,
            eval_tokens=args.eval_tokens,
            keep=args.keep,
            schedule_steps=old.schedule_steps if old else steps,
            threads=torch.get_num_threads(),
            backend=args.backend,
        )
        trainers.append(
            Trainer(
                spec,
                corpus.train,
                corpus.val,
                dirs[arch],
                device=device,
                resume=args.resume,
                allow_nonbitwise=getattr(args, "allow_nonbitwise", False),
            )
        )
        if rank == 0:
            corpus.tokenizer.save(dirs[arch])
    return trainers, corpus


def train_loop(trainers, progress=None) -> None:
    """Interleave the trainers one optimizer step at a time until all are done, evaluating
    and checkpointing on their schedules (and at the end)."""

    def due(t, every):
        return t.step_count % every == 0 or t.done

    for t in trainers:  # the first evaluation, before any step
        if t.step_count == 0 and t.last_val is None:
            t.evaluate()
    while not all(t.done for t in trainers):
        for t in trainers:
            if t.done:
                continue
            rec = t.step()
            if due(t, t.spec.eval_every):
                t.evaluate()
            if due(t, t.spec.save_every):
                t.save()
            if progress is not None:
                progress.update(t, rec)
    if progress is not None:
        progress.close()


def merge_endpoints(paths, out) -> None:
    """Concatenate endpoint CSVs that share a header into one file."""
    header, rows = None, []
    for p in paths:
        lines = Path(p).read_text().splitlines()
        if not lines:
            continue
        header = header or lines[0]
        rows += lines[1:]
    Path(out).write_text("\n".join([header, *rows]) + "\n")


class _Progress:
    """One status line on stderr: rewritten in place on a terminal, else every ~5%."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.last = {}

    def update(self, t, rec) -> None:
        if not self.enabled:
            return
        secs = max(rec["seconds"], 1e-9)
        val = f" val {t.last_val:.3f}" if t.last_val is not None else ""
        self.last[t.spec.arch] = (
            f"{t.spec.arch} {rec['step']}/{t.spec.steps} loss {rec['loss']:.3f}{val} "
            f"{rec['tokens'] / secs:,.0f} tok/s {rec['flops'] / secs / 1e9:.2f} GFLOP/s"
        )
        line = " | ".join(self.last.values())
        if self.tty:
            print("\r" + line[:200].ljust(120), end="", file=sys.stderr, flush=True)
        elif rec["step"] % max(1, t.spec.steps // 20) == 0 or t.done:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled and self.tty:
            print(file=sys.stderr)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (ValueError, KeyError, OSError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print("error: " + "; ".join(str(msg).splitlines()), file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
