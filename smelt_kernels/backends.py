"""The one backend registry of every smelt op.

Backends:

* ``"torch"``  -- the pure-torch reference of the op (``<feature>/reference.py``); always there.
* ``"cpu"``    -- fast CPU paths (native C++ from ``smelt_kernels._cpu`` where built).
* ``"triton"`` -- Triton kernels: CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``.
* ``"cuda"``   -- hand-written CUDA kernels from the optional ``smelt_kernels._cuda`` extension.

Each op registers its implementations here (:func:`register`): the op name, the backend
name, the forward and backward callables, and what the implementation can take -- device
types, dtypes, a check of what the extension provides (``requires``) and a check of the
inputs (``supports``: head dims, shapes...). The op then asks :func:`select` for the
implementation to run and calls it. ``None`` / ``"auto"`` resolution, the fallback and its
log line (once per op, device and choice, on the ``smelt`` logger) and every "cannot run"
error live in :func:`select`, and nowhere else:

* an unknown backend name: ``ValueError``;
* a backend the op has no implementation for, or one that cannot run here (not built,
  wrong device, no Triton): :class:`BackendUnavailableError`, with the reason;
* a dtype the implementation does not take: ``TypeError``;
* inputs outside what it supports (``supports`` says why): ``ValueError``.

The native extensions are imported behind a guard: without them everything imports and
the registry reports why they are missing (:func:`report`).
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "Implementation",
    "register",
    "implementation",
    "implementations",
    "registered_ops",
    "select",
    "backward_of",
    "backward_impl",
    "lazy",
    "report",
    "extension",
    "extension_error",
    "extension_op_missing",
    "register_native_fake",
    "needs_grad",
    "triton_interpret",
    "unavailable_reason",
    "can_read_values",
    "require_tensor",
    "require_floating",
    "require_device",
    "check_values_flag",
]

BACKENDS = ("torch", "cpu", "triton", "cuda")
logger = logging.getLogger("smelt")

#: the modules whose import registers the shipped ops (loaded by :func:`report`)
OP_MODULES = ("smelt_kernels.moe_gemm", "smelt_kernels.attention")


class BackendUnavailableError(RuntimeError):
    """A requested backend cannot run here (not built, wrong device, no Triton...)."""


# ----------------------------------------------------------------------------- optional pieces
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


def extension_op_missing(name: str, op: str, source: str) -> Optional[str]:
    """None if extension ``name`` loaded and registered ``torch.ops.<lib>.<op>``, else why not.

    ``source`` names the file that defines the op (for the message)."""
    if extension(name) is None:
        return extension_error(name)
    lib = {"_cpu": "smelt_cpu", "_cuda": "smelt_cuda"}[name]
    if not hasattr(getattr(torch.ops, lib), op):
        return f"smelt_kernels.{name} was built without {source} (no {lib}.{op})"
    return None


def register_native_fake(name: str, op: str, fake) -> bool:
    """Register ``fake`` as the fake (meta) kernel of native op ``torch.ops.<lib>.<op>`` of
    extension ``name`` when it is built, so that ``torch.compile`` can trace a direct call to
    it (what the no-gradient paths make, skipping the Python custom op). True if registered."""
    if extension_op_missing(name, op, "") is not None:
        return False
    lib = {"_cpu": "smelt_cpu", "_cuda": "smelt_cuda"}[name]
    torch.library.register_fake(f"{lib}::{op}", fake)
    return True


def needs_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd will record a call on ``tensors`` (grad mode on and one requires it)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_TRITON_ERROR: list[Optional[str]] = []


def _triton_import_error() -> Optional[str]:
    if not _TRITON_ERROR:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401  (the interpreter and compiler live there)

            _TRITON_ERROR.append(None)
        except Exception as e:
            _TRITON_ERROR.append(f"triton is not importable ({type(e).__name__}: {e})")
    return _TRITON_ERROR[0]


def _device(device) -> torch.device:
    return device if isinstance(device, torch.device) else torch.device(device)


def unavailable_reason(backend: str, device) -> Optional[str]:
    """None if the backend family ``backend`` can run on ``device`` at all; otherwise why not.

    This is the device-level check every implementation of that backend shares; what an
    op's implementation needs beyond it is its ``requires`` check."""
    dev = _device(device)
    if backend not in BACKENDS:
        return f"unknown backend {backend!r}; choose one of {BACKENDS} or None"
    if backend == "cpu" and dev.type != "cpu":
        return f"the 'cpu' backend runs on CPU tensors, got device {dev}"
    if backend == "triton":
        reason = _triton_import_error()
        if reason is None and dev.type == "cpu" and not triton_interpret():
            reason = "Triton on CPU tensors needs TRITON_INTERPRET=1 (the interpreter)"
        elif reason is None and dev.type not in ("cpu", "cuda"):
            reason = f"Triton kernels need CUDA tensors, got device {dev}"
        return reason
    if backend == "cuda":
        if dev.type != "cuda":
            return f"the 'cuda' backend needs CUDA tensors, got device {dev}"
        if extension("_cuda") is None:
            return extension_error("_cuda")
    return None


