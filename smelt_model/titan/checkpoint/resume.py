"""torchtitan's checkpoint load, checked: what a checkpoint holds must fit the run before the
run takes it, and a newest checkpoint that does not load gives way to the one before.

:func:`checked_load` stands in for ``CheckpointManager._load`` (torchtitan 0.3.0) when the
launcher runs (:mod:`smelt_model.titan.patches`, ``checked_resume``). A resume from the
run's own ``checkpoint/step-N`` folders tries them newest first; for each:

1. the folder itself (:func:`precheck`): its DCP metadata, storage files and byte ranges
   (:mod:`smelt_model.checkpoint.dcp`), and the model's tensors against what it stores:
   a SMELT checkpoint of another preset names both presets; a missing or resized tensor
   is named;
2. torchtitan's own load of the step, with every stateful component (train state,
   optimizer, learning-rate scheduler, dataloader) held back: what DCP read is checked
   against the run's own state (:mod:`smelt_model.checkpoint.fit`), the step against the
   folder's name, the scheduler against the step, the data position against what that
   many steps can have consumed (so a crafted position cannot make the resume spin), and a
   dataloader's pickled position is read by :func:`~smelt_model.checkpoint.dcp.restricted_loads`;
3. only when every rank agrees that all of it fits are the components given their state.

A folder that fails is passed over with a one-line warning naming it and why, and the next
older one is tried; when none loads the run stops with one
:class:`~smelt_model.checkpoint.CheckpointError` listing each, and leaves the folders as they
are. ``--checkpoint.load_step N`` and ``--checkpoint.initial_load_path`` are checked the
same way, without a fall-back.
"""

from __future__ import annotations

import contextlib
import json
import re
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torchtitan.components.checkpointer import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    TRAIN_STATE,
)
from torchtitan.components.checkpointer.dcp import CheckpointManager
from torchtitan.tools.logging import logger

from smelt_model.checkpoint import CheckpointError, dcp, fit
from smelt_model.config import IGNORE_INDEX, ModelConfig
from smelt_model.titan.checkpoint.state_dict import arch_from_config_json, describe, read_config

__all__ = ["checked_load", "precheck", "step_folders", "thread_check", "STOCK_LOAD", "THREADS_FILE"]

#: torchtitan's own ``CheckpointManager._load``
STOCK_LOAD = CheckpointManager._load
_STEP = re.compile(r"step-(\d{1,18})")
#: the components whose state is held back until it is checked, in DCP's (sorted) order
_HELD = (DATALOADER, LR_SCHEDULER, OPTIMIZER, TRAIN_STATE)
#: errors that mean "this checkpoint does not fit or is damaged" (anything else is a bug)
_USER_ERRORS = (ValueError, TypeError, KeyError, OSError, EOFError)


def step_folders(folder: str) -> list[tuple[int, Path]]:
    """``(N, path)`` of every ``step-N`` DCP folder (one with a ``.metadata``) in
    ``folder``, newest first."""
    root = Path(folder)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        m = _STEP.fullmatch(path.name)
        if m and path.is_dir() and (path / dcp.METADATA).is_file():
            found.append((int(m.group(1)), path))
    return sorted(found, reverse=True)


# ----------------------------------------------------------------------------- step 1
def _run_config(model_sd: dict) -> Optional[ModelConfig]:
    buf = model_sd.get("config_json")
    return arch_from_config_json(buf.detach().cpu()) if isinstance(buf, torch.Tensor) else None


