"""The one registry of smelt's ops: what runs for a call, and why.

Backend families (:class:`Family`, one registered object each): ``"torch"`` (the pure-torch
reference of every op), ``"cpu"`` (native C++ from ``smelt_kernels._cpu``), ``"triton"``
(CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``) and ``"cuda"``
(``smelt_kernels._cuda``). Ops register their implementations (:func:`register`) with what
each takes, and may declare *variants*: choices made inside an implementation that a user
should see. :func:`define` tells the registry how to read an op's inputs.

:func:`select` (``select(op, *inputs, backend=None)``) resolves ``None``/``"auto"`` to the
highest-priority implementation that can run the inputs, logs a fallback once per op,
device and choice (``smelt`` logger), and raises every "cannot run" error: ``ValueError``
for an unknown backend name or inputs an implementation does not support, ``TypeError``
for a dtype it does not take, :class:`BackendUnavailableError` (with the reason) for a
backend that cannot run here. :func:`report` lists every op, backend and variant, and the
environment variables that change a choice (:data:`ENVIRONMENT`, read through :func:`env`
and nowhere else in Python).
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

# the argument checks every op shares (checks.py), and the backend families, extensions and
# environment variables (families.py): the ops reach them through here
from .checks import (
    can_read_values,
    check_values_flag,
    needs_grad,
    require_device,
    require_floating,
    require_tensor,
)
from .families import (
    BACKENDS,
    ENVIRONMENT,
    Family,
    Variable,
    as_device,
    check_env,
    choices,
    env,
    env_flag,
    env_problem,
    extension,
    extension_error,
    extension_op_missing,
    extensions_state,
    families,
    family,
    lazy,
    register_family,
    register_native_fake,
    triton_interpret,
    unavailable_reason,
)

__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "Family",
    "Variant",
    "Implementation",
    "Choice",
    "Report",
    "ENVIRONMENT",
    "Variable",
    "register_family",
    "families",
    "choices",
    "define",
    "register",
    "implementation",
    "implementations",
    "select",
    "backward_of",
    "backward_impl",
    "lazy",
    "put",
    "report",
    "native_settings",
    "env",
    "env_flag",
    "env_problem",
    "check_env",
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

logger = logging.getLogger("smelt")

#: the modules whose import registers the shipped ops (loaded by :func:`report`)
OP_MODULES = (
    "smelt_kernels.moe_gemm",
    "smelt_kernels.attention",
    "smelt_kernels.rotary",
    "smelt_kernels.norm",
    "smelt_kernels.dense",
)


class BackendUnavailableError(RuntimeError):
    """A requested backend cannot run here (not built, wrong device, no Triton...)."""


# ----------------------------------------------------------------------------- the registry
@dataclass(frozen=True)
class Variant:
    """One choice an implementation makes inside itself, and when."""

    name: str
    doc: str


@dataclass(frozen=True)
class Implementation:
    """One backend's implementation of one op, and what it can take.

    ``forward`` / ``backward``: the callables the op runs (their signatures are the op's
    business). ``backward_via``: when ``backward`` is None, the backends of the same op whose
    backward this one borrows, first available wins. ``devices``: device types it runs on;
    ``auto``: device types where ``None``/``"auto"`` may pick it (default: ``devices``), in
    descending ``priority``. ``dtypes``: the floating dtypes it takes (None: any).
    ``requires(device)`` and ``supports(**features)`` return None or the reason it cannot
    run / cannot take them. ``infer``: an entry point for calls autograd does not record,
    which skips the op's operators (it returns None for inputs it does not take).
    ``variants`` and ``variant(*inputs) -> (name, reason)``: the choices it makes inside.
    ``traced``: False keeps ``"auto"`` from picking it while ``torch.compile`` traces (the
    compiler fuses the reference's ops itself). ``direct``: the forward is plain
    differentiable torch code, called as it is (autograd records its ops), not through the
    op's operators. ``checks_values``: the implementation checks argument values itself
    (the op's host check is skipped).
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
    variants: tuple[Variant, ...] = ()
    variant: Optional[Callable[..., tuple[str, str]]] = None
    traced: bool = True
    direct: bool = False
    checks_values: bool = False

    def unavailable(self, device) -> Optional[str]:
        """None if this implementation can run on ``device``, else why not."""
        dev = as_device(device)
        if self.devices is not None and dev.type not in self.devices:
            return (
                f"{self.op}: backend {self.backend!r} runs on {'/'.join(self.devices)} "
                f"tensors, got device {dev}"
            )
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


@dataclass(frozen=True)
class _OpInfo:
    describe: Callable[..., tuple[torch.device, Optional[torch.dtype], dict[str, Any]]]
    missing_runs_auto: bool


@dataclass(frozen=True)
class Choice:
    """What :func:`select` picked: the ``implementation`` (its ``backend``), why, and --
    given the inputs -- the ``variant`` it will run inside and why (``variant_reason``)."""

    implementation: Implementation
    reason: str
    inputs: tuple = ()

    @property
    def backend(self) -> str:
        return self.implementation.backend

    @property
    def variant(self) -> Optional[str]:
        return self._variant()[0]

    @property
    def variant_reason(self) -> Optional[str]:
        return self._variant()[1]

    def _variant(self) -> tuple[Optional[str], Optional[str]]:
        impl = self.implementation
        if impl.variant is None or not self.inputs:
            return None, None
        return impl.variant(*self.inputs)

    def __getattr__(self, name):  # the Implementation's fields (forward, infer...)
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.implementation, name)


_REGISTRY: dict[str, dict[str, Implementation]] = {}
_OPS: dict[str, _OpInfo] = {}
_REPORTED: set[tuple[str, str, str]] = set()
_CACHE: dict[tuple, tuple[Implementation, str]] = {}


def define(op: str, describe: Callable[..., tuple], *, missing_runs_auto: bool = False) -> None:
    """Tell the registry how to read ``op``'s inputs: ``describe(*inputs)`` returns
    ``(device, dtype, features)``. ``missing_runs_auto``: a backend name the op has no
    implementation of runs the op's auto choice (logged once) instead of raising -- for an
    op that one backend serves for all, as the router's torch ops serve the GPU backends."""
    _OPS[op] = _OpInfo(describe, missing_runs_auto)


def register(
    op: str,
    backend: str,
    forward: Callable[..., Any],
    backward: Optional[Callable[..., Any]] = None,
    *,
    backward_via: Sequence[str] = (),
    devices: Optional[Sequence[str]] | str = "family",
    auto: Optional[Sequence[str]] = None,
    priority: Optional[int] = None,
    dtypes: Optional[Sequence[torch.dtype]] = None,
    requires: Optional[Callable[[torch.device], Optional[str]]] = None,
    supports: Optional[Callable[..., Optional[str]]] = None,
    infer: Optional[Callable[..., Any]] = None,
    variants: Sequence[Variant] = (),
    variant: Optional[Callable[..., tuple[str, str]]] = None,
    traced: bool = True,
    direct: bool = False,
    checks_values: bool = False,
    replace: bool = False,
    **info: Any,
) -> Implementation:
    """Register ``backend``'s implementation of ``op`` (see :class:`Implementation`);
    ``devices`` and ``priority`` default to the backend family's (:class:`Family`).
    Registering the same (op, backend) twice is an error unless ``replace=True`` (for
    experiments: a user's own kernel under an existing name)."""
    fam = family(backend)
    if fam is None:
        raise ValueError(f"register: backend must be one of {choices()[1:]}, got {backend!r}")
    if devices == "family":
        devices = fam.devices
    if priority is None:
        priority = fam.priority
    if backward is not None and backward_via:
        raise ValueError("register: give backward or backward_via, not both")
    impls = _REGISTRY.setdefault(op, {})
    if backend in impls and not replace:
        raise ValueError(f"register: {op!r} already has a {backend!r} implementation")
    impl = Implementation(
        op,
        backend,
        forward,
        backward,
        tuple(backward_via),
        None if devices is None else tuple(devices),
        None if auto is None else tuple(auto),
        priority,
        None if dtypes is None else tuple(dtypes),
        requires,
        supports,
        dict(info),
        infer,
        tuple(variants),
        variant,
        traced,
        direct,
        checks_values,
    )
    impls[backend] = impl
    _CACHE.clear()
    return impl


def put(impl: Implementation) -> Implementation:
    """Register an :class:`Implementation` object as it is, replacing its op's entry for its
    backend (e.g. to put back the one a ``register(..., replace=True)`` replaced)."""
    if family(impl.backend) is None:
        raise ValueError(f"put: backend must be one of {choices()[1:]}, got {impl.backend!r}")
    _REGISTRY.setdefault(impl.op, {})[impl.backend] = impl
    _CACHE.clear()
    return impl


def implementations(op: str) -> tuple[Implementation, ...]:
    """Every registered implementation of ``op``, in ``auto`` order (priority first)."""
    if op not in _REGISTRY:
        raise ValueError(f"no op {op!r} is registered (registered: {', '.join(_REGISTRY)})")
    return tuple(sorted(_REGISTRY[op].values(), key=lambda i: (-i.priority, i.backend)))


def implementation(op: str, backend: str) -> Implementation:
    """The registered implementation of ``op`` by ``backend`` (no availability check)."""
    impls = _REGISTRY.get(op, {})
    if backend not in impls:
        raise BackendUnavailableError(f"{op}: no {backend!r} implementation (has {sorted(impls)})")
    return impls[backend]


def _explicit(op, backend, dev, dtype, features) -> Implementation:
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


def _auto(op, dev, dtype, features) -> tuple[Implementation, str]:
    compiling = torch.compiler.is_compiling()
    skipped = []
    for impl in implementations(op):
        allowed = impl.auto if impl.auto is not None else impl.devices
        if allowed is not None and dev.type not in allowed:
            continue
        if compiling and not impl.traced:
            reason = "not while torch.compile traces (its generated code fuses the reference)"
        else:
            reason = (
                impl.unavailable(dev) or impl.dtype_reason(dtype) or impl.feature_reason(features)
            )
        if reason is None:
            return impl, "; ".join(skipped)
        skipped.append(f"{impl.backend}: {reason}")
    raise BackendUnavailableError(
        f"{op}: no backend can run these inputs on {dev} "
        f"({'; '.join(skipped) or 'none registered'})"
    )


def _state() -> tuple:
    # what availability depends on besides the registry: tests and users may load, replace
    # or drop an extension, or switch the Triton interpreter, in a running process (a value
    # of it that is not one Triton takes is refused here, before anything is chosen)
    return (env("TRITON_INTERPRET"),) + extensions_state()


def select(
    op: str,
    *inputs: Any,
    backend: Optional[str] = None,
    device=None,
    dtype: Optional[torch.dtype] = None,
    **features: Any,
) -> Choice:
    """The implementation of ``op`` to run, as a :class:`Choice` (``.backend``,
    ``.reason``, ``.variant``, ``.variant_reason``).

    ``select(op, *inputs, backend=None)``: for these inputs of the op (read by the op's
    :func:`define`). ``select(op, backend, device=, dtype=, **features)``: for inputs
    described by hand. ``backend`` None or ``"auto"``: the highest-priority implementation
    that can run and take the inputs (a fallback past a preferred one is logged once with
    the reasons). An explicit backend is returned or refused with the error its failure
    calls for (see the module docstring)."""
    if device is None:
        if op not in _OPS:
            raise ValueError(f"select: op {op!r} has no input description; pass device=")
        dev, dtype, features = _OPS[op].describe(*inputs)
    else:
        if len(inputs) > 1:
            raise TypeError("select: give the op's inputs, or backend and device=, not both")
        if inputs:
            backend = inputs[0]
        dev, inputs = as_device(device), ()
    if backend is not None and not (isinstance(backend, str) and (backend in choices())):
        raise ValueError(f"backend must be one of {choices()[1:]}, 'auto' or None; got {backend!r}")
    why = None
    if backend is not None and backend != "auto":
        info = _OPS.get(op)
        if info is not None and info.missing_runs_auto and backend not in _REGISTRY.get(op, {}):
            why = f"{op} has no {backend!r} implementation and runs its auto choice"
            backend = None
    explicit = backend is not None and backend != "auto"
    if torch.compiler.is_compiling():
        # traced once per graph: no cache (its contents would become guards)
        if explicit:
            return Choice(_explicit(op, backend, dev, dtype, features), "asked for", inputs)
        return Choice(_auto(op, dev, dtype, features)[0], "traced by torch.compile", inputs)
    key = (
        op,
        backend,
        dev.type,
        dtype,
        tuple(sorted(features.items())) if features else (),
        _state(),
    )
    hit = _CACHE.get(key)
    # a hit stands while the registry still holds that implementation
    if hit is None or _REGISTRY.get(op, {}).get(hit[0].backend) is not hit[0]:
        hit = (
            (_explicit(op, backend, dev, dtype, features), "")
            if explicit
            else _auto(op, dev, dtype, features)
        )
        _CACHE[key] = hit
    if explicit:
        return Choice(hit[0], "asked for", inputs)
    impl, skipped = hit
    reason = (
        "; ".join(r for r in (why, skipped and f"fell back past {skipped}") if r)
        or "the highest-priority backend that can run these inputs"
    )
    if why or skipped:
        log_key = (op, dev.type, impl.backend)
        if log_key not in _REPORTED:
            _REPORTED.add(log_key)
            logger.info(
                "%s on %s uses backend %r (%s)",
                op,
                dev.type,
                impl.backend,
                "; ".join(r for r in (why, skipped) if r),
            )
    return Choice(impl, reason, inputs)


def backward_impl(impl: Implementation, device) -> Implementation:
    """The implementation whose backward runs for a forward run by ``impl``: ``impl`` itself
    when it has one, else the first available backend of its ``backward_via``."""
    if isinstance(impl, Choice):
        impl = impl.implementation
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
        f"{impl.op}: backend {impl.backend!r} has no backward here "
        f"({'; '.join(reasons) or 'none registered'})"
    )


