"""The block pool of the native CPU kernels (csrc/cpu_pool.h): the MoE's large outputs are
handed out again once freed, never while a tensor or a view still uses them; its cap, its
off switch, release, frees from other threads, and unchanged results."""

import threading

import pytest
import torch
from helpers_moe import has_cpu_kernel

from smelt_kernels.moe_gemm import cpu_pool_stats, moe_ffn, release_cpu_pool, route

pytestmark = pytest.mark.skipif(
    not has_cpu_kernel() or cpu_pool_stats() is None,
    reason="smelt_kernels._cpu without the block pool",
)

# dW1 (E, 2 d_e, H) is 8 MiB and dW2 4 MiB: both at least the pool's 4 MiB threshold
T, H, DE, E, K = 256, 256, 64, 64, 4


def _case():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, H, generator=g).requires_grad_()
    w1 = (torch.randn(E, 2 * DE, H, generator=g) * H**-0.5).requires_grad_()
    w2 = (torch.randn(E, H, DE, generator=g) * DE**-0.5).requires_grad_()
    w, ids = route(torch.randn(T, E, generator=g), K, True)
    return x, w1, w2, w.requires_grad_(), ids


def _grads(case):
    x, w1, w2, w, ids = case
    y = moe_ffn(x, w1, w2, w, ids, backend="cpu", check_values=False)
    return torch.autograd.grad(y, (x, w1, w2, w), torch.ones_like(y))


@pytest.fixture(autouse=True)
def _fresh_pool(monkeypatch):
    monkeypatch.delenv("SMELT_CPU_POOL_MB", raising=False)
    release_cpu_pool()
    yield
    release_cpu_pool()


def test_freed_blocks_are_reused_and_results_unchanged():
    case = _case()
    first = _grads(case)
    ref = [g.clone() for g in first]
    ptr = first[1].data_ptr()
    del first
    held = cpu_pool_stats()["held_bytes"]
    assert held >= 8 << 20
    before = cpu_pool_stats()["reused"]
    second = _grads(case)
    assert cpu_pool_stats()["reused"] > before
    assert ptr in {g.data_ptr() for g in second}
    for a, b in zip(second, ref):
        assert not a.isnan().any()
        assert torch.equal(a, b)


def test_live_tensor_and_views_keep_their_blocks():
    case = _case()
    first = _grads(case)
    dw1, dw2 = first[1], first[2]
    kept_dw1 = dw1.clone()
    row = dw2[3]  # a view: keeps dw2's block alive after dw2 itself is dropped
    kept_row = row.clone()
    ptrs = {dw1.data_ptr(), dw2.data_ptr()}
    del first, dw2
    second = _grads(case)
    assert not ptrs & {g.data_ptr() for g in second}
    assert torch.equal(dw1, kept_dw1) and torch.equal(row, kept_row)


def test_cap_and_off_switch(monkeypatch):
    case = _case()
    monkeypatch.setenv("SMELT_CPU_POOL_MB", "4")  # less than dW1's 8 MiB block
    grads = _grads(case)
    del grads
    assert cpu_pool_stats()["held_bytes"] <= 4 << 20
    release_cpu_pool()
    monkeypatch.setenv("SMELT_CPU_POOL_MB", "0")
    fresh = cpu_pool_stats()["fresh"]
    grads = _grads(case)
    del grads
    stats = cpu_pool_stats()
    assert stats["fresh"] == fresh and stats["held_bytes"] == 0


def test_release_and_frees_from_another_thread():
    case = _grads(_case())
    box = [case]
    del case
    t = threading.Thread(target=box.clear)  # the last references die on another thread
    t.start()
    t.join()
    assert cpu_pool_stats()["held_bytes"] >= 12 << 20
    assert release_cpu_pool() >= 12 << 20
    assert cpu_pool_stats()["held_bytes"] == 0


def test_training_steps_with_pooled_grads():
    """Gradients autograd stores as .grad (the pooled tensors themselves) and accumulates into
    them, with zero_grad either way: the same as two fresh backward passes."""
    x, w1, w2, w, ids = _case()
    ref = _grads((x, w1, w2, w, ids))[1]
    for set_to_none in (True, False, True):
        for _ in range(2):
            y = moe_ffn(x, w1, w2, w.detach(), ids, backend="cpu", check_values=False)
            y.sum().backward()
        torch.testing.assert_close(w1.grad, 2 * ref, rtol=1e-6, atol=1e-6)
        w1.grad = None if set_to_none else w1.grad.zero_()
        x.grad = w2.grad = None