def lazy(module: str, attr: str) -> Callable[..., Any]:
    """A callable that imports ``module`` on first use and calls its ``attr``: lets an op
    register a Triton implementation without importing Triton."""
    target: list[Callable[..., Any]] = []

    def call(*args, **kwargs):
        if not target:
            target.append(getattr(importlib.import_module(module), attr))
        return target[0](*args, **kwargs)

    call.__name__ = call.__qualname__ = f"{module}.{attr}"
    return call


# ----------------------------------------------------------------------------- the registry
@dataclass(frozen=True)
class Implementation:
    """One backend's implementation of one op, and what it can take.

    ``forward`` / ``backward``: the callables the op runs (their signatures are the op's
    business). ``backward_via``: when ``backward`` is None, the backends of the same op whose
    backward this one borrows, first available wins (a forward-only CUDA kernel uses the
    Triton backward). ``devices``: device types it runs on; ``auto``: device types where
    ``None``/``"auto"`` may pick it (default: ``devices``), in descending ``priority``.
    ``dtypes``: the floating dtypes it takes (None: any). ``requires(device)`` and
    ``supports(**features)`` return None or the reason it cannot run / cannot take them.
    ``infer``: an optional entry point for calls that autograd does not record (no output is
    differentiated), which skips the op's Python custom op; it returns None for inputs it
    does not take, and the op then runs as usual.
    """

    op: str
    backend: str
    forward: Callable[..., Any]
    backward: Optional[Callable[..., Any]] = None
    backward_via: tuple[str, ...] = ()
    devices: Optional[tuple[str, ...]] = ("cpu", "cuda")
    auto: Optional[tuple[str, ...]] = None
    priority: int = 0
    dtypes: Optional[tuple[torch.dtype, ...]] = None
    requires: Optional[Callable[[torch.device], Optional[str]]] = None
    supports: Optional[Callable[..., Optional[str]]] = None
    info: dict[str, Any] = field(default_factory=dict)
    infer: Optional[Callable[..., Any]] = None

    def unavailable(self, device) -> Optional[str]:
        """None if this implementation can run on ``device``, else why not."""
        dev = _device(device)
        if self.devices is not None and dev.type not in self.devices:
            return (f"{self.op}: backend {self.backend!r} runs on {'/'.join(self.devices)} "
                    f"tensors, got device {dev}")
        reason = unavailable_reason(self.backend, dev)
        if reason is None and self.requires is not None:
            reason = self.requires(dev)
        return reason

    def dtype_reason(self, dtype: Optional[torch.dtype]) -> Optional[str]:
        if dtype is None or self.dtypes is None or dtype in self.dtypes:
            return None
        names = [str(d).replace("torch.", "") for d in self.dtypes]
        listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
        return f"backend {self.backend!r} takes {listed}, got {str(dtype).replace('torch.', '')}"

    def feature_reason(self, features: dict[str, Any]) -> Optional[str]:
        if self.supports is None or not features:
            return None
        return self.supports(**features)


