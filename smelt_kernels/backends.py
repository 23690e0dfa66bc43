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

__all__ = [
    "BACKENDS", "BackendUnavailableError", "Family", "Variant", "Implementation", "Choice",
    "Report", "ENVIRONMENT", "register_family", "families", "choices", "define", "register",
    "implementation", "implementations", "select", "backward_of", "backward_impl", "lazy",
    "put", "report", "env", "env_flag", "extension", "extension_error", "extension_op_missing",
    "register_native_fake", "needs_grad", "triton_interpret", "unavailable_reason",
    "can_read_values", "require_tensor", "require_floating", "require_device",
    "check_values_flag",
]

logger = logging.getLogger("smelt")

#: the modules whose import registers the shipped ops (loaded by :func:`report`)
OP_MODULES = ("smelt_kernels.moe_gemm", "smelt_kernels.attention", "smelt_kernels.norm")


class BackendUnavailableError(RuntimeError):
    """A requested backend cannot run here (not built, wrong device, no Triton...)."""


# ----------------------------------------------------------------------------- environment
#: every environment variable smelt reads at run time, and what it changes
ENVIRONMENT: dict[str, str] = {
    "TRITON_INTERPRET": "1 runs Triton kernels on CPU tensors in the interpreter",
    "SMELT_CPU_GENERIC": "1: the CPU MoE forward uses the packed-panel kernels, never the "
                         "AVX-512 rows kernel",
    "SMELT_CPU_DECODE": "0: the CPU MoE forward never takes the few-rows (decode) path",
    "SMELT_ATTENTION_ISA": "avx2, avx2-wide or generic: the CPU attention kernel's vector form "
                           "(read once, when the extension loads)",
    "SMELT_ROUTE_ISA": "avx2 or generic: the CPU router's top-k form",
    "SMELT_CPU_POOL_MB": "what the CPU kernels' block pool keeps unused, in MB (default 1024; "
                         "0 turns it off)",
    "SMELT_POISON": "1 fills every kernel output with NaN before the kernel writes it (tests)",
    "SMELT_HF_STRICT": "1: the transformers experts integration raises instead of falling back",
    "SMELT_TRAIN_CRASH": "step:N or checkpoint:N kills the trainer there (fault injection, tests)",
}


def env(name: str) -> Optional[str]:
    """The value of environment variable ``name`` (one of :data:`ENVIRONMENT`), or None."""
    if name not in ENVIRONMENT:
        raise KeyError(f"{name} is not one of smelt's environment variables ({', '.join(ENVIRONMENT)})")
    return os.environ.get(name)


def env_flag(name: str, default: bool = False) -> bool:
    """Whether ``name`` is set to something other than empty, "0", "false" or "no"."""
    value = env(name)
    if value is None or value == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


def triton_interpret() -> bool:
    return env_flag("TRITON_INTERPRET")


# ----------------------------------------------------------------------------- extensions
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


def _library(ext: str) -> str:
    for fam in _FAMILIES.values():
        if fam.extension == ext:
            return fam.library
    raise ValueError(f"no backend family builds the extension {ext!r}")


def extension_op_missing(name: str, op: str, source: str) -> Optional[str]:
    """None if extension ``name`` loaded and registered ``torch.ops.<lib>.<op>``, else why not.
    ``source`` names the file that defines the op (for the message)."""
    if extension(name) is None:
        return extension_error(name)
    lib = _library(name)
    if not hasattr(getattr(torch.ops, lib), op):
        return f"smelt_kernels.{name} was built without {source} (no {lib}.{op})"
    return None


def register_native_fake(name: str, op: str, fake) -> bool:
    """Register ``fake`` as the fake (meta) kernel of native op ``torch.ops.<lib>.<op>`` of
    extension ``name`` when it is built, so that ``torch.compile`` can trace a direct call
    to it (what the no-autograd entry points make). True if registered."""
    if extension_op_missing(name, op, "") is not None:
        return False
    torch.library.register_fake(f"{_library(name)}::{op}", fake)
    return True


# ----------------------------------------------------------------------------- families
def _device(device) -> torch.device:
    return device if isinstance(device, torch.device) else torch.device(device)


