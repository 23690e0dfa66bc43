"""torch.compile(fullgraph=True) traces the SMELT model on the CPU: no graph breaks, hence
no host synchronisation in the model, the executor or the ops."""

import torch

from smelt_model import presets
from smelt_model.model import SmeltLM


def _batch(cfg, T=32):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=g)
    seg = (torch.arange(T) >= 11).long()[None]
    return ids, seg


def test_compile_fullgraph_forward_inductor():
    """The default compiler (inductor, generated C++ on the CPU) on the tiny SMELT forward."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = presets.get("tiny-smelt")
    model = SmeltLM(cfg).eval()
    ids, seg = _batch(cfg)
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        got = compiled(ids, seg).logits
        want = model(ids, seg).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_compile_fullgraph_training_step():
    """Forward with loss and router losses, then backward, traced as one graph."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = presets.get("tiny-smelt")
    model = SmeltLM(cfg, recompute="visit1")
    ids, seg = _batch(cfg)

    def loss_fn(i, s):
        out = model(i, s, labels=i)
        return out.loss + out.aux_loss

    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    loss_c = compiled(ids, seg)
    loss_c.backward()
    grads_c = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    loss_e = loss_fn(ids, seg)
    loss_e.backward()
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads_c[n], p.grad, rtol=1e-4, atol=1e-5)


def test_every_operator_fake_describes_its_real_outputs():
    """Each op's edge cases (smelt_kernels.testing.EDGES, built as the self-test builds them)
    on the CPU backends, forward and backward: every smelt operator reached gives outputs
    whose sizes and strides its fake predicts (what inductor plans its buffers from)."""
    from torch._subclasses.fake_utils import CrossRefFakeMode

    from smelt_tools.selftest.cases import CASES

    def ours(op):
        return op.namespace in ("smelt", "smelt_cpu")

    with CrossRefFakeMode(ignore_op_fn=lambda op: not ours(op)):
        for build in CASES.values():
            for case in build():
                for backend in ("cpu", "torch"):
                    t = case.inputs(torch.float32, "cpu", grad=True)
                    heads = [o for o in case.call(backend, t)[: case.grad_outputs]]
                    heads = [h for h in heads if h.requires_grad]
                    if heads:
                        leaves = [t[n] for n in case.differentiable]
                        ups = [torch.ones_like(h) for h in heads]
                        torch.autograd.grad(heads, leaves, ups, allow_unused=True)
