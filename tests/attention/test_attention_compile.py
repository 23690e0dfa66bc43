"""segment_attention under torch.compile with gradients, at every head layout the eager op
takes: the fakes the compiler plans with describe the real outputs, strides included.

The compiler sizes its buffers from an operator's fake and checks the real outputs against
it; a real output in another layout (the CPU backend's chunked path, for head dims that are
not a multiple of 8, once handed back a transposed log-sum-exp or output) fails only in
compiled code with gradients, and only at some head counts. The sweep below checks every
smelt operator a call reaches, fake against real, without compiling; inductor then compiles a
few of the layouts that failed, forward and backward, against eager.
"""

import pytest
import torch
from torch._subclasses.fake_utils import CrossRefFakeMode

from smelt_kernels.attention import segment_attention

#: (query heads, KV heads): 1 to 6 query heads, every KV head count that divides them
HEADS = [(hq, hkv) for hq in range(1, 7) for hkv in range(1, hq + 1) if hq % hkv == 0]
HEAD_DIMS = range(7, 41)


def _inputs(hq, hkv, D, seed=0, T=11):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, T, hq, D, generator=g)
    k, v = torch.randn(2, 2, T, hkv, D, generator=g).unbind(0)
    seg = torch.tensor([[0] * 4 + [1] * 7, [2] * 11])
    return q, k, v, seg


def _smelt_op(op) -> bool:
    return op.namespace in ("smelt", "smelt_cpu")


@pytest.mark.slow
def test_fake_strides_equal_real_ones_for_every_head_layout():
    """Every (Hq, Hkv) with Hq 1-6 and every head dim 7-40: each smelt operator the call and
    its backward reach gives outputs whose sizes and strides its fake predicts."""
    with CrossRefFakeMode(ignore_op_fn=lambda op: not _smelt_op(op)):
        for hq, hkv in HEADS:
            for D in HEAD_DIMS:
                q, k, v, seg = (
                    t.requires_grad_(t.is_floating_point()) for t in _inputs(hq, hkv, D)
                )
                o, lse, sink = segment_attention(q, k, v, seg, return_lse=True, return_sink=True)
                torch.autograd.grad(o, (q, k, v), torch.ones_like(o))


@pytest.mark.parametrize("hq,hkv,D", [(3, 1, 12), (3, 3, 12), (5, 5, 20), (2, 1, 7), (6, 2, 40)])
def test_inductor_forward_backward(hq, hkv, D):
    """The default compiler, forward and backward, gives eager's output and gradients."""
    torch._dynamo.reset()
    q, k, v, seg = _inputs(hq, hkv, D, seed=hq * 100 + D)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))

    def run(fn):
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        o = fn(*xs, seg)
        return (o.detach(),) + torch.autograd.grad(o, xs, do)

    got = run(torch.compile(segment_attention))
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, run(segment_attention)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    torch._dynamo.reset()