def precheck(manager: Any, path: Path, hf: bool = False, states: tuple[str, ...] = ()) -> None:
    """:class:`CheckpointError` unless the folder ``path`` can hold the run's model and
    has an entry for each of the training ``states`` to load (see the module docstring,
    step 1)."""
    model_sd = manager.states[MODEL].state_dict()
    mine = _run_config(model_sd)
    if hf:  # a SmeltLM save_pretrained folder: its config.json against the run's
        if mine is not None and (path / "config.json").is_file():
            try:
                theirs = ModelConfig.from_json(path / "config.json")
            except (ValueError, TypeError, KeyError, OSError) as e:
                raise CheckpointError(f"{path / 'config.json'}: not a model config ({e})") from None
            if theirs != mine:
                raise CheckpointError(
                    f"{path}: holds {describe(theirs)}, but this run is {describe(mine)}"
                )
        return
    meta = dcp.read_metadata(path)
    entries = meta.state_dict_metadata
    if mine is not None:
        if "config_json" not in entries:
            raise CheckpointError(
                f"{path}: holds no SMELT model (no config_json); this run is {describe(mine)}"
            )
        theirs = read_config(path, meta)
        if theirs != mine:
            raise CheckpointError(
                f"{path}: holds {describe(theirs)}, but this run is {describe(mine)}"
            )
    missing, odd = [], []
    for key, value in model_sd.items():
        if not isinstance(value, torch.Tensor):
            continue
        entry = entries.get(key)
        if not isinstance(entry, TensorStorageMetadata):
            missing.append(key)
        elif tuple(entry.size) != tuple(value.shape):
            odd.append((key, tuple(entry.size), tuple(value.shape)))
    if missing:
        raise CheckpointError(
            f"{path}: lacks {len(missing)} of the model's tensors (first: {missing[0]})"
        )
    if odd:
        key, stored, want = odd[0]
        raise CheckpointError(
            f"{path}: {len(odd)} tensors do not fit the model, e.g. {key}: stored {stored}, "
            f"the model's {want}"
        )
    absent = [k for k in states if not any(e.startswith(k + ".") for e in entries)]
    if absent:
        raise CheckpointError(
            f"{path}: holds the model only, no {', '.join(absent)} state (torchtitan saves "
            "a run's last step so unless --checkpoint.no-last-save-model-only is given): a "
            "run cannot resume from it"
        )


def _states(manager: Any) -> tuple[str, ...]:
    """The training states a full load reads (those the run has and does not exclude)."""
    skip = set(getattr(manager, "exclude_from_loading", ()) or ())
    return tuple(k for k in _HELD if manager.states.get(k) is not None and k not in skip)


# ----------------------------------------------------------------------------- step 2
class _Held:
    """A component whose loaded state is kept, not applied (DCP sees a ``Stateful``)."""

    def __init__(self, real: Any, key: str, held: dict):
        self.real, self.key, self.held = real, key, held

    def state_dict(self) -> dict:
        return self.real.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.held[self.key] = state


@contextlib.contextmanager
def _holding(manager: Any, held: dict):
    saved = dict(manager.states)
    for key in _HELD:
        if manager.states.get(key) is not None:
            manager.states[key] = _Held(manager.states[key], key, held)
    try:
        yield
    finally:
        manager.states.clear()
        manager.states.update(saved)


#: a stock dataloader's token buffers: ids of the model's vocabulary (labels may be ignored)
TOKEN_KEYS = {"inputs_buffer": False, "pending_input_ids": False}
TOKEN_KEYS.update({"labels_buffer": True, "pending_label_ids": True})
#: a stock dataloader's indices, which cannot be negative
INDEX_KEYS = ("sample_idx", "epoch")


def _tokens(value: Any, vocab: Optional[int], ignore_ok: bool, where: str, label: str) -> None:
    """Every id of a token buffer in ``[0, vocab)`` (or the ignored label)."""
    if vocab is None or not isinstance(value, list):
        return
    for token in value:
        if not isinstance(token, int) or isinstance(token, bool):
            continue
        if not (0 <= token < vocab or (ignore_ok and token == IGNORE_INDEX)):
            raise CheckpointError(
                f"{where}: the data position {label} holds token {token}, outside the "
                f"model's vocabulary of {vocab}"
            )


def _bound(
    state: Any, batches: int, samples: int, where: str, name: str, vocab: Optional[int] = None
) -> None:
    """A data position's counters within what ``batches`` steps' batches (``batches``,
    smelt's) or their ``samples`` (``*yielded``, torchdata's) can be; a stock dataloader's
    indices not negative and its token buffers within the model's ``vocab``."""
    if isinstance(state, dict):
        for key, value in state.items():
            label = f"{name}.{key}"
            limit = batches if key == "batches" else samples
            counter = key == "batches" or (isinstance(key, str) and key.endswith("yielded"))
            if counter and isinstance(value, int) and not 0 <= value <= limit:
                raise CheckpointError(
                    f"{where}: the data position {label} = {value} is beyond the {limit} "
                    "that the checkpoint's steps can have consumed"
                )
            if key in INDEX_KEYS and isinstance(value, int) and value < 0:
                raise CheckpointError(f"{where}: the data position {label} = {value} is negative")
            if key in TOKEN_KEYS:
                _tokens(value, vocab, TOKEN_KEYS[key], where, label)
            _bound(value, batches, samples, where, label, vocab)


