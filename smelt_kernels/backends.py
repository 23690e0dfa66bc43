"""Backend discovery and selection shared by every smelt op.

Backends:

* ``"torch"``  -- the pure-torch reference (:mod:`smelt_kernels.reference`); always there.
* ``"cpu"``    -- fast CPU paths (native C++ from ``smelt_kernels._cpu`` where built).
* ``"triton"`` -- Triton kernels: CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``.
* ``"cuda"``   -- hand-written CUDA kernels from the optional ``smelt_kernels._cuda`` extension.

``None`` / ``"auto"`` picks the best backend available for the input's device, in the
op's order of preference. Asking for a backend that is not available raises
:class:`BackendUnavailableError` with the reason. The native extensions are imported
behind a guard: without them everything imports and falls back.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Callable, Optional, Sequence

import torch

__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "extension",
    "extension_error",
    "triton_interpret",
    "unavailable_reason",
    "resolve",
    "report",
]

BACKENDS = ("torch", "cpu", "triton", "cuda")
logger = logging.getLogger("smelt")


class BackendUnavailableError(RuntimeError):
    """A requested backend cannot run here (not built, wrong device, no Triton...)."""


_EXT_CACHE: dict[str, object] = {}
_EXT_ERRORS: dict[str, str] = {}


def extension(name: str):
    """The native extension ``smelt_kernels.<name>`` (``"_cpu"`` or ``"_cuda"``), or None."""
    if name in _EXT_CACHE:
        return _EXT_CACHE[name]
    try:
        mod = importlib.import_module(f"smelt_kernels.{name}")
    except Exception as e:  # ImportError, or an undefined symbol from a stale build
        mod = None
        _EXT_ERRORS[name] = (
            f"smelt_kernels.{name} is not built or failed to load ({type(e).__name__}: {e}); "
            "reinstall with `pip install --no-build-isolation -e .` on a machine that can build it"
        )
    _EXT_CACHE[name] = mod
    return mod


def extension_error(name: str) -> Optional[str]:
    """Why :func:`extension` returned None, or None if it loaded."""
    extension(name)
    return _EXT_ERRORS.get(name)


def triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_TRITON_ERROR: list[Optional[str]] = []


def _triton_import_error() -> Optional[str]:
    if not _TRITON_ERROR:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401

            _TRITON_ERROR.append(None)
        except Exception as e:
            _TRITON_ERROR.append(f"triton is not importable ({type(e).__name__}: {e})")
    return _TRITON_ERROR[0]


def _device(device) -> torch.device:
    return device if isinstance(device, torch.device) else torch.device(device)


def unavailable_reason(backend: str, device, extra: Optional[Callable[[torch.device], Optional[str]]] = None) -> Optional[str]:
    """None if ``backend`` can run on ``device``; otherwise why it cannot.

    ``extra`` is an op-specific check (for example "the extension lacks this op").
    """
    dev = _device(device)
    if backend not in BACKENDS:
        return f"unknown backend {backend!r}; choose one of {BACKENDS} or None"
    reason: Optional[str] = None
    if backend == "torch":
        reason = None
    elif backend == "cpu":
        if dev.type != "cpu":
            reason = f"the 'cpu' backend runs on CPU tensors, got device {dev}"
    elif backend == "triton":
        reason = _triton_import_error()
        if reason is None and dev.type == "cpu" and not triton_interpret():
            reason = "Triton on CPU tensors needs TRITON_INTERPRET=1 (the interpreter)"
        elif reason is None and dev.type not in ("cpu", "cuda"):
            reason = f"Triton kernels need CUDA tensors, got device {dev}"
    elif backend == "cuda":
        if dev.type != "cuda":
            reason = f"the 'cuda' backend needs CUDA tensors, got device {dev}"
        elif extension("_cuda") is None:
            reason = extension_error("_cuda")
    if reason is None and extra is not None:
        reason = extra(dev)
    return reason


_REPORTED: set[tuple[str, str, str]] = set()


def resolve(
    op: str,
    backend: Optional[str],
    device,
    preference: dict[str, Sequence[str]],
    checks: Optional[dict[str, Callable[[torch.device], Optional[str]]]] = None,
) -> str:
    """Choose the backend for ``op`` on ``device``.

    ``preference`` maps a device type to the op's backends in order of preference (the
    last should be ``"torch"``); ``checks`` adds op-specific availability checks.
    An explicit ``backend`` that is unavailable raises :class:`BackendUnavailableError`.
    """
    dev = _device(device)
    checks = checks or {}
    supported = sorted({b for order in preference.values() for b in order} | {"torch"})
    if backend is not None and backend != "auto":
        if not isinstance(backend, str) or backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, 'auto' or None; got {backend!r}")
        if backend not in supported:
            raise BackendUnavailableError(f"{op}: no {backend!r} implementation (has {supported})")
        reason = unavailable_reason(backend, dev, checks.get(backend))
        if reason is not None:
            raise BackendUnavailableError(f"{op}: backend {backend!r} is unavailable: {reason}")
        return backend
    order = preference.get(dev.type, ("torch",))
    skipped = []
    for name in order:
        reason = unavailable_reason(name, dev, checks.get(name))
        if reason is None:
            key = (op, dev.type, name)
            if skipped and key not in _REPORTED and not torch.compiler.is_compiling():
                _REPORTED.add(key)
                logger.info("%s on %s uses backend %r (%s)", op, dev.type, name, "; ".join(skipped))
            return name
        skipped.append(f"{name}: {reason}")
    return "torch"


def report(device="cpu") -> dict[str, Optional[str]]:
    """Availability of every backend on ``device``: name -> None (available) or the reason."""
    return {b: unavailable_reason(b, device) for b in BACKENDS}


# Probe the optional pieces once, at import, so that backend selection inside a
# torch.compile'd region is a plain lookup (dynamo does not trace imports).
for _name in ("_cpu", "_cuda"):
    extension(_name)
_triton_import_error()


def can_read_values(t: "torch.Tensor") -> bool:
    """Whether an op may read ``t``'s values on the host before launching: not while
    ``torch.compile`` traces or a CUDA graph is being captured (both would break on the read)."""
    import torch

    if torch.compiler.is_compiling():
        return False
    if t.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    return t.device.type != "meta"


def check_values_flag(op: str, check_values) -> None:
    """``check_values`` must be None (check where the values can be read) or a bool."""
    if check_values is not None and not isinstance(check_values, bool):
        raise TypeError(f"{op}: check_values must be None or a bool, got {type(check_values).__name__}")
