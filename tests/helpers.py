"""Helpers shared by the tests: the Triton device, the fp64 oracle and the model tests'
micro config.

The tolerance rule and the edge cases are the package's own (:mod:`smelt_kernels.testing`,
which the self-test reads too): every comparison of a kernel with the oracle in tests/ goes
through :func:`assert_close` (``smelt_kernels.testing.assert_close``), and the edge-case
tests run :data:`smelt_kernels.testing.EDGES`.
"""

from __future__ import annotations

import contextlib
import io
from traceback import format_exc
from types import SimpleNamespace
from typing import Callable, Optional, Sequence

import pytest
import torch

from smelt_kernels import backends
from smelt_kernels.testing import assert_close
from smelt_model.config import LoopSpec, ModelConfig

__all__ = [
    "BLOCK_NATIVE",
    "micro_config",
    "triton_device",
    "device_for",
    "run_with_grads",
    "fp64_oracle",
    "max_err",
    "assert_close",
    "assert_all_close",
]

#: Python source that makes both native extensions unloadable: the prelude of a subprocess
#: that checks what a pure-Python install does
BLOCK_NATIVE = (
    "import sys\n"
    "class Block:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name in ('smelt_kernels._cpu', 'smelt_kernels._cuda'):\n"
    "            raise ImportError('blocked for the test')\n"
    "sys.meta_path.insert(0, Block())\n"
)


def micro_config(loop=LoopSpec(1, 2, 2), **overrides):
    """The model tests' micro config: 4 layers of hidden 48 (4 heads, 2 KV heads of 16), 8
    experts of 24 with top-2, vocabulary 97, the middle two layers looped twice unless
    ``loop`` says otherwise (None: the unlooped baseline); ``overrides`` replace any other
    field."""
    fields = dict(
        vocab_size=97,
        hidden_size=48,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        n_experts=8,
        expert_size=24,
        top_k=2,
        loop=loop,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def triton_device() -> torch.device:
    """Where Triton kernels run here: the GPU, else the CPU under TRITON_INTERPRET=1; skips
    the test when neither."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if backends.triton_interpret():
        return torch.device("cpu")
    pytest.skip("Triton needs a CUDA device or TRITON_INTERPRET=1")


def device_for(backend: str) -> torch.device:
    """The device a backend's tests run on: Triton's (above), the GPU for "cuda", else the CPU."""
    if backend == "triton":
        return triton_device()
    return torch.device("cuda" if backend == "cuda" else "cpu")


def run_with_grads(
    fn: Callable, leaves: Sequence[torch.Tensor], grad_out: torch.Tensor, *rest, dtype=None
) -> tuple:
    """fn(*leaves, *rest) on CPU copies of the leaves (cast to ``dtype`` if given), and the
    gradients of its (first) output against ``grad_out``: (outputs..., grads...)."""
    xs = [t.detach().cpu().to(dtype or t.dtype).requires_grad_() for t in leaves]
    out = fn(*xs, *rest)
    outs = out if isinstance(out, tuple) else (out,)
    g = grad_out.detach().cpu().to(outs[0].dtype)
    grads = torch.autograd.grad(outs[0], xs, g)
    return tuple(o.detach() for o in outs) + tuple(grads)


def fp64_oracle(
    fn: Callable, leaves: Sequence[torch.Tensor], grad_out: torch.Tensor, *rest
) -> tuple:
    """:func:`run_with_grads` in float64: the oracle every kernel is measured against."""
    return run_with_grads(fn, leaves, grad_out, *rest, dtype=torch.float64)


def max_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    if ref.numel() == 0:
        return 0.0
    return (got.detach().cpu().double() - ref.detach().cpu().double()).abs().max().item()


def assert_all_close(
    names: Sequence[str],
    got: Sequence[torch.Tensor],
    ref: Sequence[torch.Tensor],
    base: Sequence[torch.Tensor],
    dtype: Optional[torch.dtype] = None,
) -> None:
    for name, a, r, b in zip(names, got, ref, base):
        assert_close(name, a, r, b, dtype)


def run_snippet(body, cwd, monkeypatch):
    """A snippet as ``python snippet.py`` runs it in ``cwd`` (a ``__main__`` namespace of
    its own, ``cwd`` the working directory, what it prints captured), in this process: the
    interpreter and the packages are already loaded, so no process start is paid for it."""
    out = io.StringIO()
    with monkeypatch.context() as m, contextlib.redirect_stdout(out):
        m.chdir(cwd)
        try:
            exec(compile(body, str(cwd / "snippet.py"), "exec"), {"__name__": "__main__"})
        except BaseException:
            return SimpleNamespace(returncode=1, stdout=out.getvalue(), stderr=format_exc())
    return SimpleNamespace(returncode=0, stdout=out.getvalue(), stderr="")