_REGISTRY: dict[str, dict[str, Implementation]] = {}
_REPORTED: set[tuple[str, str, str]] = set()


def register(op: str, backend: str, forward: Callable[..., Any],
             backward: Optional[Callable[..., Any]] = None, *,
             backward_via: Sequence[str] = (), devices: Optional[Sequence[str]] = ("cpu", "cuda"),
             auto: Optional[Sequence[str]] = None, priority: int = 0,
             dtypes: Optional[Sequence[torch.dtype]] = None,
             requires: Optional[Callable[[torch.device], Optional[str]]] = None,
             supports: Optional[Callable[..., Optional[str]]] = None,
             infer: Optional[Callable[..., Any]] = None,
             replace: bool = False, **info: Any) -> Implementation:
    """Register ``backend``'s implementation of ``op`` (see :class:`Implementation`).

    Registering the same (op, backend) twice is an error unless ``replace=True`` (for
    experiments: a user's own kernel under an existing name)."""
    if backend not in BACKENDS:
        raise ValueError(f"register: backend must be one of {BACKENDS}, got {backend!r}")
    if backward is not None and backward_via:
        raise ValueError("register: give backward or backward_via, not both")
    impls = _REGISTRY.setdefault(op, {})
    if backend in impls and not replace:
        raise ValueError(f"register: {op!r} already has a {backend!r} implementation")
    impl = Implementation(op, backend, forward, backward, tuple(backward_via),
                          None if devices is None else tuple(devices),
                          None if auto is None else tuple(auto), priority,
                          None if dtypes is None else tuple(dtypes), requires, supports,
                          dict(info), infer)
    impls[backend] = impl
    return impl


def registered_ops() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def implementations(op: str) -> tuple[Implementation, ...]:
    """Every registered implementation of ``op``, in ``auto`` order (priority first)."""
    if op not in _REGISTRY:
        raise ValueError(f"no op {op!r} is registered (registered: {', '.join(_REGISTRY)})")
    return tuple(sorted(_REGISTRY[op].values(), key=lambda i: (-i.priority, i.backend)))


def implementation(op: str, backend: str) -> Implementation:
    """The registered implementation of ``op`` by ``backend`` (no availability check)."""
    impls = _REGISTRY.get(op, {})
    if backend not in impls:
        raise BackendUnavailableError(
            f"{op}: no {backend!r} implementation (has {sorted(impls)})")
    return impls[backend]


def _check_name(backend) -> None:
    if backend is not None and (not isinstance(backend, str)
                                or backend not in BACKENDS + ("auto",)):
        raise ValueError(f"backend must be one of {BACKENDS}, 'auto' or None; got {backend!r}")


def select(op: str, backend: Optional[str] = None, *, device, dtype: Optional[torch.dtype] = None,
           **features: Any) -> Implementation:
    """The implementation of ``op`` to run for inputs on ``device`` of ``dtype`` with
    ``features`` (what the implementations' ``supports`` checks read, e.g. ``head_dim``).

    ``backend`` None or ``"auto"``: the highest-priority implementation that can run and
    take the inputs; a fallback past a preferred one is logged once with the reasons.
    An explicit backend is returned or refused with the error its failure calls for (see
    the module docstring)."""
    _check_name(backend)
    dev = _device(device)
    if backend is not None and backend != "auto":
        impl = implementation(op, backend)
        reason = impl.unavailable(dev)
        if reason is not None:
            raise BackendUnavailableError(f"{op}: backend {backend!r} is unavailable: {reason}")
        reason = impl.dtype_reason(dtype)
        if reason is not None:
            raise TypeError(f"{op}: {reason}")
        reason = impl.feature_reason(features)
        if reason is not None:
            raise ValueError(f"{op}: {reason}")
        return impl
    skipped = []
    for impl in implementations(op):
        auto = impl.auto if impl.auto is not None else impl.devices
        if auto is not None and dev.type not in auto:
            continue
        reason = (impl.unavailable(dev) or impl.dtype_reason(dtype)
                  or impl.feature_reason(features))
        if reason is None:
            key = (op, dev.type, impl.backend)
            if skipped and key not in _REPORTED and not torch.compiler.is_compiling():
                _REPORTED.add(key)
                logger.info("%s on %s uses backend %r (%s)", op, dev.type, impl.backend,
                            "; ".join(skipped))
            return impl
        skipped.append(f"{impl.backend}: {reason}")
    raise BackendUnavailableError(
        f"{op}: no backend can run these inputs on {dev} ({'; '.join(skipped) or 'none registered'})")


