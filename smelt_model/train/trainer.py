"""One training run on one process (CPU or one GPU): a model, AdamW with warm-up and cosine
decay, packed batches, evaluation, logs and checkpoints.

:class:`Trainer` advances one optimizer step per :meth:`Trainer.step` call, so a caller can
interleave two runs (``--arch both``, ``bench/time_to_loss.py``) and both see the same
machine load. The data order depends only on the seed and the step: optimizer step ``s``
takes global rows ``s*R .. (s+1)*R - 1`` of the per-epoch permutations of the packed
contexts (R contexts per step), so two runs with the same seed see the same data, and a run
resumed at step ``s`` continues with exactly the rows an uninterrupted run would take.

The step's R rows form micro-batches of ``batch_size`` rows (gradient accumulation); each
micro-batch's mean loss is weighted by its share of the step's valid targets, so the
gradient is that of the mean over the whole step, whatever the micro-batch size. The
learning rate follows :func:`lr_factor`, torchtitan's warm-up and cosine schedule, so a
preset's recipe (:func:`smelt_model.presets.recipe`) trains alike here and on torchtitan.
Runs on several processes go through :mod:`smelt_model.titan`.

``run.json`` records everything that fixes the trajectory (:class:`RunSpec`, including the
thread count and the kernel backend); a resumed run is compared with it before any model is
built. Resuming never starts a run over: without a checkpoint that loads it stops with one
line and leaves the run's files as they are.
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from smelt_model import budget
from smelt_model.budget import memory
from smelt_model.config import ModelConfig
from smelt_model.data.corpus import Packed, epoch_order
from smelt_model.model import SmeltLM
from smelt_model.model import valid_targets as model_valid_targets
from smelt_model.train import checkpoint
from smelt_model.train.runspec import RunSpec, compare, read_run_file

__all__ = [
    "RunSpec",
    "Trainer",
    "lr_factor",
    "valid_targets",
    "ENDPOINT_COLUMNS",
    "read_run_file",
    "check_memory",
    "LOGS",
    "adamw",
]

ENDPOINT_COLUMNS = ("arch", "F", "S", "D", "loss", "step", "seconds", "C")
#: the run's log files (appended to; a checkpoint records their lengths)
LOGS = ("log.jsonl", "endpoints.csv")


def _combined(parts: dict[str, dict[str, int]]) -> dict[str, int]:
    """Peak bytes of models trained one optimizer step at a time in one process: weights
    and optimizer state of all of them, the step's transients of the largest, one runtime."""
    keep = ("weights", "optimizer")
    out = {k: sum(p[k] for p in parts.values()) for k in keep}
    transient = max(
        parts.values(), key=lambda p: sum(v for k, v in p.items() if k not in keep + ("runtime",))
    )
    out.update({k: v for k, v in transient.items() if k not in keep})
    return out


def check_memory(
    cfgs: dict[str, ModelConfig],
    *,
    batch_size: int,
    seq_len: int,
    dtype: str,
    device: str = "cpu",
    what: str = "this run",
    available: Optional[int] = None,
) -> dict[str, int]:
    """The estimated peak bytes of training ``cfgs`` together in one process
    (:mod:`smelt_model.budget.memory`), refused with
    :class:`~smelt_model.budget.memory.MemoryRefusal`
    (one line) when it does not fit. ``available``: bytes to compare with (default
    :func:`smelt_model.budget.memory.available` of ``device``).
    """
    act = 2 if dtype == "bf16" else 4
    parts = {}
    for arch, cfg in cfgs.items():
        p = memory.estimate(
            cfg,
            tokens=batch_size * seq_len,
            seq_len=seq_len,
            train=True,
            param_bytes=4,
            act_bytes=act,
        )
        parts[arch] = p
    total = _combined(parts)
    dev = torch.device(device)
    name = " + ".join(cfgs)
    where = "this machine" if dev.type == "cpu" else str(dev)
    if available is None:
        available = memory.available(dev)
    memory.check(
        {name: total},
        available,
        what=what,
        where=where,
        hint="use a smaller model, a smaller --batch-size (--tokens-per-step stays "
        "the same, by accumulation) or --dtype bf16",
    )
    return total


def valid_targets(segment_ids, labels) -> int:
    """How many targets the model's loss counts in these rows (numpy arrays or tensors):
    :func:`smelt_model.model.valid_targets`, the rule ``SmeltLM.lm_loss`` applies."""
    return int(model_valid_targets(torch.as_tensor(labels), torch.as_tensor(segment_ids)).sum())


