"""Every change smelt makes to torchtitan 0.3.0 and torch 2.13 from outside, in one place.

The launcher (``python -m smelt_model.titan``) calls :func:`apply` before torchtitan's
trainer is imported and :func:`launch_args` on its command line; each :class:`Patch` in
:data:`PATCHES` checks its own condition, so a process gets only the ones it needs, and the
launcher logs their names. Each entry says which versions it was written for, what those
versions do that it works around, and when it applies: on an upgrade, a patch whose
upstream behaviour is gone is deleted here and nowhere else.

Two kinds: code patches replace one upstream function or method (``install``); flag
patches add a command-line option unless the command line sets it (``flag``).
:func:`config_defaults` sets the two flag values in smelt's own configs as well.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import sys
import time
import types
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

# Every patch imports what it changes inside its own install function: the launcher applies
# the patches before torchtitan's modules load (its --help and option errors import none of
# them), and a patch for a version that is not installed imports nothing.

__all__ = ["Patch", "PATCHES", "needed", "apply", "applied", "launch_args", "config_defaults"]

TORCHTITAN = "torchtitan 0.3.0"
TORCH = "torch 2.13"


@dataclass(frozen=True)
class Patch:
    """One patch: its ``name``, the ``versions`` it was written for, the ``upstream``
    behaviour it works around, ``when`` it applies (in words, and as the ``needed``
    test), and either ``install`` (code) or ``flag`` (the options it adds, and the
    spellings of that option that leave the command line alone)."""

    name: str
    versions: str
    upstream: str
    when: str
    needed: Callable[[], bool]
    install: Optional[Callable[[], None]] = None
    flag: Optional[tuple[tuple[str, ...], tuple[str, ...]]] = None


# ----------------------------------------------------------------------------- conditions
def _no_accelerator() -> bool:
    # torch when the condition is asked, not when the list is read (the note on the imports)
    from torch._utils import _get_available_device_type

    return _get_available_device_type() is None


def _torch_older_than(major: int, minor: int) -> bool:
    # as in _no_accelerator
    import torch

    parts = torch.__version__.split("+")[0].split(".")
    return (int(parts[0]), int(parts[1])) < (major, minor)


def _always() -> bool:
    return True


_LOAD_MODEL_ONLY = (
    "--checkpoint.initial_load_model_only",
    "--checkpoint.initial-load-model-only",
    "--checkpoint.no_initial_load_model_only",
    "--checkpoint.no-initial-load-model-only",
)


def _sets(spellings: tuple[str, ...], args: Optional[list[str]] = None) -> bool:
    """Whether the command line (``args``, default this process's) sets an option."""
    return any(a.split("=", 1)[0] in spellings for a in (sys.argv[1:] if args is None else args))


# ----------------------------------------------------------------------------- the device
def _total_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


def _cpu_device_module() -> types.ModuleType:
    """``torch.cpu`` plus the device-module calls torchtitan's metrics make (no figures)."""
    # when the patch is installed (the note on the imports)
    import torch

    mod = types.ModuleType("smelt_cpu_device")
    for name in ("synchronize", "is_available", "Stream", "stream", "current_stream"):
        if hasattr(torch.cpu, name):
            setattr(mod, name, getattr(torch.cpu, name))
    mod.set_device = lambda device=None: None
    mod.device_count = lambda: 1
    mod.current_device = lambda: 0
    mod.get_device_name = lambda device=None: "cpu"
    mod.get_device_properties = lambda device=None: types.SimpleNamespace(
        name="cpu", total_memory=_total_memory()
    )
    mod.memory_stats = lambda device=None: {}
    mod.reset_peak_memory_stats = lambda device=None: None
    mod.empty_cache = lambda: None
    return mod


def _install_cpu_device() -> None:
    # what the patch changes, when it is installed (the note on the imports)
    import torchtitan.tools.utils as tt_utils

    tt_utils.device_type = "cpu"
    tt_utils.device_module = _cpu_device_module()


def _install_gloo_sum_reduction() -> None:
    # what the patch changes, when it is installed (the note on the imports)
    import torchtitan.distributed.fsdp as tt_fsdp
    from torch.distributed._composable.fsdp import FSDPModule

    stock = tt_fsdp.disable_fsdp_gradient_division

    def disable_division_with_sum(model: Any) -> None:
        stock(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    tt_fsdp.disable_fsdp_gradient_division = disable_division_with_sum


def _install_set_timeout() -> None:
    # what the patch changes, when it is installed (the note on the imports)
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    def set_timeout(timeout, group=None):
        distributed_c10d._set_pg_timeout(timeout, group)

    dist.set_timeout = set_timeout


# ----------------------------------------------------------------------------- checkpoints
def _install_safe_dcp_reader() -> None:
    # what the patch changes, when it is installed (the note on the imports)
    from torch.distributed.checkpoint import FileSystemReader

    from smelt_model.checkpoint.dcp import SafeReader  # loads torch: as above

    for name in SafeReader.METHODS:
        setattr(FileSystemReader, name, SafeReader.__dict__[name])


def _install_safe_dataloader_state() -> None:
    # what the patch changes, when it is installed (the note on the imports)
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchtitan.components.dataloader import ParallelAwareDataloader

    from smelt_model.checkpoint.dcp import restricted_loads  # loads torch: as above

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self._rank_id not in state_dict:  # upstream warns and starts over; so do we
            logging.getLogger().warning(
                f"the checkpoint has no data position for dp rank {self.dp_rank}"
            )
            return
        if state_dict.get("world_size") != self.dp_world_size:
            raise ValueError(
                f"the checkpoint's data position is for {state_dict.get('world_size')} "
                f"data-parallel ranks, this run has {self.dp_world_size}"
            )
        blob = state_dict[self._rank_id]
        state = restricted_loads(blob, f"the checkpoint entry dataloader.{self._rank_id}")
        StatefulDataLoader.load_state_dict(self, state)

    ParallelAwareDataloader.load_state_dict = load_state_dict


def _install_checked_resume() -> None:
    # what the patch changes, when it is installed (the note on the imports)
    from torchtitan.components.checkpointer.dcp import CheckpointManager

    from smelt_model.titan.checkpoint.resume import checked_load  # loads torchtitan: as above

    CheckpointManager._load = checked_load


# ----------------------------------------------------------------------------- the log
#: filters every record of the root logger's handlers goes through (each patch adds its own)
_LOG_FILTERS: list[Callable[[logging.LogRecord], bool]] = []


class _Filters(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return all(f(record) for f in _LOG_FILTERS)


def _wrap_init_logger() -> None:
    """torchtitan's ``init_logger``, then smelt's filters on the handlers it made (once)."""
    # what the patch changes, when it is installed (the note on the imports)
    import torchtitan.tools.logging as tt_logging

    if getattr(tt_logging.init_logger, "_smelt", False):
        return
    stock = tt_logging.init_logger

    def init_logger() -> None:
        stock()
        for handler in logging.getLogger().handlers:
            if not any(isinstance(f, _Filters) for f in handler.filters):
                handler.addFilter(_Filters())
        logging.captureWarnings(True)  # Python warnings follow the same rules
        names = applied()
        if names:
            logging.getLogger().info(
                f"smelt patches for {TORCHTITAN} / {TORCH}: {', '.join(names)}"
            )

    init_logger._smelt = True  # type: ignore[attr-defined]
    tt_logging.init_logger = init_logger
    if "torchtitan.train" in sys.modules:
        sys.modules["torchtitan.train"].init_logger = init_logger


def _log_ranks() -> set[int]:
    spec = os.environ.get("LOG_RANK", "0")
    try:
        return {int(r) for r in spec.split(",") if r.strip()}
    except ValueError:
        return {0}


def _install_rank0_log() -> None:
    rank = int(os.environ.get("RANK", "0"))
    shown = _log_ranks()
    _LOG_FILTERS.append(lambda r: rank in shown or r.levelno >= logging.ERROR)
    _wrap_init_logger()


_DEFAULT_WARNING = "initial_load_model_only=True has no effect without an initial_load_path"


def _install_default_load_warning() -> None:
    _LOG_FILTERS.append(lambda r: _DEFAULT_WARNING not in r.getMessage())
    _wrap_init_logger()


#: figures torchtitan computes from an accelerator, meaningless on a CPU
_CPU_FIELDS = re.compile(r"(\x1b\[[0-9;]*m)?(memory: +\S+|mfu: +\S+?)(?=\x1b|\s|$)\s*")
_CPU_LINES = (
    "Peak flops undefined",
    "Peak FLOPS used for computing MFU",
    "memory usage for model",
    "ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING]",
)


def _cpu_record(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    if any(line in message for line in _CPU_LINES):
        return False
    if "step:" in message and ("mfu:" in message or "memory:" in message):
        record.msg, record.args = _CPU_FIELDS.sub("", message).rstrip(), ()
    return True


def _install_cpu_metrics() -> None:
    # what the patch changes, when it is installed (the note on the imports)
    import torchtitan.tools.utils as tt_utils

    tt_utils.get_peak_flops = lambda device_name: float("nan")
    _LOG_FILTERS.append(_cpu_record)
    _wrap_init_logger()


# ----------------------------------------------------------------------------- the list
def _install_clip_grad_by_mesh() -> None:
    # what the patch changes, when it is installed (the note on the imports)
    from torchtitan.distributed import utils as dist_utils

    stock = dist_utils.clip_grad_norm_

    def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
        # at the first call: parallelize loads more of torchtitan, which must find every
        # patch in place
        from smelt_model.titan.parallel.parallelize import clip_grad_norm_by_mesh

        return clip_grad_norm_by_mesh(stock, *args, **kwargs)

    dist_utils.clip_grad_norm_ = clip_grad_norm_


_FINAL_SLEEP = "Sleeping 2 seconds for other ranks to complete"


def _install_end_barrier() -> None:
    # what the patch changes, when it is installed (the note on the imports): the last
    # patch, so torchtitan's trainer module finds every other one in place
    import torch.distributed as dist
    import torchtitan.trainer as tt_trainer

    stock_train = tt_trainer.Trainer.train
    names = {k: getattr(time, k) for k in dir(time) if not k.startswith("_")}
    clock = types.SimpleNamespace(**names)
    clock.sleep = lambda seconds: None  # Trainer.train's one sleep: its final 2 s on rank 0

    @functools.wraps(stock_train)
    def train(self: Any, *args: Any, **kwargs: Any) -> Any:
        module_time = tt_trainer.time
        tt_trainer.time = clock
        try:
            out = stock_train(self, *args, **kwargs)
        finally:
            tt_trainer.time = module_time
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # every rank done with the run, however long that takes
        return out

    tt_trainer.Trainer.train = train
    _LOG_FILTERS.append(lambda r: _FINAL_SLEEP not in r.getMessage())  # it no longer sleeps
    _wrap_init_logger()


PATCHES: tuple[Patch, ...] = (
    Patch(
        "cpu_device",
        TORCHTITAN,
        "with no accelerator it still picks 'cuda' as its device type and fails at "
        "torch.cuda.set_device; the patch makes it 'cpu' (gloo process groups) with a "
        "device module whose memory statistics are empty",
        "no accelerator",
        _no_accelerator,
        install=_install_cpu_device,
    ),
    Patch(
        "gloo_sum_reduction",
        TORCHTITAN,
        "it turns FSDP's gradient division off (gradient_divide_factor=1.0), which FSDP "
        "runs as a PREMUL_SUM reduce-scatter that gloo lacks; the patch also forces plain "
        "SUM reductions (the same sum)",
        "no accelerator (gloo)",
        _no_accelerator,
        install=_install_gloo_sum_reduction,
    ),
    Patch(
        "no_cuda_graphs",
        TORCHTITAN,
        "it captures each step in a CUDA graph unless told not to",
        "no accelerator",
        _no_accelerator,
        flag=(
            (
                "--training.disable_cuda_graphs",
                "--training.disable-cuda-graphs",
                "--training.no_disable_cuda_graphs",
                "--training.no-disable-cuda-graphs",
            ),
            ("--training.disable_cuda_graphs",),
        ),
    ),
    Patch(
        "set_timeout",
        f"{TORCHTITAN} on {TORCH}",
        "after the first step it calls torch.distributed.set_timeout, which torch 2.13 "
        "lacks; the patch aliases it to distributed_c10d._set_pg_timeout (what it wraps)",
        "torch.distributed has no set_timeout",
        lambda: not hasattr(__import__("torch.distributed").distributed, "set_timeout"),
        install=_install_set_timeout,
    ),
    Patch(
        "partial_dtensor",
        f"{TORCHTITAN} on {TORCH}",
        "its default spmd_types backend wants every parameter on the full SPMD mesh "
        "before FSDP, which fails with torch 2.13; partial_dtensor is its DTensor path",
        "torch older than 2.14",
        lambda: _torch_older_than(2, 14),
        flag=(
            ("--parallelism.spmd_backend", "--parallelism.spmd-backend"),
            ("--parallelism.spmd_backend", "partial_dtensor"),
        ),
    ),
    Patch(
        "safe_dcp_reader",
        TORCH,
        "DCP's FileSystemReader unpickles .metadata with pickle.load, reads storage paths "
        "as the file names them (absolute, '..'), unpickles non-tensor entries with "
        "torch.load(weights_only=False) and copies a stored tensor into one of another "
        "declared dtype; the patch gives it smelt_model.checkpoint.dcp.SafeReader's "
        "reading",
        "always (every checkpoint a launched run loads)",
        _always,
        install=_install_safe_dcp_reader,
    ),
    Patch(
        "safe_dataloader_state",
        TORCHTITAN,
        "ParallelAwareDataloader.load_state_dict pickle.loads the bytes a checkpoint "
        "keeps for its position; the patch reads them with "
        "smelt_model.checkpoint.dcp.restricted_loads",
        "always",
        _always,
        install=_install_safe_dataloader_state,
    ),
    Patch(
        "checked_resume",
        TORCHTITAN,
        "CheckpointManager._load takes any step folder and whatever state it holds (a "
        "damaged newest checkpoint stops the run; a state that does not fit crashes it "
        "later); the patch is smelt_model.titan.checkpoint.resume.checked_load",
        "always",
        _always,
        install=_install_checked_resume,
    ),
    Patch(
        "rank0_log",
        TORCHTITAN,
        "init_logger logs every line on every rank (its run_train.sh filters with "
        "torchrun's --local-ranks-filter); the patch logs on the ranks LOG_RANK lists "
        "(default 0; errors on every rank), Python warnings included",
        "always",
        _always,
        install=_install_rank0_log,
    ),
    Patch(
        "default_load_warning",
        TORCHTITAN,
        "its checkpoint config warns that initial_load_model_only=True (its own default) "
        "has no effect without an initial_load_path, whenever none is given",
        "the command line does not set --checkpoint.initial_load_model_only",
        lambda: not _sets(_LOAD_MODEL_ONLY),
        install=_install_default_load_warning,
    ),
    Patch(
        "no_color",
        TORCHTITAN,
        "it colours log lines with ANSI codes wherever the output goes",
        "standard output is not a terminal",
        lambda: not sys.stdout.isatty(),
        flag=(
            (
                "--metrics.disable_color_printing",
                "--metrics.disable-color-printing",
                "--metrics.no_disable_color_printing",
                "--metrics.no-disable-color-printing",
            ),
            ("--metrics.disable_color_printing",),
        ),
    ),
    Patch(
        "cpu_metrics",
        TORCHTITAN,
        "on a CPU it runs lspci, falls back to an A100's peak for MFU and prints memory "
        "figures from a device that has none; the patch computes no peak and leaves the "
        "mfu and memory figures out of the log",
        "no accelerator",
        _no_accelerator,
        install=_install_cpu_metrics,
    ),
    Patch(
        "clip_grad_by_mesh",
        TORCHTITAN,
        "its clip_grad_norm_ stacks the per-parameter norms of one mesh (two under expert "
        "parallelism) and fails on gradients that lie on more (experts gathered over an "
        "in-node mesh beside the data-parallel one); the patch takes each mesh's norm and "
        "combines them, and calls the stock function wherever it works (the same result)",
        "always (installed by the launcher, or by smelt's trainer config when torchtitan's "
        "own entry point runs it)",
        _always,
        install=_install_clip_grad_by_mesh,
    ),
    Patch(
        "end_barrier",
        TORCHTITAN,
        "Trainer.train ends with rank 0 sleeping 2 s 'for other ranks to complete' (a "
        "guess, paid by every run however short); the patch drops that sleep and has every "
        "rank wait for the others at a barrier instead",
        "always",
        _always,
        install=_install_end_barrier,
    ),
)

_BY_NAME = {p.name: p for p in PATCHES}
_applied: list[str] = []


def needed() -> list[str]:
    """The names of the patches this process needs, in :data:`PATCHES` order."""
    return [p.name for p in PATCHES if p.needed()]


def applied() -> list[str]:
    """The names of the patches installed in this process, and of the flag patches it
    needs (those go on the command line by :func:`launch_args`), in :data:`PATCHES` order.
    A code patch may remove its own condition (``set_timeout`` defines what it finds
    missing): once installed it stays named."""
    return [p.name for p in PATCHES if p.name in _applied or (p.flag is not None and p.needed())]


def apply() -> list[str]:
    """Install the code patches this process needs (each once) and return :func:`applied`.

    Must run before ``torchtitan.trainer`` (or any torchtitan module that reads the
    device type at import) is imported."""
    for name in needed():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            install(name)
    return applied()


def install(name: str) -> bool:
    """Install the code patch ``name`` now, once, where it is needed (what :func:`apply`
    does for all of them); whether it is installed."""
    patch = _BY_NAME[name]
    if name not in _applied and patch.install is not None and patch.needed():
        patch.install()
        _applied.append(name)
    return name in _applied


def _first_subcommand(args: list[str]) -> int:
    """Where torchtitan's first subcommand (``activation_checkpoint:full``: a config field,
    a colon, a choice; nothing else on its command line has that form) stands in ``args``,
    or ``len(args)``. Options after a subcommand are that subcommand's own, so added options
    go before it."""
    for i, arg in enumerate(args):
        if re.fullmatch(r"[a-z_]+:[a-z0-9_-]+", arg):
            return i
    return len(args)


def launch_args(args: list[str]) -> list[str]:
    """``args`` plus the options of the flag patches this process needs, each unless the
    command line sets that option itself, placed before any torchtitan subcommand."""
    added: list[str] = []
    for name in needed():
        flag = _BY_NAME[name].flag
        if flag is not None:
            given, option = flag
            if not _sets(given, args):
                added += list(option)
    at = _first_subcommand(args) if added else len(args)
    return list(args[:at]) + added + list(args[at:])


def config_defaults(config: Any) -> Any:
    """Set the values of ``partial_dtensor`` and ``no_cuda_graphs`` on a
    ``Trainer.Config`` of smelt's own (CUDA graphs stay off on GPUs too: torchtitan will
    not capture a step whose expert-parallel dispatcher syncs with the host, as its
    all-to-all one does)."""
    config.parallelism.spmd_backend = "partial_dtensor"
    config.training.disable_cuda_graphs = True
    return config
