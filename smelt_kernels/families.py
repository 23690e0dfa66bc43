"""Backend families, the native extensions they build, and smelt's environment variables.

A backend family is one registered :class:`Family` (its devices, its extension, its own
check): ``"torch"``, ``"cpu"``, ``"triton"`` and ``"cuda"`` ship, :func:`register_family`
adds one. The native extensions are imported behind a guard (:func:`extension`): without
them everything imports and the registry says why. :data:`ENVIRONMENT` lists every
environment variable smelt reads at run time and the values each takes; Python code reads
them through :func:`env` only, which refuses a value the table does not allow (native code
reads them through ``csrc/env.h``, after the Python entry point checked them with
:func:`check_env`). :mod:`smelt_kernels.backends` re-exports all of it.
"""

from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

__all__ = [
    "ENVIRONMENT",
    "Variable",
    "env",
    "env_flag",
    "env_problem",
    "check_env",
    "triton_interpret",
    "extension",
    "extensions_state",
    "as_device",
    "family",
    "extension_error",
    "extension_op_missing",
    "register_native_fake",
    "Family",
    "register_family",
    "families",
    "choices",
    "BACKENDS",
    "unavailable_reason",
    "lazy",
]


# ----------------------------------------------------------------------------- environment
@dataclass(frozen=True)
class Variable:
    """One environment variable smelt reads: what it changes (``doc``) and what it takes:
    one of ``values`` (compared as written, or ignoring case with ``fold_case``), a
    non-negative whole number (``number``), or text matching ``pattern``. Unset and empty
    are the same: the default. ``native``: read by the native kernels too (through
    ``csrc/env.h``), which trust what Python checked first. ``build``: read by ``setup.py`` while
    installing, not at run time."""

    doc: str
    values: tuple[str, ...] = ()
    number: bool = False
    pattern: str = ""
    fold_case: bool = False
    native: bool = False
    #: read by ``setup.py`` while installing (which checks it), not at run time
    build: bool = False

    def takes(self) -> str:
        """What the variable takes, in words."""
        if self.values:
            shown = [repr(v) for v in self.values]
            return "one of " + ", ".join(shown) + (" (any case)" if self.fold_case else "")
        if self.number:
            return "a whole number >= 0"
        return f"text of the form {self.pattern!r}" if self.pattern else "any text"

    def accepts(self, value: str) -> bool:
        if value == "":
            return True
        if self.values:
            return (value.lower() if self.fold_case else value) in self.values
        if self.number:
            return value.isascii() and value.isdigit()
        return re.fullmatch(self.pattern, value) is not None if self.pattern else True


_FLAG = ("0", "1")

#: every environment variable smelt reads (at run time, or while installing: ``build``): what it
#: changes and what it takes
ENVIRONMENT: dict[str, Variable] = {
    "TRITON_INTERPRET": Variable(
        "1 runs Triton kernels on CPU tensors in the interpreter",
        values=("0", "1", "false", "true", "off", "on", "no", "yes", "n", "y"),
        fold_case=True,  # Triton's own reading of it
    ),
    "SMELT_CPU_GENERIC": Variable(
        "1: the CPU MoE forward uses the packed-panel kernels, never the AVX-512 rows kernel",
        values=_FLAG,
        native=True,
    ),
    "SMELT_CPU_DECODE": Variable(
        "0: the CPU MoE forward never takes the few-rows (decode) path", values=_FLAG, native=True
    ),
    "SMELT_ATTENTION_ISA": Variable(
        "the CPU attention kernel's vector form (read once, by the first native attention call)",
        values=("avx2", "avx2-wide", "generic"),
        native=True,
    ),
    "SMELT_ROUTE_ISA": Variable(
        "the CPU router's top-k form", values=("avx2", "generic"), native=True
    ),
    "SMELT_CPU_POOL_MB": Variable(
        "what the CPU kernels' block pool keeps unused, in MB (default 1024; 0 turns it off)",
        number=True,
        native=True,
    ),
    "SMELT_POISON": Variable(
        "1 fills every kernel output with NaN before the kernel writes it (tests)",
        values=_FLAG,
        native=True,
    ),
    "SMELT_HF_STRICT": Variable(
        "1: the transformers experts integration raises instead of falling back", values=_FLAG
    ),
    "SMELT_TRACEBACK": Variable(
        "1: a command re-raises the error it would print as one line (for a bug report)",
        values=_FLAG,
    ),
    "SMELT_TRAIN_CRASH": Variable(
        "kills the trainer at that step or checkpoint (fault injection, tests)",
        pattern=r"(step|checkpoint):\d+",
    ),
    "SMELT_BUILD_NATIVE": Variable(
        "0: install without native code; 1: a failed native build is an error (default auto)",
        values=("0", "1", "auto"),
        fold_case=True,
        build=True,
    ),
    "SMELT_BUILD_CUDA": Variable(
        "the same as SMELT_BUILD_NATIVE, for the CUDA extension alone",
        values=("0", "1", "auto"),
        fold_case=True,
        build=True,
    ),
    "SMELT_BUILD_PROGRESS": Variable(
        "0: the native build does not list each compiled file on the terminal",
        values=_FLAG,
        build=True,
    ),
    "SMELT_MARCH_NATIVE": Variable(
        "1: the native CPU code is compiled for this machine's CPU (-march=native) instead of "
        "the portable build with run-time dispatch",
        values=_FLAG,
        build=True,
    ),
    "SMELT_TITAN_COMM": Variable(
        "a folder: every rank of a torchtitan run records the bytes its collectives send "
        "there (smelt_model.titan.moe.traffic)"
    ),
}