def _vocabulary(trainer: Any) -> Optional[int]:
    """The rows of the model's token embedding (what a token id indexes), or None."""
    for part in getattr(trainer, "model_parts", None) or ():
        for module in part.modules():
            if isinstance(module, torch.nn.Embedding):
                return int(module.num_embeddings)
    return None


def _check_held(manager: Any, held: dict, step: Optional[int], where: str) -> None:
    """Step 2's checks of the held states (module docstring)."""
    states = {k: v.real if isinstance(v, _Held) else v for k, v in manager.states.items()}
    trainer = states.get(TRAIN_STATE)
    got_step = None
    if TRAIN_STATE in held and trainer is not None:
        fit.check_like(held[TRAIN_STATE], trainer.state_dict(), where, "train_state")
        got_step = held[TRAIN_STATE]["step"]
        if got_step < 0 or (step is not None and got_step != step):
            raise CheckpointError(
                f"{where}: train_state.step is {got_step}, its folder is step-{step}"
            )
    if LR_SCHEDULER in held:
        live = states[LR_SCHEDULER].state_dict()
        fit.check_like(held[LR_SCHEDULER], live, where, "lr_scheduler")
        epoch = held[LR_SCHEDULER].get("last_epoch")
        if got_step is not None and epoch != got_step:
            raise CheckpointError(
                f"{where}: lr_scheduler.last_epoch is {epoch}, the checkpoint's step {got_step}"
            )
    if OPTIMIZER in held:
        fit.check_like(held[OPTIMIZER], states[OPTIMIZER].state_dict(), where, "optimizer")
    if DATALOADER in held:
        loader = states[DATALOADER]
        state = held[DATALOADER]
        fit.check_like(state, loader.state_dict(), where, "dataloader")
        decoded = {
            k: dcp.restricted_loads(v, f"{where}: the entry dataloader.{k}")
            if isinstance(v, (bytes, bytearray))
            else v
            for k, v in state.items()
        }
        world = getattr(loader, "dp_world_size", None)
        if world is not None and state.get("world_size", world) != world:
            raise CheckpointError(
                f"{where}: the data position is for {state.get('world_size')} data-parallel "
                f"ranks, this run has {world}"
            )
        if got_step is not None and trainer is not None:
            batches = got_step * trainer.gradient_accumulation_steps
            samples = batches * max(trainer.config.training.local_batch_size, 1)
            _bound(decoded, batches, samples, where, "dataloader", _vocabulary(trainer))


def _give(manager: Any, held: dict) -> None:
    """Step 3: the components take their checked states, in the order DCP loads them."""
    with warnings.catch_warnings():  # torchtitan's scheduler load calls get_lr() itself
        warnings.filterwarnings("ignore", message="To get the last learning rate")
        for key in sorted(held):
            manager.states[key].load_state_dict(held[key])


