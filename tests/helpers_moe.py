"""Cases and checks of the MoE tests (tests/moe_gemm/)."""

from __future__ import annotations

import torch
from helpers import assert_all_close, fp64_oracle, run_with_grads

from smelt_kernels import reference, testing
from smelt_kernels.moe_gemm import moe_ffn
from smelt_kernels.moe_gemm import ops as moe_ops

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
OUTPUTS = ("y", "dx", "dw1", "dw2", "dtw")


def has_cpu_kernel() -> bool:
    return moe_ops.moe_cpu.missing("moe_ffn_fwd") is None


def cpu_has_avx512() -> bool:
    """Whether this CPU has AVX-512F (what the native MoE kernels check at run time)."""
    try:
        with open("/proc/cpuinfo") as f:
            return " avx512f" in f.read()
    except OSError:
        return False


def make_case(T, H, de, E, k, dtype, device="cpu", ids=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w1 = torch.randn(E, 2 * de, H, generator=g) * H**-0.5
    w2 = torch.randn(E, H, de, generator=g) * de**-0.5
    logits = torch.randn(T, E, generator=g)
    if ids is None:
        tw, ids = reference.route(logits, k)
    else:
        tw = torch.softmax(torch.randn(T, k, generator=g), -1)
    dy = torch.randn(T, H, generator=g)
    cast = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return dict(
        x=cast(x), w1=cast(w1), w2=cast(w2), tw=tw.to(device), ids=ids.to(device), dy=cast(dy)
    )


def leaves(case):
    return [case[n] for n in ("x", "w1", "w2", "tw")]


def run(case, backend):
    """(y, dx, dw1, dw2, dtw) of moe_ffn on ``backend``."""
    xs = [t.clone().requires_grad_() for t in leaves(case)]
    y = moe_ffn(*xs, case["ids"], backend=backend)
    return (y,) + torch.autograd.grad(y, xs, case["dy"])


def oracle(case):
    """The float64 reference: (y, dx, dw1, dw2, dtw)."""
    return fp64_oracle(reference.moe_ffn, leaves(case), case["dy"], case["ids"].cpu())


def baseline(case):
    """Plain PyTorch (the reference) in the case's own precision, on the CPU."""
    return run_with_grads(reference.moe_ffn, leaves(case), case["dy"], case["ids"].cpu())


def check(got, case, names=OUTPUTS):
    """The tolerance rule for every output and gradient of a moe_ffn run."""
    assert_all_close(names, got, oracle(case), baseline(case), case["x"].dtype)


def assert_deterministic(case, backend):
    """Two runs give bitwise-equal outputs and gradients, and so does the inference forward
    (nothing saved for backward)."""
    a, b = run(case, backend), run(case, backend)
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    with torch.no_grad():
        y = moe_ffn(case["x"], case["w1"], case["w2"], case["tw"], case["ids"], backend=backend)
    assert torch.equal(y, a[0])


def skewed_ids(kind, T, E, k):
    """Ids of a routing of ``smelt_kernels.testing.moe_ids``: "one_expert" (every token on
    expert E-1, k = 1) or "first_k" (every token on the same k experts: the rest get none)."""
    return testing.moe_ids(T, E, k, kind)


def grouped_case(dtype, device, gather):
    g = torch.Generator().manual_seed(1)
    E, N, K, Ma = 5, 19, 23, 37
    a = torch.randn(Ma, K, generator=g).to(device, dtype)
    b = (torch.randn(E, N, K, generator=g) * K**-0.5).to(device, dtype)
    ends = torch.tensor(
        [4, 4, 15, 30, 33], dtype=torch.int32, device=device
    )  # empty group, tail rows
    idx = torch.randint(0, Ma, (36,), generator=g).to(device) if gather else None
    dc = torch.randn(36 if gather else Ma, N, generator=g).to(device, dtype)
    return a, b, ends, idx, dc


def grouped_loop(a, b, ends, idx):
    """c = A @ b[e]^T per group by a plain loop (the grouped GEMM's oracle)."""
    rows = a if idx is None else a[idx.long()]
    starts = [0] + ends.tolist()
    out = torch.zeros(rows.shape[0], b.shape[1], dtype=a.dtype)
    for e in range(b.shape[0]):
        out[starts[e] : starts[e + 1]] = rows[starts[e] : starts[e + 1]] @ b[e].t()
    return out