def backward_of(impl: Implementation, device) -> Callable[..., Any]:
    """The backward callable for a forward run by ``impl`` (see :func:`backward_impl`)."""
    return backward_impl(impl, device).backward


class Report(dict):
    """``{op: {backend: None or why it cannot run}}`` for a device, with ``variants``
    (``{op: {backend: {variant: doc}}}``), ``environment`` (the variables of
    :data:`ENVIRONMENT` that are set), ``problems`` (``{variable: why its value is refused}``)
    and ``in_use`` (``{variable: what the native kernels make of it now}``, from the
    extension itself); ``str()`` prints it as a table."""

    def __init__(self, device, rows, variants, environment, problems=None, in_use=None):
        super().__init__(rows)
        self.device, self.variants, self.environment = device, variants, environment
        self.problems, self.in_use = dict(problems or {}), dict(in_use or {})

    def __str__(self) -> str:
        lines = [f"smelt backends on {self.device}"]
        for op, per in self.items():
            lines.append(f"{op}:")
            for backend, reason in per.items():
                lines.append(f"  {backend:<7} {'available' if reason is None else reason}")
                for name, doc in self.variants.get(op, {}).get(backend, {}).items():
                    lines.append(f"    variant {name}: {doc}")
        lines.append(
            "environment: "
            + (
                ", ".join(f"{k}={v}" for k, v in self.environment.items())
                or "no smelt variable set"
            )
        )
        lines += [f"  refused: {why}" for why in self.problems.values()]
        if self.in_use:
            lines.append("native CPU kernels now use:")
            lines += [f"  {what} ({name})" for name, what in self.in_use.items()]
        return "\n".join(lines)


