"""One training run: a model, AdamW with warm-up and cosine decay, packed batches, evaluation,
logs and checkpoints.

:class:`Trainer` advances one optimizer step per :meth:`Trainer.step` call, so a caller can
interleave two runs (``--arch both``, ``bench/time_to_loss.py``) and both see the same
machine load. The data order depends only on the seed and the step: optimizer step ``s``
takes global rows ``s*R .. (s+1)*R - 1`` of the per-epoch permutations of the packed
contexts (R contexts per step), so two runs with the same seed see the same data, and a run
resumed at step ``s`` continues with exactly the rows an uninterrupted run would take.

Under ``torch.distributed`` the step's R rows form micro-batches of ``batch_size`` rows;
micro-batch ``m`` runs on rank ``m % world``. Each micro-batch's mean loss is weighted by its
share of the step's valid targets, so the gradient is that of the mean over the whole step,
whatever the world size.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from .. import budget
from ..config import ModelConfig
from ..model import valid_targets as model_valid_targets
from . import checkpoint
from .data import Packed, epoch_order

__all__ = ["RunSpec", "Trainer", "valid_targets", "ENDPOINT_COLUMNS"]

ENDPOINT_COLUMNS = ("arch", "F", "S", "D", "loss", "step", "seconds", "C")
#: RunSpec fields a resumed run may change (they do not change the trajectory)
_FREE = ("eval_every", "save_every", "eval_tokens", "keep")


@dataclass
class RunSpec:
    """Everything that fixes a run's trajectory (saved as ``run.json``)."""

    arch: str
    config: dict
    seed: int
    data: str
    tokenizer: str
    seq_len: int
    val_fraction: float
    tokens_per_step: int
    batch_size: int
    steps: int
    lr: float
    weight_decay: float
    warmup_steps: int
    min_lr_ratio: float
    grad_clip: float
    dtype: str
    recompute: str
    eval_every: int
    save_every: int
    eval_tokens: int
    keep: int = 2

    def differences(self, other: "RunSpec") -> list[str]:
        a, b = asdict(self), asdict(other)
        return [k for k in a if k not in _FREE and a[k] != b.get(k)]


def valid_targets(segment_ids, labels) -> int:
    """How many targets the model's loss counts in these rows (numpy arrays or tensors):
    :func:`smelt_model.model.valid_targets`, the rule ``SmeltLM.lm_loss`` applies."""
    return int(model_valid_targets(torch.as_tensor(labels), torch.as_tensor(segment_ids)).sum())


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _all_reduce(values: list[float], device) -> list[float]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


