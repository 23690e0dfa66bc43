"""smelt's self-test: every kernel that can run here against its reference. Run it first on a
new machine or GPU (``smelt-selftest``, or ``python -m smelt_tools.selftest``)::

    smelt-selftest --device cuda --quick    # the GPU backends (Triton, CUDA): one case per op
    smelt-selftest --device cuda            # every case, float16 too
    smelt-selftest                          # the CPU backends (seconds)
    smelt-selftest --quick                  # one case per op: a smoke test
    TRITON_INTERPRET=1 smelt-selftest --quick   # Triton too, interpreted
    smelt-selftest --op moe_ffn --backend cpu triton --json selftest.json

Every implementation the registry (:mod:`smelt_kernels.backends`) holds for every op --
``route``, ``moe_ffn``, ``grouped_gemm``, ``segment_attention``, ``rotary``, ``rms_norm``,
``linear`` and
any registered later -- that can run on the device is called through the op's public entry
point with ``backend=`` its name, forward (with and without autograd) and backward (the
gradients of every differentiable input through a random upstream gradient), in float32,
bfloat16 and float16 (where the backend takes it), on the op's edge cases
(:data:`smelt_kernels.testing.EDGES`, the list the tests run too): for the MoE one token,
odd H and d_e, experts with no tokens, all tokens on one expert, no tokens and H = 0; for
attention length-1 segments, one segment filling the context, GQA, the decode form
(Tq < Tk), head dims 7 and 88 and zero-size dimensions; empty inputs wherever an op defines
them. ``--quick`` is a smoke test: the one case per op marked quick, float32 and bfloat16.
Each output is compared with the op's ``"torch"`` backend computed in float64 from the same
(rounded) inputs, under the one tolerance rule of :mod:`smelt_kernels.testing`: an error
may be at most twice what plain PyTorch makes in the same low precision, plus a floor of two
units of that precision (at least 1e-5) at the output's scale ("plain PyTorch" is the
``"torch"`` backend in that precision, or for attention, whose backend computes in float32
inside, the reference computed wholly in that precision). A value that is not finite where
the reference is fails; expert ids must match exactly. Kernel outputs are poisoned
(``SMELT_POISON=1``) so an element a kernel forgets to write fails too.

An implementation that cannot run on the device, a dtype it refuses, and bfloat16 of the
Triton backend under ``TRITON_INTERPRET=1`` (the interpreter has no bfloat16 ``tl.dot``)
are listed as ``skipped: <reason>``, never as passing. Triton runs on CPU tensors only under
``TRITON_INTERPRET=1``.

The command prints one progress line per op and backend (stderr), then a table -- op,
backend, variant (``backends.select(...).variant``), dtype, cases, worst normalised error,
verdict -- with the legend of its ``worst`` column (:data:`LEGEND`: the largest error over
its bound; at most 1 passes), what failed, and a summary line. Exit status: 0 when
everything that ran passed, 1 on any failure (or when stopped early: Ctrl-C or SIGTERM
print the rows that finished), 2 on bad options, checked before any work (one line
``smelt-selftest: error: ...`` on stderr; also ``--device cuda`` without a GPU, or a
``--json`` path that is a folder). The rows run in a worker process, so a kernel that
crashes the process (a signal, a dead CUDA context) fails its row and the rest still run;
``--in-process`` runs in the command's own process instead.

From Python: :func:`run` returns one :class:`Result` per op, backend and dtype;
:func:`format_table` and :func:`summary` print them.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from .results import (
    FAIL,
    LEGEND,
    PASS,
    SKIPPED,
    Result,
    failed,
    format_failures,
    format_table,
    summary,
    to_json,
)

__all__ = [
    "run",
    "Result",
    "LEGEND",
    "PASS",
    "FAIL",
    "SKIPPED",
    "failed",
    "format_table",
    "format_failures",
    "summary",
    "to_json",
]


def run(
    device="cpu",
    quick: bool = False,
    ops: Optional[Sequence[str]] = None,
    backends: Optional[Sequence[str]] = None,
    progress: Optional[Callable] = None,
) -> list[Result]:
    """Every registered implementation that can run on ``device`` ("cpu", "cuda") against its
    op's reference, forward and backward, per dtype: one :class:`Result` per op, backend and
    dtype, in the registry's order. ``quick``: a few cases per op, float32 and bfloat16 only.
    ``ops`` / ``backends``: only these names (default: all). ``progress(unit)``: called
    before each row runs (``unit.op``, ``unit.backend``, ``unit.dtype_name``). Bad names or
    a device that is not there: ValueError or TypeError, before anything runs."""
    from . import runner  # torch is imported here, not when the command line starts

    return runner.run(device, quick, ops, backends, progress)
