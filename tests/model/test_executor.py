"""The looped-block executor: plans, activation recompute, memory, capture fallback."""

import warnings

import pytest
import torch
from helpers import micro_config

from smelt_model import presets
from smelt_model.config import LoopSpec, ModelConfig, middle_loop
from smelt_model.executor import (
    CapturedCall,
    Executor,
    LoopSchedule,
    activation_memory,
    maybe_capture,
)
from smelt_model.model import SmeltLM


def micro(loop=LoopSpec(1, 2, 2)):
    return micro_config(loop)


def test_plan_for_the_paper_loop():
    plan = LoopSchedule(12, middle_loop(12))
    assert plan.pairs() == (
        tuple((i, 0) for i in range(3))
        + tuple((i, 0) for i in range(3, 9))
        + tuple((i, 1) for i in range(3, 9))
        + tuple((i, 0) for i in range(9, 12))
    )
    assert [s.slot for s in plan.steps] == list(range(18))
    assert {s.scale for s in plan.span} == {0.5}
    assert {s.scale for s in plan.prelude + plan.coda} == {1.0}
    assert len(plan.prelude) == 3 and len(plan.span) == 12 and len(plan.coda) == 3


@pytest.mark.parametrize(
    "L,loop", [(5, LoopSpec(0, 5, 3)), (3, LoopSpec(2, 1, 1)), (6, LoopSpec(1, 1, 5)), (4, None)]
)
def test_plan_any_span_and_count(L, loop):
    plan = LoopSchedule(L, loop)
    cfg = ModelConfig(
        vocab_size=8,
        hidden_size=8,
        n_layers=L,
        n_heads=1,
        n_kv_heads=1,
        head_dim=8,
        n_experts=2,
        expert_size=4,
        top_k=1,
        loop=loop,
    )
    assert plan.pairs() == cfg.schedule.pairs()
    assert plan.executed_layers == cfg.executed_layers


def test_plan_rejects_bad_loops():
    with pytest.raises(ValueError, match="does not fit"):
        LoopSchedule(4, LoopSpec(3, 2, 2))
    with pytest.raises(ValueError, match="n_layers"):
        LoopSchedule(0, None)
    with pytest.raises(ValueError, match="recompute"):
        Executor(LoopSchedule(4, None), recompute="half")


def _loss_and_grads(model, ids, seg):
    model.zero_grad(set_to_none=True)
    out = model(ids, seg, labels=ids)
    (out.loss + out.aux_loss).backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_recompute_policies_same_gradients_less_memory():
    torch.manual_seed(0)
    model = SmeltLM(micro(), backend="torch").double()
    ids = torch.randint(0, 97, (2, 20))
    seg = (torch.arange(20) >= 9).long().expand(2, 20).contiguous()
    params = list(model.parameters())
    results, saved = {}, {}
    policies = ("none", "visit1", "all", "all-but-1", "all-but-4")
    for policy in policies:
        model.recompute = policy
        results[policy] = _loss_and_grads(model, ids, seg)
        _, mem = activation_memory(lambda: model(ids, seg, labels=ids).loss, exclude=params)
        saved[policy] = mem.saved_bytes
    loss0, g0 = results["none"]
    for policy in policies[1:]:
        loss, g = results[policy]
        torch.testing.assert_close(loss, loss0, rtol=0, atol=0)
        for n in g0:
            torch.testing.assert_close(g[n], g0[n], rtol=1e-12, atol=1e-14)
    assert saved["all"] < saved["visit1"] < saved["none"], saved
    # the more layers kept, the more is saved; all-but-4 keeps as many as visit1 recomputes
    assert saved["all"] < saved["all-but-1"] < saved["all-but-4"] < saved["none"], saved


def test_recompute_all_but_n_checkpoints_all_but_the_last_n_executed_layers():
    from smelt_model import executor

    model = SmeltLM(micro(), backend="torch")  # prelude 0, span 1-2 x2, coda 3: 6 executed
    assert model.schedule.recomputed("all-but-2") == frozenset({0, 1, 2, 3})
    assert model.schedule.recomputed("visit1") == frozenset({1, 2})
    assert model.schedule.recomputed("all") == frozenset(range(6))
    ran = []
    stock = executor.checkpoint

    def counting(fn, x, ctx, step, **kw):
        ran.append(step.slot)
        return stock(fn, x, ctx, step, **kw)

    executor.checkpoint = counting
    try:
        model.recompute = "all-but-2"
        model(torch.randint(0, 97, (1, 8)), labels=torch.randint(0, 97, (1, 8))).loss.backward()
    finally:
        executor.checkpoint = stock
    assert ran == [0, 1, 2, 3]
    for bad, error in (("all-but-6", ValueError), ("all-but-x", ValueError), (2, TypeError)):
        with pytest.raises(error, match="recompute"):
            model.recompute = bad
    assert model.recompute == "all-but-2"  # a refused policy changes nothing