@functools.lru_cache(maxsize=2)
def _epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """:func:`~smelt_model.data.corpus.epoch_order`, read-only and drawn once: every step of
    an epoch, and both models of a pair, take their rows from the same permutation."""
    order = epoch_order(n, seed, epoch)
    order.flags.writeable = False
    return order


def _fused_devices() -> tuple[str, ...]:
    # torch lists the device types its fused optimizers have kernels for in a private helper;
    # without it (another torch), CUDA only, which every torch since 2.0 fuses
    listed = getattr(torch.utils._foreach_utils, "_get_fused_kernels_supported_devices", None)
    return tuple(listed()) if listed is not None else ("cuda",)


def adamw(params, **kwargs) -> torch.optim.AdamW:
    """torch's AdamW over ``params`` (tensors or parameter groups), fused (one kernel over
    every parameter) where the installed torch fuses it for their device (the CPU and CUDA
    since torch 2.4), else torch's default form. The trainer and the main job build both
    models' optimizers through it; ``optimizer.param_groups[0]["fused"]`` says which ran."""
    params = list(params)
    first = params[0]["params"][0] if isinstance(params[0], dict) else params[0]
    fused = first.device.type in _fused_devices()
    return torch.optim.AdamW(params, fused=fused or None, **kwargs)


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, min_lr_factor: float) -> float:
    """The learning rate of optimizer step ``step`` (0-based) as a fraction of the peak:
    torchtitan's ``LRSchedulersContainer`` with ``decay_type="cosine"`` (the schedule of
    every :class:`smelt_model.presets.Recipe`), over a run of ``total_steps``.

    A linear warm-up ``(step + 1) / warmup_steps`` (a warm-up longer than the run is cut
    to it), the peak at ``step == warmup_steps``, then a cosine from 1 down towards
    ``min_lr_factor``, reached one step past the run. Steps from ``total_steps`` on (a run
    extended with ``--steps``) keep ``min_lr_factor``."""
    if step >= total_steps:
        return min_lr_factor
    warmup = min(warmup_steps, total_steps)
    if step < warmup:
        return (step + 1) / warmup
    if step == warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_factor + (1 - min_lr_factor) * cosine  # torchtitan's order of operations