def env_problem(name: str, value: Optional[str]) -> Optional[str]:
    """Why ``value`` is not a value variable ``name`` takes, or None (None and "" are)."""
    var = _variable(name)
    if value is None or var.accepts(value):
        return None
    return f"environment variable {name}={value!r} is not valid: it takes {var.takes()}"


def _variable(name: str) -> Variable:
    if name not in ENVIRONMENT:
        raise KeyError(
            f"{name} is not one of smelt's environment variables ({', '.join(ENVIRONMENT)})"
        )
    return ENVIRONMENT[name]


def env(name: str) -> Optional[str]:
    """The value of environment variable ``name`` (one of :data:`ENVIRONMENT`), or None;
    ValueError naming the variable, its value and what it takes when it takes no such
    value."""
    value = os.environ.get(name)
    problem = env_problem(name, value)
    if problem is not None:
        raise ValueError(problem)
    return value


def check_env(*names: str) -> None:
    """Refuse (ValueError, as :func:`env`) an invalid value of any of ``names``: what a
    Python entry point calls before native code that reads them runs."""
    for name in names:
        env(name)


def env_flag(name: str, default: bool = False) -> bool:
    """Whether ``name`` is set to a true value ("1"; for ``TRITON_INTERPRET`` also Triton's
    "true", "on", "yes", "y"); unset or empty: ``default``."""
    value = env(name)
    if value is None or value == "":
        return default
    return value.strip().lower() in ("1", "true", "on", "yes", "y")


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


def extensions_state() -> tuple:
    """What the loaded extensions are right now (their identities): availability answers
    cached by the registry hold while this stays the same (a test or a user may load,
    replace or drop an extension in a running process)."""
    return (id(_EXT_CACHE.get("_cpu")), id(_EXT_CACHE.get("_cuda")), len(_EXT_CACHE))


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
def as_device(device) -> torch.device:
    """``device`` (a ``torch.device`` or what ``torch.device`` takes) as a ``torch.device``."""
    return device if isinstance(device, torch.device) else torch.device(device)


@dataclass(frozen=True)
class Family:
    """A backend family: ``devices`` it can run on (None: any), the native ``extension`` it
    builds (with its ``torch.ops`` ``library``) and whether every implementation needs it
    (``needs_extension``), ``check(device)`` for anything else (None or the reason), and
    the ``priority`` its implementations get by default (``"auto"`` tries the highest
    first)."""

    name: str
    doc: str
    devices: Optional[tuple[str, ...]] = None
    extension: Optional[str] = None
    library: Optional[str] = None
    needs_extension: bool = False
    check: Optional[Callable[[torch.device], Optional[str]]] = None
    priority: int = 0

    def unavailable(self, device) -> Optional[str]:
        dev = as_device(device)
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


def family(name: str) -> Optional[Family]:
    """The registered family ``name``, or None."""
    return _FAMILIES.get(name)


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
    reason = _triton_import_error() or env_problem(
        "TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET")
    )
    if reason is None and dev.type == "cpu" and not triton_interpret():
        return "Triton on CPU tensors needs TRITON_INTERPRET=1 (the interpreter)"
    return reason


register_family(Family("torch", "the pure-torch reference of every op (any device)"))
register_family(
    Family(
        "cpu",
        "native C++ kernels (smelt_kernels._cpu) and ATen fast paths",
        devices=("cpu",),
        extension="_cpu",
        library="smelt_cpu",
        priority=10,
    )
)
register_family(
    Family(
        "triton",
        "Triton kernels (CUDA; CPU under TRITON_INTERPRET=1)",
        devices=("cpu", "cuda"),
        check=_triton_check,
        priority=30,
    )
)
register_family(
    Family(
        "cuda",
        "hand-written CUDA kernels (smelt_kernels._cuda)",
        devices=("cuda",),
        extension="_cuda",
        library="smelt_cuda",
        needs_extension=True,
        priority=20,
    )
)

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


# Probe the optional pieces once, at import, so that backend selection inside a
# torch.compile'd region is a plain lookup (dynamo does not trace imports).
for _name in ("_cpu", "_cuda"):
    extension(_name)
_triton_import_error()
