"""Running one or two :class:`~smelt_model.train.trainer.Trainer` s together: the data
loaded once, optimizer steps interleaved one at a time (so both models of a pair see the
same data order and the same machine load), the progress report and the pair's merged
endpoints. ``python -m smelt_model.train`` and ``bench/time_to_loss.py`` run through here.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import torch

from smelt_model import budget
from smelt_model.data.corpus import prepare
from smelt_model.train.options import (
    configs,
    default_every,
    init_weights,
    resume_checks,
    steps_for,
)
from smelt_model.train.trainer import RunSpec, Trainer

__all__ = ["build_trainers", "run_lockstep", "Progress", "merge_endpoints", "summary_line"]


def build_trainers(args, dirs: dict, device: str):
    """Load and pack the data once, and make one :class:`Trainer` per model of ``args``
    (the options of :func:`smelt_model.train.cli.parse_args`), writing into ``dirs[arch]``.
    Returns ``(trainers, corpus)``. With ``args.resume`` the runs' own tokenizer is used,
    and the warm-up and schedule length come from their ``run.json``."""
    saved, tokenizer, _ = resume_checks(args, dirs, 0)
    corpus = prepare(
        args.data, args.tokenizer, args.seq_len, args.val_fraction, args.seed, tokenizer
    )
    cfgs = configs(args, corpus.tokenizer.vocab_size)
    init = None if args.resume else init_weights(args)
    rows = args.tokens_per_step // args.seq_len
    batch = args.batch_size or rows

    trainers = []
    for arch, cfg in cfgs.items():
        fpt = budget.ledger(cfg, corpus.train.mean_doc_len, args.seq_len).flops_per_token
        steps = steps_for(args, args.tokens_per_step, fpt)
        every = args.eval_every or default_every(steps)
        old = saved.get(arch)
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
            warmup_steps=old.warmup_steps if old else args.warmup_steps,
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
            init=args.init,
        )
        trainers.append(
            Trainer(
                spec,
                corpus.train,
                corpus.val,
                dirs[arch],
                device=device,
                resume=args.resume,
                allow_nonbitwise=args.allow_nonbitwise,
                init=init,
            )
        )
        corpus.tokenizer.save(dirs[arch])
    return trainers, corpus


def run_lockstep(trainers, progress: Optional["Progress"] = None) -> None:
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
            evaluated = due(t, t.spec.eval_every)
            if evaluated:
                t.evaluate()
            if due(t, t.spec.save_every):
                t.save()
            if progress is not None:
                progress.update(t, rec, evaluated)
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


class Progress:
    """Progress on stderr. On a terminal one status line of every model, rewritten in place
    after each step; otherwise (a pipe, a log file) one line per evaluation of a model, so
    nothing is repeated."""

    def __init__(self, enabled: bool = True, stream=None):
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.last: dict[str, str] = {}

    def update(self, t, rec: dict, evaluated: bool) -> None:
        if not self.enabled:
            return
        secs = max(rec["seconds"], 1e-9)
        val = f" val {t.last_val:.3f}" if t.last_val is not None else ""
        self.last[t.spec.arch] = (
            f"{t.spec.arch} {rec['step']}/{t.spec.steps} loss {rec['loss']:.3f}{val} "
            f"{rec['tokens'] / secs:,.0f} tok/s {rec['flops'] / secs / 1e9:.2f} GFLOP/s"
        )
        if self.tty:
            line = " | ".join(self.last.values())
            print("\r" + line[:200].ljust(120), end="", file=self.stream, flush=True)
        elif evaluated:
            print(self.last[t.spec.arch], file=self.stream, flush=True)

    def close(self) -> None:
        if self.enabled and self.tty:
            print(file=self.stream)


def summary_line(t) -> str:
    """One line on a finished run: steps, tokens, FLOPs, seconds, validation loss, folder."""
    last = f"{t.last_val:.4f}" if t.last_val is not None else "n/a"
    return (
        f"{t.spec.arch}: {t.step_count} steps, {t.tokens} tokens, {t.flops:.3e} "
        f"FLOPs, {t.seconds:.1f} s, val loss {last} -> {t.out}"
    )