def native_settings() -> dict[str, str]:
    """``{variable: what the native CPU kernels make of it now}`` (the vector forms they
    picked, the pool's cap...), from the extension itself; empty without it. Refuses
    (ValueError) while a variable they read has an invalid value, which they would ignore."""
    if extension_op_missing("_cpu", "settings", "csrc/cpu_module.cpp") is not None:
        return {}
    check_env(*(name for name, var in ENVIRONMENT.items() if var.native))
    pairs = (item.split("=", 1) for item in torch.ops.smelt_cpu.settings())
    return {name: what for name, what in pairs}


def report(device="cpu") -> Report:
    """Every registered op, each backend (None: can run on ``device``; else why not) and
    its variants, the environment variables that are set, the values among them that are
    refused, and what the native kernels use (:func:`native_settings`; left out while a
    value they read is refused). Loads the shipped op modules first, so their
    registrations count."""
    for mod in OP_MODULES:
        importlib.import_module(mod)
    rows = {
        op: {impl.backend: impl.unavailable(device) for impl in implementations(op)}
        for op in _REGISTRY
    }
    variants = {
        op: {
            impl.backend: {v.name: v.doc for v in impl.variants}
            for impl in implementations(op)
            if impl.variants
        }
        for op in _REGISTRY
    }
    environment = {name: os.environ[name] for name in ENVIRONMENT if name in os.environ}
    problems = {
        name: why
        for name, value in environment.items()
        if (why := env_problem(name, value)) is not None
    }
    native = {} if any(ENVIRONMENT[n].native for n in problems) else native_settings()
    return Report(str(device), rows, variants, environment, problems, native)