def backward_impl(impl: Implementation, device) -> Implementation:
    """The implementation whose backward runs for a forward run by ``impl``: ``impl`` itself
    when it has one, else the first available backend of its ``backward_via``."""
    if impl.backward is not None:
        return impl
    reasons = []
    for name in impl.backward_via:
        other = implementation(impl.op, name)
        reason = other.unavailable(device)
        if reason is None:
            return backward_impl(other, device)
        reasons.append(f"{name}: {reason}")
    raise BackendUnavailableError(
        f"{impl.op}: backend {impl.backend!r} has no backward here ({'; '.join(reasons) or 'none registered'})")


def backward_of(impl: Implementation, device) -> Callable[..., Any]:
    """The backward callable for a forward run by ``impl`` (see :func:`backward_impl`)."""
    return backward_impl(impl, device).backward


def report(device="cpu") -> dict[str, dict[str, Optional[str]]]:
    """For every registered op and each of its backends: None (can run on ``device``) or the
    reason it cannot. Loads the shipped op modules first, so their registrations count."""
    for mod in OP_MODULES:
        importlib.import_module(mod)
    return {op: {impl.backend: impl.unavailable(device) for impl in implementations(op)}
            for op in _REGISTRY}


# ----------------------------------------------------------------------------- value checks
def can_read_values(t: torch.Tensor) -> bool:
    """Whether an op may read ``t``'s values on the host before launching: not while
    ``torch.compile`` traces or a CUDA graph is being captured (both would break on the read)."""
    if torch.compiler.is_compiling():
        return False
    if t.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    return t.device.type != "meta"


def require_tensor(op: str, name: str, value, what: str = "a torch.Tensor") -> None:
    """A non-tensor argument is a ``TypeError`` naming it, in every op."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: {name} must be {what}, got {type(value).__name__}")


def require_floating(op: str, first: str, tensor: torch.Tensor, **same: torch.Tensor) -> None:
    """``tensor`` (argument ``first``) floating point and every ``same`` of its dtype, else a
    ``TypeError`` naming the argument."""
    if not tensor.dtype.is_floating_point:
        raise TypeError(f"{op}: {first} must be floating point, got {tensor.dtype}")
    for name, t in same.items():
        if t.dtype != tensor.dtype:
            raise TypeError(f"{op}: {name} must have {first}'s dtype {tensor.dtype}, got {t.dtype}")


def require_device(op: str, first: str, tensor: torch.Tensor, **same: Optional[torch.Tensor]) -> None:
    """Every ``same`` (None skipped) on ``tensor``'s device, else a ``ValueError``."""
    for name, t in same.items():
        if t is not None and t.device != tensor.device:
            raise ValueError(f"{op}: {name} is on {t.device} but {first} is on {tensor.device}")


def check_values_flag(op: str, check_values) -> None:
    """``check_values`` must be None (check where the values can be read) or a bool."""
    if check_values is not None and not isinstance(check_values, bool):
        raise TypeError(f"{op}: check_values must be None or a bool, got {type(check_values).__name__}")


# Probe the optional pieces once, at import, so that backend selection inside a
# torch.compile'd region is a plain lookup (dynamo does not trace imports).
for _name in ("_cpu", "_cuda"):
    extension(_name)
_triton_import_error()
