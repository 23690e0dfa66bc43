"""``run.json``: the :class:`RunSpec` that fixes a run's trajectory, and its strict reader."""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Optional

from smelt_model.checkpoint.plainstate import read_json
from smelt_model.config import ModelConfig

__all__ = ["RunSpec", "read_run_file", "compare", "NONBITWISE"]

#: RunSpec fields a resumed run may change: they do not change the trajectory (``steps``
#: moves where the run stops; the learning-rate schedule follows ``schedule_steps``; the
#: initial weights are the checkpoint's)
_FREE = ("eval_every", "save_every", "eval_tokens", "keep", "steps", "init")
#: RunSpec fields that change the floating-point result but not the recipe
NONBITWISE = ("threads", "backend")


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
    #: length of the warm-up and cosine schedule (default ``steps``; see
    #: :func:`smelt_model.train.trainer.lr_factor`); steps past it keep the final learning
    #: rate, so a run extended with a larger ``steps`` continues smoothly
    schedule_steps: Optional[int] = None
    #: CPU threads of torch and the kernels (None: not recorded)
    threads: Optional[int] = None
    #: the kernel backend asked for (``--backend``)
    backend: str = "auto"
    #: the folder the initial weights came from (``--init``; None: drawn from ``seed``)
    init: Optional[str] = None

    def __post_init__(self) -> None:
        if self.schedule_steps is None:
            self.schedule_steps = self.steps

    def differences(self, other: "RunSpec") -> list[str]:
        """Fields (other than the free ones) whose values differ from ``other``'s."""
        a, b = asdict(self), asdict(other)
        return [k for k in a if k not in _FREE and a[k] != b.get(k)]


def read_run_file(path: Path) -> RunSpec:
    """The :class:`RunSpec` in a run's ``run.json``; ``ValueError`` naming the file when it
    is not one (bad JSON, unknown or missing fields, values of the wrong type)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: not found (no run to continue there)")
    d = read_json(path, "run file")
    known = {f.name: f for f in fields(RunSpec)}
    unknown = sorted(set(d) - set(known))
    missing = [n for n, f in known.items() if f.default is MISSING and n not in d]
    if unknown or missing:
        what = (
            f"unknown field(s) {', '.join(unknown)}"
            if unknown
            else f"missing field(s) {', '.join(missing)}"
        )
        raise ValueError(f"{path}: not a valid run file ({what})")
    kinds = {
        "config": dict,
        "arch": str,
        "data": str,
        "tokenizer": str,
        "dtype": str,
        "recompute": str,
        "backend": str,
        "val_fraction": (int, float),
        "lr": (int, float),
        "weight_decay": (int, float),
        "min_lr_ratio": (int, float),
        "grad_clip": (int, float),
        "threads": (int, type(None)),
        "schedule_steps": (int, type(None)),
        "init": (str, type(None)),
    }
    for name, value in d.items():
        kind = kinds.get(name, int)
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ValueError(f"{path}: not a valid run file ({name} = {value!r:.40})")
    try:
        ModelConfig.from_dict(d["config"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: its model config is not valid ({e})") from None
    return RunSpec(**d)


def compare(
    now: dict, saved: RunSpec, where: Path, allow_nonbitwise: bool = False
) -> Optional[str]:
    """Check the fields in ``now`` (a subset of a :class:`RunSpec`'s, as a dict) against the
    ``saved`` run in ``where`` before resuming it.

    A different recipe is a ``ValueError`` ("different setup"); another thread count or
    backend is one too, saying how to match it, unless ``allow_nonbitwise``: then the
    warning to print is returned (else None). Free fields (``steps``, the evaluation and
    checkpoint cadence) are not compared.
    """
    old = asdict(saved)
    diff = [k for k, v in now.items() if k not in _FREE and k in old and v != old[k]]
    recipe = [d for d in diff if d not in NONBITWISE]
    if recipe:
        raise ValueError(
            f"--resume: the run in {where} was made with a different setup "
            f"({', '.join(recipe)} differ)"
        )
    if not diff:
        return None
    was = " ".join(f"--{d} {old[d]}" for d in diff)
    asked = " ".join(f"--{d} {now[d]}" for d in diff)
    if not allow_nonbitwise:
        raise ValueError(
            f"--resume: the run in {where} was made with {was}, not {asked}; "
            "continuing would no longer be bitwise equal to an uninterrupted "
            f"run: pass {was}, or --allow-nonbitwise"
        )
    return (
        f"resuming {where} with {asked} (it was made with {was}): from here on the run "
        "is no longer bitwise equal to an uninterrupted one"
    )