@dataclass(frozen=True)
class Family:
    """A backend family: ``devices`` it can run on (None: any), the native ``extension`` it
    builds (with its ``torch.ops`` ``library``) and whether every implementation needs it
    (``needs_extension``), and ``check(device)`` for anything else (None or the reason)."""

    name: str
    doc: str
    devices: Optional[tuple[str, ...]] = None
    extension: Optional[str] = None
    library: Optional[str] = None
    needs_extension: bool = False
    check: Optional[Callable[[torch.device], Optional[str]]] = None

    def unavailable(self, device) -> Optional[str]:
        dev = _device(device)
        if self.devices is not None and dev.type not in self.devices:
            kind = "/".join(self.devices)
            return f"the {self.name!r} backend runs on {kind} tensors, got device {dev}"
        if self.needs_extension and extension(self.extension) is None:
            return extension_error(self.extension)
        return None if self.check is None else self.check(dev)


_FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Add a backend family (a new kind of kernel: its implementations then register under
    its name). Registering a name twice is an error."""
    if family.name in _FAMILIES or family.name == "auto":
        raise ValueError(f"register_family: {family.name!r} is already a backend name")
    _FAMILIES[family.name] = family
    return family


def families() -> tuple[Family, ...]:
    return tuple(_FAMILIES.values())


def choices() -> tuple[str, ...]:
    """What a ``--backend`` option takes: ``"auto"`` and every family."""
    return ("auto",) + tuple(_FAMILIES)


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


def _triton_check(dev: torch.device) -> Optional[str]:
    reason = _triton_import_error()
    if reason is None and dev.type == "cpu" and not triton_interpret():
        return "Triton on CPU tensors needs TRITON_INTERPRET=1 (the interpreter)"
    return reason


register_family(Family("torch", "the pure-torch reference of every op (any device)"))
register_family(Family("cpu", "native C++ kernels (smelt_kernels._cpu) and ATen fast paths",
                       devices=("cpu",), extension="_cpu", library="smelt_cpu"))
register_family(Family("triton", "Triton kernels (CUDA; CPU under TRITON_INTERPRET=1)",
                       devices=("cpu", "cuda"), check=_triton_check))
register_family(Family("cuda", "hand-written CUDA kernels (smelt_kernels._cuda)",
                       devices=("cuda",), extension="_cuda", library="smelt_cuda",
                       needs_extension=True))

#: the shipped backend families (:func:`choices` adds ``"auto"`` and any registered later)
BACKENDS = tuple(_FAMILIES)


def unavailable_reason(backend: str, device) -> Optional[str]:
    """None if the backend family ``backend`` can run on ``device`` at all; otherwise why
    not (what an op's implementation needs beyond it is its ``requires`` check)."""
    if backend not in _FAMILIES:
        return f"unknown backend {backend!r}; choose one of {tuple(_FAMILIES)} or None"
    return _FAMILIES[backend].unavailable(device)


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


def register(op: str, backend: str, forward: Callable[..., Any],
             backward: Optional[Callable[..., Any]] = None, *,
             backward_via: Sequence[str] = (), devices: Optional[Sequence[str]] = ("cpu", "cuda"),
             auto: Optional[Sequence[str]] = None, priority: int = 0,
             dtypes: Optional[Sequence[torch.dtype]] = None,
             requires: Optional[Callable[[torch.device], Optional[str]]] = None,
             supports: Optional[Callable[..., Optional[str]]] = None,
             infer: Optional[Callable[..., Any]] = None, variants: Sequence[Variant] = (),
             variant: Optional[Callable[..., tuple[str, str]]] = None, traced: bool = True,
             direct: bool = False, checks_values: bool = False, replace: bool = False,
             **info: Any) -> Implementation:
    """Register ``backend``'s implementation of ``op`` (see :class:`Implementation`).
    Registering the same (op, backend) twice is an error unless ``replace=True`` (for
    experiments: a user's own kernel under an existing name)."""
    if backend not in _FAMILIES:
        raise ValueError(f"register: backend must be one of {tuple(_FAMILIES)}, got {backend!r}")
    if backward is not None and backward_via:
        raise ValueError("register: give backward or backward_via, not both")
    impls = _REGISTRY.setdefault(op, {})
    if backend in impls and not replace:
        raise ValueError(f"register: {op!r} already has a {backend!r} implementation")
    impl = Implementation(op, backend, forward, backward, tuple(backward_via),
                          None if devices is None else tuple(devices),
                          None if auto is None else tuple(auto), priority,
                          None if dtypes is None else tuple(dtypes), requires, supports,
                          dict(info), infer, tuple(variants), variant, traced, direct,
                          checks_values)
    impls[backend] = impl
    _CACHE.clear()
    return impl


def put(impl: Implementation) -> Implementation:
    """Register an :class:`Implementation` object as it is, replacing its op's entry for its
    backend (e.g. to put back the one a ``register(..., replace=True)`` replaced)."""
    if impl.backend not in _FAMILIES:
        raise ValueError(f"put: backend must be one of {tuple(_FAMILIES)}, got {impl.backend!r}")
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
            reason = (impl.unavailable(dev) or impl.dtype_reason(dtype)
                      or impl.feature_reason(features))
        if reason is None:
            return impl, "; ".join(skipped)
        skipped.append(f"{impl.backend}: {reason}")
    raise BackendUnavailableError(
        f"{op}: no backend can run these inputs on {dev} ({'; '.join(skipped) or 'none registered'})")


def _state() -> tuple:
    # what availability depends on besides the registry: tests and users may load, replace
    # or drop an extension, or switch the Triton interpreter, in a running process
    return (os.environ.get("TRITON_INTERPRET"), id(_EXT_CACHE.get("_cpu")),
            id(_EXT_CACHE.get("_cuda")), len(_EXT_CACHE))


def select(op: str, *inputs: Any, backend: Optional[str] = None, device=None,
           dtype: Optional[torch.dtype] = None, **features: Any) -> Choice:
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
        dev, inputs = _device(device), ()
    if backend is not None and not (isinstance(backend, str)
                                    and (backend in _FAMILIES or backend == "auto")):
        raise ValueError(f"backend must be one of {tuple(_FAMILIES)}, 'auto' or None; got {backend!r}")
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
    key = (op, backend, dev.type, dtype, tuple(sorted(features.items())) if features else (),
           _state())
    hit = _CACHE.get(key)
    # a hit stands while the registry still holds that implementation
    if hit is None or _REGISTRY.get(op, {}).get(hit[0].backend) is not hit[0]:
        hit = (_explicit(op, backend, dev, dtype, features), "") if explicit else \
            _auto(op, dev, dtype, features)
        _CACHE[key] = hit
    if explicit:
        return Choice(hit[0], "asked for", inputs)
    impl, skipped = hit
    reason = "; ".join(r for r in (why, skipped and f"fell back past {skipped}") if r) or \
        "the highest-priority backend that can run these inputs"
    if why or skipped:
        log_key = (op, dev.type, impl.backend)
        if log_key not in _REPORTED:
            _REPORTED.add(log_key)
            logger.info("%s on %s uses backend %r (%s)", op, dev.type, impl.backend,
                        "; ".join(r for r in (why, skipped) if r))
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
        f"{impl.op}: backend {impl.backend!r} has no backward here ({'; '.join(reasons) or 'none registered'})")