class Trainer:
    """Train ``spec`` on ``train``/``val`` contexts, writing into ``out``.

    ``resume``: continue from the newest checkpoint in ``out`` that loads. ``run.json`` is
    compared with ``spec`` before the model is built: a different recipe is a
    ``ValueError``; another ``threads`` or ``backend`` too, unless ``allow_nonbitwise``
    (then a warning: the continued run is no longer bitwise equal to an uninterrupted one).
    A larger ``spec.steps`` extends the run. No checkpoint that loads is a ``ValueError``
    naming what was tried; the run's files are then left untouched. ``backend`` (default
    the spec's) and ``device`` go to the model; ``init``: weights to start from (a
    ``SmeltLM`` state dict of the spec's model, e.g. a ``save_pretrained`` folder's) instead
    of the seed's draw; ``warn`` receives one-line warnings (default: stderr).
    """

    def __init__(
        self,
        spec: RunSpec,
        train: Packed,
        val: Optional[Packed],
        out: Path,
        *,
        backend: Optional[str] = None,
        device: str = "cpu",
        resume: bool = False,
        allow_nonbitwise: bool = False,
        init: Optional[dict[str, torch.Tensor]] = None,
        warn: Optional[Callable[[str], None]] = None,
    ):
        if backend is not None and backend != spec.backend:
            spec = replace(spec, backend=backend)
        self.spec, self.train_data, self.val_data = spec, train, val
        self.out = Path(out)
        self.warn = warn if warn is not None else self._warn
        self.left_alone: set[Path] = set()  # step_* entries --keep did not write, said once
        self.device = torch.device(device)
        self.cfg = ModelConfig.from_dict(spec.config)
        rows = spec.tokens_per_step // spec.seq_len
        self.rows_per_step = rows
        self.accum = rows // spec.batch_size
        if (
            rows * spec.seq_len != spec.tokens_per_step
            or self.accum * spec.batch_size != rows
            or self.accum < 1
        ):
            raise ValueError(
                f"--tokens-per-step ({spec.tokens_per_step}) must be a multiple of --seq-len "
                f"x --batch-size ({spec.seq_len} x {spec.batch_size})"
            )
        self.ledger = budget.ledger(self.cfg, mean_doc_len=train.mean_doc_len, seq_len=spec.seq_len)
        self.flops_per_token = self.ledger.flops_per_token
        # compare with the run on disk before anything large is built
        saved = self._check_run_file(resume, allow_nonbitwise)

        torch.manual_seed(spec.seed)
        model = SmeltLM(self.cfg, backend=spec.backend, recompute=spec.recompute)
        if init is not None and not resume:
            model.load_state_dict(_fitting(init, model, "the initial weights"))
        self.model = model = model.to(self.device)
        decay = [p for p in model.parameters() if p.ndim >= 2]
        other = [p for p in model.parameters() if p.ndim < 2]
        self.optimizer = adamw(
            [
                {"params": decay, "weight_decay": spec.weight_decay},
                {"params": other, "weight_decay": 0.0},
            ],
            lr=spec.lr,
            betas=(0.9, 0.95),
        )
        schedule = functools.partial(
            lr_factor,
            warmup_steps=spec.warmup_steps,
            total_steps=spec.schedule_steps,
            min_lr_factor=spec.min_lr_ratio,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)
        self.step_count = 0
        self.seconds = 0.0
        self.last_val: Optional[float] = None
        if resume:
            self._resume(saved)
            return
        self.out.mkdir(parents=True, exist_ok=True)
        self._write_run_file()
        for f in LOGS:
            (self.out / f).unlink(missing_ok=True)
        self._write_endpoint_header()

    @staticmethod
    def _warn(message: str) -> None:
        print(f"warning: {message}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ schedule and data
    def step_rows(self, step: int) -> np.ndarray:
        """Indices of the contexts optimizer step ``step`` (0-based) trains on."""
        n = len(self.train_data)
        first = step * self.rows_per_step
        idx = np.empty(self.rows_per_step, dtype=np.int64)
        done = 0
        while done < self.rows_per_step:
            g = first + done
            epoch, pos = divmod(g, n)
            take = min(self.rows_per_step - done, n - pos)
            idx[done : done + take] = _epoch_order(n, self.spec.seed, epoch)[pos : pos + take]
            done += take
        return idx

    def _tensors(self, data: Packed, rows: np.ndarray):
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a[rows])).long().to(self.device)
        return t(data.input_ids), t(data.segment_ids), t(data.labels)

    def _autocast(self):
        if self.spec.dtype == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    @property
    def done(self) -> bool:
        return self.step_count >= self.spec.steps

    @property
    def tokens(self) -> int:
        return self.step_count * self.spec.tokens_per_step

    @property
    def flops(self) -> float:
        return self.tokens * self.flops_per_token

    # ------------------------------------------------------------------ training
    def step(self) -> dict[str, Any]:
        """One optimizer step; returns (and logs) its record."""
        s, b = self.spec, self.spec.batch_size
        rows = self.step_rows(self.step_count)
        d = self.train_data
        n_total = valid_targets(d.segment_ids[rows], d.labels[rows])
        self.model.train()
        t0 = time.perf_counter()
        loss_sum, aux_sum = 0.0, 0.0
        for m in range(self.accum):
            ids, seg, labels = self._tensors(d, rows[m * b : (m + 1) * b])
            n = valid_targets(seg.cpu().numpy(), labels.cpu().numpy())
            with self._autocast():
                out = self.model(ids, seg, labels=labels)
            objective = out.loss * (n / max(n_total, 1))
            if out.aux_loss is not None:
                objective = objective + out.aux_loss / self.accum
                aux_sum += float(out.aux_loss.detach())
            objective.backward()
            loss_sum += float(out.loss.detach()) * n
        clip = s.grad_clip if s.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.seconds += time.perf_counter() - t0
        self.step_count += 1
        rec = {
            "arch": s.arch,
            "step": self.step_count,
            "tokens": self.tokens,
            "flops": self.flops,
            "seconds": self.seconds,
            "loss": loss_sum / max(n_total, 1),
            "aux_loss": aux_sum / self.accum if aux_sum else None,
            "lr": lr,
            "grad_norm": float(norm),
        }
        self._log(rec)
        checkpoint.crash_point("step", self.step_count)
        return rec

    @torch.no_grad()
    def evaluate(self) -> Optional[dict[str, Any]]:
        """Validation loss over up to ``eval_tokens`` tokens of the validation contexts."""
        v = self.val_data
        if v is None or len(v) == 0:
            return None
        b = self.spec.batch_size
        n_rows = min(len(v), max(1, self.spec.eval_tokens // self.spec.seq_len))
        self.model.eval()
        rows = np.arange(n_rows)
        ce, count = 0.0, 0
        for i in range(0, n_rows, b):
            ids, seg, labels = self._tensors(v, rows[i : i + b])
            n = valid_targets(seg.cpu().numpy(), labels.cpu().numpy())
            with self._autocast():
                out = self.model(ids, seg, labels=labels)
            ce += float(out.loss) * n
            count += n
        self.last_val = ce / max(count, 1)
        rec = {
            "arch": self.spec.arch,
            "step": self.step_count,
            "tokens": self.tokens,
            "flops": self.flops,
            "seconds": self.seconds,
            "val_loss": self.last_val,
        }
        self._log(rec)
        if self.tokens > 0:  # the scaling fit needs D > 0
            row = [
                self.spec.arch,
                repr(self.flops_per_token),
                repr(self.ledger.sparsity),
                str(self.tokens),
                repr(self.last_val),
                str(self.step_count),
                f"{self.seconds:.6f}",
                repr(self.flops),
            ]
            with open(self.out / "endpoints.csv", "a") as fh:
                fh.write(",".join(row) + "\n")
        return rec

    # ------------------------------------------------------------------ files
    def _log(self, rec: dict[str, Any]) -> None:
        with open(self.out / "log.jsonl", "a") as fh:
            fh.write(json.dumps(rec) + "\n")

    def _write_endpoint_header(self) -> None:
        (self.out / "endpoints.csv").write_text(",".join(ENDPOINT_COLUMNS) + "\n")

    def _write_run_file(self) -> None:
        path, tmp = self.out / "run.json", self.out / ".run.json.tmp"
        tmp.write_text(json.dumps(asdict(self.spec), indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)

    def _check_run_file(self, resume: bool, allow_nonbitwise: bool) -> Optional[RunSpec]:
        """Refuse a new run over an old one, or a resume whose recipe differs from
        ``run.json``; returns the saved spec when resuming."""
        path = self.out / "run.json"
        if not resume:
            if path.exists():
                raise ValueError(
                    f"--out {self.out} already holds a run; pass --resume to "
                    "continue it or choose another --out"
                )
            return None
        saved = read_run_file(path)
        note = compare(asdict(self.spec), saved, self.out, allow_nonbitwise)
        if note:
            self.warn(note)
        return saved

    def _check_logs(self, ckpt: checkpoint.Checkpoint) -> dict[str, int]:
        """The logs' lengths at the checkpoint, after checking that each log holds at least
        that much and parses; ``ValueError`` naming the file otherwise."""
        sizes = ckpt.state["log_bytes"]
        for f, size in sizes.items():
            path = self.out / f
            if f not in LOGS or size < 0:
                raise ValueError(f"{ckpt.path / checkpoint.STATE_JSON}: names an unknown log {f!r}")
            have = path.stat().st_size if path.is_file() else None
            if have is None or have < size:
                raise ValueError(
                    f"{path}: {'missing' if have is None else f'{have} bytes'}, but the "
                    f"checkpoint at step {ckpt.step} recorded {size}: the log was cut or "
                    "replaced (restore it, or start a new run)"
                )
            with open(path, "rb") as fh:
                head = fh.read(size)
            try:
                lines = head.decode("utf-8").splitlines()
                if f == "log.jsonl":
                    for line in lines:
                        if not isinstance(json.loads(line), dict):
                            raise ValueError("a line is not a JSON object")
                elif (lines and lines[0] != ",".join(ENDPOINT_COLUMNS)) or any(
                    len(line.split(",")) != len(ENDPOINT_COLUMNS) for line in lines[1:]
                ):
                    raise ValueError(f"expected the columns {','.join(ENDPOINT_COLUMNS)}")
            except (UnicodeDecodeError, ValueError, RecursionError) as e:
                raise ValueError(f"{path}: not a valid log ({str(e).splitlines()[0]})") from None
        return sizes

    def save(self) -> None:
        """Write a checkpoint of the current step."""
        weights, optim = self.model.state_dict(), self.optimizer.state_dict()
        sizes = {f: (self.out / f).stat().st_size for f in LOGS if (self.out / f).exists()}
        state = {
            "step": self.step_count,
            "seconds": self.seconds,
            "last_val": self.last_val,
            "optimizer": optim,
            "scheduler": self.scheduler.state_dict(),
            "rng": {
                "torch": torch.get_rng_state(),
                "numpy": np.random.get_state(),
                "python": random.getstate(),
            },
            "log_bytes": sizes,
        }
        checkpoint.save(
            self.out / "checkpoints",
            self.step_count,
            weights,
            self.cfg.to_json(),
            state,
            keep=self.spec.keep,
            on_leave=self._leave,
        )

    def _leave(self, path: Path, why: str) -> None:
        if path not in self.left_alone:
            self.left_alone.add(path)
            self.warn(f"{path}: left alone by --keep, not a checkpoint of this run ({why})")

    def _resume(self, saved: RunSpec) -> None:
        """Continue from the newest checkpoint that loads; every check comes before the
        first change to the run's files."""
        folder = self.out / "checkpoints"
        skipped = lambda path, why: self.warn(f"checkpoint {path} not loaded ({why})")
        try:
            ckpt = checkpoint.load_latest(folder, on_skip=skipped)
        except checkpoint.NoCheckpoint as e:
            raise ValueError(f"--resume: {e}; the run's files are left as they are") from None
        if ckpt is None:
            raise ValueError(
                f"--resume: {self.out} holds no checkpoint (the run stopped before its first, "
                f"every {saved.save_every} steps); nothing was changed: start again with "
                "another --out, or remove the run folder"
            )
        if self.spec.steps < ckpt.step:
            raise ValueError(
                f"--resume: the run is at step {ckpt.step}, past the {self.spec.steps} "
                "steps asked for: give --steps (or --tokens / --budget-flops) of "
                f"at least {ckpt.step}"
            )
        sizes = self._check_logs(ckpt)
        self._load(ckpt)
        self.step_count, self.seconds, self.last_val = (
            ckpt.step,
            float(ckpt.state["seconds"]),
            ckpt.state["last_val"],
        )
        for f, size in sizes.items():  # drop what the interrupted run logged after its checkpoint
            if (self.out / f).stat().st_size > size:
                os.truncate(self.out / f, size)
        if self.spec.steps != saved.steps:
            self._write_run_file()
            tail = ""
            if self.spec.steps > self.spec.schedule_steps:
                tail = (
                    f"; steps past {self.spec.schedule_steps} keep the schedule's final "
                    f"learning rate ({self.spec.min_lr_ratio * self.spec.lr:g})"
                )
            self.warn(
                f"{self.out}: the run now stops at step {self.spec.steps} "
                f"(it was {saved.steps}){tail}"
            )

    def _load(self, ckpt: checkpoint.Checkpoint) -> None:
        """Put the checkpoint's weights, optimizer, scheduler and RNG states in place."""
        st = ckpt.state
        weights = _fitting(ckpt.weights, self.model, ckpt.path / checkpoint.WEIGHTS)
        ckpt.check_fits(self.model, self.optimizer, self.scheduler)
        try:
            self.model.load_state_dict(weights)
            # the optimizer's numbers come from the checkpoint, its kernel (fused or not,
            # which load_state_dict would take from the saved groups) from this process
            kernel = [(g["fused"], g["foreach"]) for g in self.optimizer.param_groups]
            self.optimizer.load_state_dict(st["optimizer"])
            for g, (fused, foreach) in zip(self.optimizer.param_groups, kernel):
                g["fused"], g["foreach"] = fused, foreach
            self.scheduler.load_state_dict(st["scheduler"])
            rng = st["rng"]
            torch.set_rng_state(rng["torch"])
            np.random.set_state(rng["numpy"])
            random.setstate(rng["python"])
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(
                f"{ckpt.path / checkpoint.STATE_JSON}: does not fit the run ({first})"
            ) from None


def _fitting(weights: dict, model: torch.nn.Module, where) -> dict:
    """``weights`` when they are ``model``'s state dict in names and shapes, else a
    ``ValueError`` naming ``where`` and the first tensor that differs."""
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    have = {k: tuple(v.shape) for k, v in weights.items()}
    if want != have:
        odd = sorted(set(want) ^ set(have)) or [k for k in want if want[k] != have[k]]
        raise ValueError(
            f"{where}: does not fit the run's model ({len(odd)} tensor(s) differ, e.g. {odd[0]})"
        )
    return weights
