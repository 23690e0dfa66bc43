"""Calls that autograd does not record (inference, decode) run the native CPU ops directly,
without the Python custom ops: the same numbers, bitwise, as the recorded path, the same
errors, and traceable by torch.compile through the native ops' fake kernels."""

import pytest
import torch
from helpers_attention import make_inputs, make_segments
from helpers_moe import has_cpu_kernel, make_case, skewed_ids

from smelt_kernels.attention import cpu as attention_cpu
from smelt_kernels.attention import segment_attention
from smelt_kernels.moe_gemm import cpu as moe_cpu
from smelt_kernels.moe_gemm import moe_ffn, route

needs_moe = pytest.mark.skipif(not has_cpu_kernel(), reason="no native CPU MoE kernel")
needs_attention = pytest.mark.skipif(
    attention_cpu.inference_missing(torch.float32, 64) is not None,
    reason="no native CPU attention inference entry point",
)


def _ops_called(fn):
    """Names of the operators ``fn`` dispatched."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}


@needs_moe
@pytest.mark.parametrize("kind", ["uniform", "one_expert", "first_k"])
def test_route_and_moe_without_grad_match_the_recorded_path(kind):
    T, H, de, E = 13, 24, 16, 8
    k = 1 if kind == "one_expert" else 2
    ids = None if kind == "uniform" else skewed_ids(kind, T, E, k)
    case = make_case(T, H, de, E, k, torch.float32, ids=ids, seed=3)
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        w0, i0 = route(logits, k)
        y0 = moe_ffn(case["x"], case["w1"], case["w2"], case["tw"], case["ids"])
        called = _ops_called(
            lambda: moe_ffn(case["x"], case["w1"], case["w2"], case["tw"], case["ids"])
        )
        assert "smelt_cpu::moe_ffn_fwd" in called and "smelt::moe_ffn_fwd" not in called
        called = _ops_called(lambda: route(logits, k))
        assert "smelt_cpu::moe_route_fwd" in called and "smelt::route_fwd" not in called
    leaves = [
        t.clone().requires_grad_() for t in (logits, case["x"], case["w1"], case["w2"], case["tw"])
    ]
    w1_, i1 = route(leaves[0], k)
    y1 = moe_ffn(*leaves[1:], case["ids"])
    assert y1.requires_grad and w1_.requires_grad
    assert torch.equal(w0, w1_.detach()) and torch.equal(i0, i1)
    assert torch.equal(y0, y1.detach())
    # a tensor that requires grad under no_grad takes the direct path too
    with torch.no_grad():
        assert torch.equal(moe_ffn(*leaves[1:], case["ids"]), y0)


@needs_moe
def test_moe_without_grad_rejects_bad_ids_before_any_work():
    case = make_case(4, 16, 8, 4, 2, torch.float32)
    bad = case["ids"].clone()
    bad[1, 0] = 9
    with torch.no_grad(), pytest.raises(ValueError, match="topk_ids must lie in"):
        moe_ffn(case["x"], case["w1"], case["w2"], case["tw"], bad)


@needs_attention
@pytest.mark.parametrize(
    "layout,dtype,Tq",
    [("mixed", torch.float32, 1), ("none", torch.float32, 7), ("mixed", torch.bfloat16, 33)],
)
def test_attention_without_grad_matches_the_recorded_path(layout, dtype, Tq):
    B, Tk, hq, hkv, D = 2, 45, 6, 2, 64
    q, k, v, _ = make_inputs(B, Tq, Tk, hq, hkv, D, dtype, "cpu", seed=Tq)
    seg = make_segments(layout, B, Tk, seed=Tq)
    with torch.no_grad():
        o0, lse0 = segment_attention(q, k, v, seg, return_lse=True)
        called = _ops_called(lambda: segment_attention(q, k, v, seg))
        assert "smelt_cpu::segment_attention_infer" in called
        assert "smelt::segment_attention_fwd" not in called
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o1, lse1 = segment_attention(*leaves, seg, return_lse=True)
    assert o1.requires_grad
    assert torch.equal(o0, o1.detach()) and torch.equal(lse0, lse1)
    # the sink statistic still comes from the custom op, with the same o
    with torch.no_grad():
        o2, sink = segment_attention(q, k, v, seg, return_sink=True)
    assert torch.equal(o2, o0) and torch.isfinite(sink).all()


@needs_attention
def test_attention_without_grad_rejects_decreasing_ids():
    q, k, v, _ = make_inputs(1, 4, 8, 2, 1, 16, torch.float32, "cpu")
    seg = torch.tensor([[0, 0, 1, 1, 2, 1, 3, 3]])
    with (
        torch.no_grad(),
        pytest.raises(ValueError, match="non-decreasing.*row 0 goes from 2 at position 4"),
    ):
        segment_attention(q, k, v, seg)


@needs_moe
@needs_attention
def test_native_op_fakes_pass_opcheck():
    logits = torch.randn(9, 16)
    case = make_case(6, 16, 8, 4, 2, torch.float32)
    q, k, v, _ = make_inputs(2, 3, 11, 4, 2, 16, torch.float32, "cpu")
    seg = make_segments("mixed", 2, 11)
    start = torch.ops.smelt_cpu.segment_starts(seg)
    for op, args in (
        (torch.ops.smelt_cpu.moe_route_fwd.default, (logits, 4, True, False)),
        (torch.ops.smelt_cpu.moe_route_fwd.default, (logits, 4, False, True)),
        (
            torch.ops.smelt_cpu.moe_ffn_fwd.default,
            (case["x"], case["w1"], case["w2"], case["tw"], case["ids"].int(), False),
        ),
        (torch.ops.smelt_cpu.segment_starts.default, (seg,)),
        (torch.ops.smelt_cpu.segment_attention_infer.default, (q, k, v, start, 0.25)),
        (torch.ops.smelt_cpu.segment_attention_infer.default, (q, k, v, None, 0.25)),
    ):
        torch.library.opcheck(op, args)


@needs_moe
@needs_attention
def test_inference_calls_compile_as_one_graph():
    H, E, de, k, hq, hkv, D = 32, 8, 16, 2, 4, 2, 16
    g = torch.Generator().manual_seed(5)
    router = torch.randn(E, H, generator=g)
    w1 = torch.randn(E, 2 * de, H, generator=g) * H**-0.5
    w2 = torch.randn(E, H, de, generator=g) * de**-0.5
    wq = torch.randn(hq * D, H, generator=g) * H**-0.5

    def f(x, kv, seg):
        B, T, _ = x.shape
        q = (x @ wq.t()).view(B, T, hq, D)
        a = segment_attention(q, kv, kv, seg).reshape(B * T, -1)[:, :H]
        w, ids = route(x.reshape(B * T, H) @ router.t(), k)
        return moe_ffn(x.reshape(B * T, H) + a, w1, w2, w, ids)

    x = torch.randn(2, 5, H, generator=g)
    kv = torch.randn(2, 9, hkv, D, generator=g)
    seg = make_segments("mixed", 2, 9, seed=2)[:, :9]
    torch._dynamo.reset()
    with torch.no_grad():
        want = f(x, kv, seg)
        got = torch.compile(f, fullgraph=True, backend="aot_eager")(x, kv, seg)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert moe_cpu.missing("moe_route_fwd") is None