def test_activation_memory_counts_saved_tensors_once():
    a = torch.randn(100, 100, requires_grad=True)

    def f():
        b = a.exp()  # saves its output
        return (b * b).sum()  # saves b (the same storage) twice

    _, mem = activation_memory(f, exclude=[a])
    assert mem.saved_bytes == 100 * 100 * 4
    assert mem.saved_tensors >= 2 and mem.peak_allocated_bytes is None


def test_activation_memory_frees_the_graph_and_keeps_backward_working():
    """The measured forward's graph is freed with its output (a saved output handed back as
    itself would refer to its own grad_fn: a cycle the collector cannot break, which kept
    every parameter and activation of a measured model alive), and backward through it still
    gives the plain gradients."""
    import gc
    import weakref

    ids = torch.randint(0, 97, (2, 12))
    torch.manual_seed(0)
    model = SmeltLM(micro(), backend="torch")
    loss, mem = activation_memory(
        lambda: model(ids, labels=ids).loss,  # noqa: F821 (model is deleted below)
        exclude=list(model.parameters()),
    )
    assert mem.saved_bytes > 0
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    model(ids, labels=ids).loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=0, atol=0)

    _ = activation_memory(lambda: model(ids, labels=ids).loss)  # noqa: F821
    alive = weakref.ref(model.embed.weight)
    del model, loss, _, p
    gc.collect()
    assert alive() is None


def test_capture_falls_back_to_eager_on_cpu():
    model = SmeltLM(micro(), backend="torch")
    ids = torch.randint(0, 97, (1, 8))
    with pytest.warns(RuntimeWarning, match="needs CUDA tensors; running eagerly"):
        step = maybe_capture(lambda x: model(x).logits, [ids])
    assert step.graph is None and "eagerly" in step.reason
    torch.testing.assert_close(step(ids), model(ids).logits)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert maybe_capture(lambda x: x, [ids], capture=False)(ids) is ids
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a CUDA device"):
            CapturedCall(lambda x: x, [ids])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a CUDA GPU")
def test_cuda_graph_capture_of_forward_and_train_step():
    torch.manual_seed(0)
    cfg = presets.get("tiny-smelt")
    model = SmeltLM(cfg).cuda()
    ids = torch.randint(0, cfg.vocab_size, (2, 64), device="cuda")
    seg = (torch.arange(64, device="cuda") >= 23).long().expand(2, 64).contiguous()
    with torch.no_grad():
        eager = model(ids, seg).logits
        fwd = maybe_capture(lambda i, s: model(i, s).logits, [ids, seg])
        assert fwd.graph is not None, getattr(fwd, "reason", "")
        torch.testing.assert_close(fwd(ids, seg), eager, rtol=1e-4, atol=1e-4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True)

    def train_step(i, s):
        out = model(i, s, labels=i)
        (out.loss + out.aux_loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return out.loss.detach()

    step = maybe_capture(train_step, [ids, seg])
    assert step.graph is not None, getattr(step, "reason", "")
    losses = [step(ids, seg).item() for _ in range(5)]
    assert losses[-1] < losses[0]


def test_plan_answers_the_config_ledger_and_matcher():
    from smelt_model import budget

    cfg = micro(loop=LoopSpec(1, 2, 3))
    plan = LoopSchedule.from_config(cfg)
    assert cfg.schedule.pairs() == plan.pairs() == cfg.schedule.pairs()
    assert [cfg.residual_scale(i) for i in range(4)] == [plan.residual_scale(i) for i in range(4)]
    assert plan.residual_scale(2) == pytest.approx(1 / 3) and plan.residual_scale(3) == 1.0
    assert [s.visit for s in plan.visits(1)] == [0, 1, 2] and len(plan.visits(0)) == 1
    assert budget.ledger(cfg).executed_layers == plan.executed_layers == 8
    with pytest.raises(IndexError, match="layer 4"):
        plan.residual_scale(4)
