"""The compatibility shims this torchtitan / torch pair needs, each named and explained.

torchtitan 0.3.0 pins a torch nightly newer than torch 2.13, and assumes an accelerator.
:func:`apply` installs, before torchtitan's trainer is imported, only the shims that the
running process needs (each checks its own condition), and returns their names:

``cpu_device``
    With no accelerator, torchtitan picks ``"cuda"`` as its device type and fails at
    ``torch.cuda.set_device``. The shim makes it ``"cpu"`` (its process groups then use
    gloo) and gives it a device module with the memory statistics its metrics read
    (zeros on the CPU). Needed when no accelerator is available.
``gloo_sum_reduction``
    torchtitan turns FSDP's gradient division off (``gradient_divide_factor=1.0``; the
    loss is already divided by the global token count), which FSDP runs as a
    ``PREMUL_SUM`` reduce-scatter that gloo does not implement. The shim also sets
    ``set_force_sum_reduction_for_comms(True)``: the same sum, as plain ``SUM``. Needed
    when the process group backend is gloo (a CPU run).
``no_cuda_graphs``
    torchtitan captures each step in a CUDA graph unless ``--training.disable_cuda_graphs``
    is given; without CUDA there is nothing to capture. The launcher adds the flag
    (:func:`launch_args`). Needed when no accelerator is available.
``set_timeout``
    After the first step torchtitan shortens the process-group timeouts with
    ``torch.distributed.set_timeout``, an API newer than torch 2.13. The shim aliases it
    to ``distributed_c10d._set_pg_timeout`` (what that API wraps). Needed when
    ``torch.distributed`` has no ``set_timeout``.
``partial_dtensor``
    torchtitan's default ``spmd_types`` backend wants every parameter on the full SPMD
    mesh before FSDP, which fails with torch 2.13 ("all parameters must be DTensors on
    the full SPMD mesh"); ``--parallelism.spmd_backend partial_dtensor`` is torchtitan's
    DTensor path. The launcher adds the flag (:func:`launch_args`) unless one is given.
    Needed with torch older than 2.14.

``no_cuda_graphs`` and ``partial_dtensor`` are command-line flags, not patches. smelt's
own configs (:mod:`smelt_model.titan.config_registry`, :func:`config_defaults`) set both
values themselves, and also turn CUDA graphs off on GPUs: torchtitan refuses to capture a
step whose expert-parallel dispatcher syncs with the host, as its all-to-all one does (a
stock model under expert parallelism needs ``--training.disable_cuda_graphs`` too).
"""

from __future__ import annotations

import types
from typing import Any

__all__ = ["apply", "config_defaults", "launch_args", "needed", "SHIMS"]

SHIMS = ("cpu_device", "gloo_sum_reduction", "no_cuda_graphs", "set_timeout", "partial_dtensor")
_applied: list[str] = []


def _accelerator_present() -> bool:
    from torch._utils import _get_available_device_type

    return _get_available_device_type() is not None


def needed() -> list[str]:
    """The shims this process needs (see the module docstring)."""
    import torch.distributed as dist

    out = []
    if not _accelerator_present():
        out += ["cpu_device", "gloo_sum_reduction", "no_cuda_graphs"]
    if not hasattr(dist, "set_timeout"):
        out.append("set_timeout")
    if _torch_older_than(2, 14):
        out.append("partial_dtensor")
    return out


def _torch_older_than(major: int, minor: int) -> bool:
    import torch

    parts = torch.__version__.split("+")[0].split(".")
    return (int(parts[0]), int(parts[1])) < (major, minor)


def _cpu_device_module() -> types.ModuleType:
    """``torch.cpu`` plus the device-module calls torchtitan's metrics make (zeros)."""
    import torch

    mod = types.ModuleType("smelt_cpu_device")
    for name in (
        "device_count",
        "current_device",
        "synchronize",
        "set_device",
        "is_available",
        "Stream",
        "stream",
        "current_stream",
    ):
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


def _total_memory() -> int:
    try:
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


def _shim_cpu_device() -> None:
    import torchtitan.tools.utils as tt_utils

    tt_utils.device_type = "cpu"
    tt_utils.device_module = _cpu_device_module()


def _shim_gloo_sum_reduction() -> None:
    import torchtitan.distributed.fsdp as tt_fsdp
    from torch.distributed._composable.fsdp import FSDPModule

    stock = tt_fsdp.disable_fsdp_gradient_division

    def disable_division_with_sum(model: Any) -> None:
        stock(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    tt_fsdp.disable_fsdp_gradient_division = disable_division_with_sum


def _shim_set_timeout() -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    def set_timeout(timeout, group=None):
        distributed_c10d._set_pg_timeout(timeout, group)

    dist.set_timeout = set_timeout


_INSTALL = {
    "cpu_device": _shim_cpu_device,
    "gloo_sum_reduction": _shim_gloo_sum_reduction,
    "no_cuda_graphs": lambda: None,
    "set_timeout": _shim_set_timeout,
    "partial_dtensor": lambda: None,
}

_FLAGS = {
    "no_cuda_graphs": (
        (
            "--training.disable_cuda_graphs",
            "--training.no-disable-cuda-graphs",
            "--training.no_disable_cuda_graphs",
            "--training.disable-cuda-graphs",
        ),
        ["--training.disable_cuda_graphs"],
    ),
    "partial_dtensor": (
        ("--parallelism.spmd_backend", "--parallelism.spmd-backend"),
        ["--parallelism.spmd_backend", "partial_dtensor"],
    ),
}


def launch_args(args: list[str]) -> list[str]:
    """``args`` plus the command-line shims this process needs (``no_cuda_graphs``,
    ``partial_dtensor``), each unless the command line sets that option itself."""
    out = list(args)
    for name in needed():
        if name in _FLAGS:
            given, flag = _FLAGS[name]
            if not any(a.startswith(given) for a in args):
                out += flag
    return out


def apply() -> list[str]:
    """Install the shims this process needs (once) and return their names.

    Must run before ``torchtitan.trainer`` (or any torchtitan module that reads the
    device type at import) is imported.
    """
    for name in needed():
        if name not in _applied:
            _INSTALL[name]()
            _applied.append(name)
    return list(_applied)


def config_defaults(config: Any) -> Any:
    """Set the two config values this pair needs on a ``Trainer.Config`` (see above)."""
    config.parallelism.spmd_backend = "partial_dtensor"
    config.training.disable_cuda_graphs = True
    return config