def _agree(problem: Optional[str]) -> Optional[str]:
    """The first rank's problem, on every rank (so that all take the same way)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return problem
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, problem)
    return next((p for p in every if p is not None), None)


def _problem(e: BaseException) -> Optional[str]:
    cause = dcp.first_failure(e)
    if isinstance(cause, _USER_ERRORS):
        return " ".join(str(cause).split()) or type(cause).__name__
    return None


def _attempt(manager: Any, step: int, path: Path) -> tuple[Optional[str], bool]:
    """Load ``step`` (its folder ``path``) by the module's rule: (the problem or None,
    whether DCP read any of it into the model)."""
    problem = None
    try:
        precheck(manager, path, states=() if step == 0 else _states(manager))
    except CheckpointError as e:
        problem = str(e)
    problem = _agree(problem)
    if problem is not None:
        return problem, False
    held: dict = {}
    try:
        with _holding(manager, held):
            STOCK_LOAD(manager, step=step)
            _check_held(manager, held, step, str(path))
    except (Exception, CheckpointException) as e:
        problem = _problem(e)
        if problem is None:
            raise
        if not problem.startswith(str(path)):
            problem = f"{path}: {problem}"
    problem = _agree(problem)
    if problem is None:
        _give(manager, held)
    return problem, True


# ----------------------------------------------------------------------------- the patch
#: beside a run's step folders: the threads per process of the run that started it
THREADS_FILE = "smelt_threads.json"


def thread_check(folder: Path, resuming: bool, threads: int, rank: int = 0) -> Optional[str]:
    """A fresh run records ``threads`` (per process) in ``folder`` (rank 0 writes); a resume
    compares its own count with the record. Returns the line to warn with when a resume
    runs at another count (its losses then agree to about 1e-5, not bitwise: the CPU's
    reductions depend on the thread count), or when the record cannot be read; else None."""
    record = folder / THREADS_FILE
    if not resuming:
        if rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
            record.write_text(json.dumps({"threads_per_process": threads}) + "\n")
        return None
    if not record.is_file():
        return None  # checkpoints written before the record existed: nothing to compare
    try:
        was = json.loads(record.read_text())["threads_per_process"]
        if isinstance(was, bool) or not isinstance(was, int):
            raise TypeError(was)
    except (OSError, ValueError, KeyError, TypeError):
        return f"{record}: unreadable, the thread count of the run is not checked"
    if was == threads:
        return None
    return (
        f"resuming at {threads} threads per process a run started at {was} ({record}): the "
        f"losses agree with an uninterrupted run to about 1e-5, not exactly; set "
        f"OMP_NUM_THREADS={was} for an exact resume"
    )


def checked_load(manager: Any, step: int = -1) -> bool:
    """``CheckpointManager._load`` by the module's rule; True when something was loaded."""
    resuming = step != -1 or bool(step_folders(manager.folder))
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    note = thread_check(Path(manager.folder), resuming, torch.get_num_threads(), rank)
    if note is not None:
        logger.warning(note)
    if step != -1:
        path = Path(manager.folder) / f"step-{step}"
        if not path.is_dir():
            raise CheckpointError(f"--checkpoint.load_step {step}: no folder {path}")
        problem, _ = _attempt(manager, step, path)
        if problem is not None:
            raise CheckpointError(problem)
        return True
    candidates = step_folders(manager.folder)
    if not candidates:
        return _initial_load(manager)
    tried: list[tuple[Path, str]] = []
    read_some = False
    for n, path in candidates:
        if n == 0 and read_some:  # a model-only seed is not mixed with a partly read step
            tried.append((path, "a model-only seed, not taken after a newer step was read"))
            continue
        problem, read = _attempt(manager, n, path)
        if problem is None:
            return True
        read_some = read_some or read
        tried.append((path, problem))
        rest = [p.name for m, p in candidates if m < n]
        logger.warning(
            f"checkpoint not loaded: {problem}; "
            + (f"trying {rest[0]}" if rest else "no older checkpoint")
        )
    listing = "; ".join(f"{p.name}: {why.replace(str(p) + ': ', '')}" for p, why in tried)
    raise CheckpointError(
        f"no loadable checkpoint in {manager.folder} (tried {listing}); its folders are "
        "left as they are"
    )


def _initial_load(manager: Any) -> bool:
    """No checkpoint of the run yet: ``--checkpoint.initial_load_path`` (checked), or
    torchtitan's own choice (a fresh start, or the model's HF assets)."""
    path = manager.initial_load_path
    if not path:
        return STOCK_LOAD(manager, step=-1)
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"--checkpoint.initial_load_path {path}: no such folder")
    problem = None
    full = not (manager.initial_load_model_only or manager.initial_load_in_hf)
    try:
        precheck(manager, folder, manager.initial_load_in_hf, _states(manager) if full else ())
    except CheckpointError as e:
        problem = str(e)
    problem = _agree(problem)
    if problem is not None:
        raise CheckpointError(f"--checkpoint.initial_load_path: {problem}")
    m = _STEP.fullmatch(folder.name)
    held: dict = {}
    try:
        with _holding(manager, held):
            loaded = STOCK_LOAD(manager, step=-1)
            _check_held(manager, held, int(m.group(1)) if m else None, str(folder))
    except (Exception, CheckpointException) as e:
        problem = _problem(e)
        if problem is None:
            raise
    problem = _agree(problem)
    if problem is not None:
        raise CheckpointError(f"--checkpoint.initial_load_path {path}: {problem}")
    _give(manager, held)
    return loaded