class Trainer:
    """Train ``spec`` on ``train``/``val`` contexts, writing into ``out``.

    ``resume``: continue from the newest checkpoint in ``out`` (``ValueError`` when its
    ``run.json`` differs from ``spec``). ``backend``/``device`` go to the model.
    """

    def __init__(self, spec: RunSpec, train: Packed, val: Optional[Packed], out: Path, *,
                 backend: str = "auto", device: str = "cpu", resume: bool = False):
        from ..model import SmeltLM

        self.spec, self.train_data, self.val_data = spec, train, val
        self.out = Path(out)
        self.rank, self.world = _rank_world()
        self.device = torch.device(device)
        self.cfg = ModelConfig.from_dict(spec.config)
        rows = spec.tokens_per_step // spec.seq_len
        self.rows_per_step = rows
        self.accum = rows // (spec.batch_size * self.world)
        if rows * spec.seq_len != spec.tokens_per_step or self.accum * spec.batch_size * \
                self.world != rows or self.accum < 1:
            raise ValueError(
                f"--tokens-per-step ({spec.tokens_per_step}) must be a multiple of --seq-len "
                f"x --batch-size x world size ({spec.seq_len} x {spec.batch_size} x "
                f"{self.world})")
        self.ledger = budget.ledger(self.cfg, mean_doc_len=train.mean_doc_len,
                                    seq_len=spec.seq_len)
        self.flops_per_token = self.ledger.flops_per_token

        torch.manual_seed(spec.seed)
        model = SmeltLM(self.cfg, backend=backend, recompute=spec.recompute).to(self.device)
        if self.world > 1:
            from ..parallel import shard

            shard(model)
        self.model = model
        decay = [p for p in model.parameters() if p.ndim >= 2]
        other = [p for p in model.parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": spec.weight_decay},
             {"params": other, "weight_decay": 0.0}], lr=spec.lr, betas=(0.9, 0.95))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.step_count = 0
        self.seconds = 0.0
        self.last_val: Optional[float] = None
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
        self._check_run_file(resume)
        if resume:
            self._resume()
        elif self.rank == 0:
            for f in ("log.jsonl", "endpoints.csv"):
                (self.out / f).unlink(missing_ok=True)
            self._write_endpoint_header()

    # ------------------------------------------------------------------ schedule and data
    def _lr_factor(self, step: int) -> float:
        s = self.spec
        if step < s.warmup_steps:
            return (step + 1) / s.warmup_steps
        span = max(1, s.steps - s.warmup_steps)
        progress = min(1.0, (step - s.warmup_steps) / span)
        return s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

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
            idx[done:done + take] = epoch_order(n, self.spec.seed, epoch)[pos:pos + take]
            done += take
        return idx

    def _tensors(self, data: Packed, rows: np.ndarray):
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a[rows])).to(self.device)
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
        for a in range(self.accum):
            m = a * self.world + self.rank
            ids, seg, labels = self._tensors(d, rows[m * b:(m + 1) * b])
            n = valid_targets(seg.cpu().numpy(), labels.cpu().numpy())
            with self._autocast():
                out = self.model(ids, seg, labels=labels)
            weight = n / max(n_total, 1) * self.world
            objective = out.loss * weight
            if out.aux_loss is not None:
                objective = objective + out.aux_loss / self.accum
                aux_sum += float(out.aux_loss.detach())
            objective.backward()
            loss_sum += float(out.loss.detach()) * n
        clip = s.grad_clip if s.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        loss_sum, aux_sum = _all_reduce([loss_sum, aux_sum], self.device)
        self.seconds += time.perf_counter() - t0
        self.step_count += 1
        rec = {"arch": s.arch, "step": self.step_count, "tokens": self.tokens,
               "flops": self.flops, "seconds": self.seconds, "loss": loss_sum / max(n_total, 1),
               "aux_loss": aux_sum / (self.accum * self.world) if aux_sum else None,
               "lr": lr, "grad_norm": float(norm)}
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
        n_rows -= n_rows % self.world
        if n_rows == 0:
            return None
        self.model.eval()
        mine = np.arange(self.rank, n_rows, self.world)
        ce, count = 0.0, 0
        for i in range(0, len(mine), b):
            ids, seg, labels = self._tensors(v, mine[i:i + b])
            n = valid_targets(seg.cpu().numpy(), labels.cpu().numpy())
            with self._autocast():
                out = self.model(ids, seg, labels=labels)
            ce += float(out.loss) * n
            count += n
        ce, count = _all_reduce([ce, float(count)], self.device)
        self.last_val = ce / max(count, 1)
        rec = {"arch": self.spec.arch, "step": self.step_count, "tokens": self.tokens,
               "flops": self.flops, "seconds": self.seconds, "val_loss": self.last_val}
        self._log(rec)
        if self.rank == 0 and self.tokens > 0:  # the scaling fit needs D > 0
            row = [self.spec.arch, repr(self.flops_per_token), repr(self.ledger.sparsity),
                   str(self.tokens), repr(self.last_val), str(self.step_count),
                   f"{self.seconds:.6f}", repr(self.flops)]
            with open(self.out / "endpoints.csv", "a") as fh:
                fh.write(",".join(row) + "\n")
        return rec

    # ------------------------------------------------------------------ files
    def _log(self, rec: dict[str, Any]) -> None:
        if self.rank == 0:
            with open(self.out / "log.jsonl", "a") as fh:
                fh.write(json.dumps(rec) + "\n")

    def _write_endpoint_header(self) -> None:
        (self.out / "endpoints.csv").write_text(",".join(ENDPOINT_COLUMNS) + "\n")

    def _check_run_file(self, resume: bool) -> None:
        path = self.out / "run.json"
        if not resume:
            if path.exists():
                raise ValueError(f"--out {self.out} already holds a run; pass --resume to "
                                 "continue it or choose another --out")
            _barrier()  # every rank has looked before rank 0 writes
            if self.rank == 0:
                path.write_text(json.dumps(asdict(self.spec), indent=1, sort_keys=True) + "\n")
            return
        if not path.exists():
            raise ValueError(f"--resume: {path} not found (no run to continue in --out)")
        saved = RunSpec(**json.loads(path.read_text()))
        diff = self.spec.differences(saved)
        if diff:
            raise ValueError(f"--resume: the run in {self.out} was made with a different "
                             f"setup ({', '.join(diff)} differ)")

    def state_for_checkpoint(self) -> tuple[dict, dict]:
        """(weights, optimizer state) as full, unsharded state dicts."""
        if self.world > 1:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions, get_model_state_dict, get_optimizer_state_dict)

            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            return (get_model_state_dict(self.model, options=opts),
                    get_optimizer_state_dict(self.model, self.optimizer, options=opts))
        return self.model.state_dict(), self.optimizer.state_dict()

    def save(self) -> None:
        """Write a checkpoint of the current step (all ranks call this)."""
        weights, optim = self.state_for_checkpoint()
        if self.rank != 0:
            return
        sizes = {f: (self.out / f).stat().st_size for f in ("log.jsonl", "endpoints.csv")
                 if (self.out / f).exists()}
        state = {
            "step": self.step_count, "seconds": self.seconds, "last_val": self.last_val,
            "optimizer": optim, "scheduler": self.scheduler.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                    "python": random.getstate()},
            "log_bytes": sizes,
        }
        checkpoint.save(self.out / "checkpoints", self.step_count, weights,
                        self.cfg.to_json(), state, keep=self.spec.keep)

    def _resume(self) -> None:
        ckpt = checkpoint.load_latest(self.out / "checkpoints")
        if ckpt is None:  # killed before the first checkpoint: start over
            if self.rank == 0:
                for f in ("log.jsonl", "endpoints.csv"):
                    (self.out / f).unlink(missing_ok=True)
                self._write_endpoint_header()
            return
        st = ckpt.state
        if self.world > 1:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions, set_model_state_dict, set_optimizer_state_dict)

            opts = StateDictOptions(full_state_dict=True)
            set_model_state_dict(self.model, ckpt.weights, options=opts)
            set_optimizer_state_dict(self.model, self.optimizer, st["optimizer"], options=opts)
        else:
            self.model.load_state_dict(ckpt.weights)
            self.optimizer.load_state_dict(st["optimizer"])
        self.scheduler.load_state_dict(st["scheduler"])
        torch.set_rng_state(st["rng"]["torch"])
        np.random.set_state(st["rng"]["numpy"])
        random.setstate(st["rng"]["python"])
        self.step_count, self.seconds, self.last_val = st["step"], st["seconds"], st["last_val"]
        if self.rank == 0:  # drop what the interrupted run logged after its checkpoint
            for f, size in st["log_bytes"].items():
                path = self.out / f
                if path.exists() and path.stat().st_size > size:
                    os.truncate(path, size)