def backward_of(impl: Implementation, device) -> Callable[..., Any]:
    """The backward callable for a forward run by ``impl`` (see :func:`backward_impl`)."""
    return backward_impl(impl, device).backward


class Report(dict):
    """``{op: {backend: None or why it cannot run}}`` for a device, with ``variants``
    (``{op: {backend: {variant: doc}}}``) and ``environment`` (the variables of
    :data:`ENVIRONMENT` that are set); ``str()`` prints it as a table."""

    def __init__(self, device, rows, variants, environment):
        super().__init__(rows)
        self.device, self.variants, self.environment = device, variants, environment

    def __str__(self) -> str:
        lines = [f"smelt backends on {self.device}"]
        for op, per in self.items():
            lines.append(f"{op}:")
            for backend, reason in per.items():
                lines.append(f"  {backend:<7} {'available' if reason is None else reason}")
                for name, doc in self.variants.get(op, {}).get(backend, {}).items():
                    lines.append(f"    variant {name}: {doc}")
        lines.append("environment: " + (", ".join(f"{k}={v}" for k, v in self.environment.items())
                                        or "no smelt variable set"))
        return "\n".join(lines)


def report(device="cpu") -> Report:
    """Every registered op, each backend (None: can run on ``device``; else why not) and
    its variants, and the environment variables that are set. Loads the shipped op modules
    first, so their registrations count."""
    for mod in OP_MODULES:
        importlib.import_module(mod)
    rows = {op: {impl.backend: impl.unavailable(device) for impl in implementations(op)}
            for op in _REGISTRY}
    variants = {op: {impl.backend: {v.name: v.doc for v in impl.variants}
                     for impl in implementations(op) if impl.variants}
                for op in _REGISTRY}
    environment = {name: os.environ[name] for name in ENVIRONMENT if name in os.environ}
    return Report(str(device), rows, variants, environment)


# the argument checks every op shares live in checks.py; ops reach them through here
from .checks import (can_read_values, check_values_flag, needs_grad,  # noqa: E402
                     require_device, require_floating, require_tensor)


# Probe the optional pieces once, at import, so that backend selection inside a
# torch.compile'd region is a plain lookup (dynamo does not trace imports).
for _name in ("_cpu", "_cuda"):
    extension(_name)
_triton_import_error()
