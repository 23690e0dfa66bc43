"""smelt_tools.account: every profiled event of a step lands in the part of the module it ran
in, a backward node in the part of the forward op that recorded it, named events by their
prefix, and the step's uncovered time in ``untraced``; the scopes leave no hook behind."""

import time

import pytest
import torch
from torch import nn

from smelt_tools.account import account


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        time.sleep(0.06)
        return g


class _A(nn.Module):  # fast forward, a 60 ms backward
    def forward(self, x):
        return _SlowBackward.apply(x)


class _B(nn.Module):  # a 30 ms forward in Python, a sin that is a part of its own
    def forward(self, x):
        time.sleep(0.03)
        return torch.sin(x) * 2.0


def _model_and_step():
    a, b = _A(), _B()
    x = torch.randn(64, 64, requires_grad=True)

    def step():
        y = b(a(x))
        y.sum().backward()
        with torch.autograd.profiler.record_function("Optimizer.step#Fake.step"):
            time.sleep(0.01)
        time.sleep(0.02)  # no event covers this

    return a, b, step


def test_parts_follow_modules_backward_nodes_and_names():
    a, b, step = _model_and_step()
    acc = account(
        step,
        {a: "a", b: "b"},
        ops={"aten::sin": "trig"},
        named={"Optimizer.": "opt"},
        steps=1,
    )
    p = acc.parts_ms
    assert p["a"] >= 60 and p["a"] < 60 + 25  # its backward, linked by sequence number
    assert p["b"] >= 30 and p["b"] < 30 + 25  # its Python time, not a's backward
    assert p["trig"] > 0 and p["opt"] >= 10
    assert acc.untraced_ms >= 20
    only = acc.steps[0]
    assert only.total_ms == pytest.approx(only.wall_ms, rel=0.05)
    assert acc.plain_ms >= 110 and len(acc.steps) == 1
    d = acc.to_dict()
    assert d["steps"] == 1 and d["overhead"] == pytest.approx(acc.profiled_ms / acc.plain_ms - 1)


def test_listed_parts_come_in_order_and_the_others_go_to_the_default():
    a, b, step = _model_and_step()
    acc = account(
        step, {a: "a", b: "b"}, named={"Optimizer.": "opt"}, parts=("b", "a", "x", "rest")
    )
    assert list(acc.parts_ms) == ["b", "a", "x", "rest"]
    assert acc.parts_ms["x"] == 0.0 and acc.parts_ms["rest"] >= 10  # "opt" is not listed
    assert len(acc.steps) == 2


def test_no_hook_is_left_behind():
    a, b, step = _model_and_step()
    account(step, {a: "a", b: "b"}, steps=1)
    for m in (a, b):
        assert not m._forward_hooks and not m._forward_pre_hooks

    calls = []

    def failing():
        calls.append(1)
        if len(calls) > 1:  # the plain call passes, the profiled one raises
            raise RuntimeError("boom")
        step()

    with pytest.raises(RuntimeError, match="boom"):
        account(failing, {a: "a", b: "b"}, steps=1)
    for m in (a, b):
        assert not m._forward_hooks and not m._forward_pre_hooks


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="steps"):
        account(lambda: None, {}, steps=0)
    with pytest.raises(ValueError, match="default"):
        account(lambda: None, {}, parts=("a",))


def test_profiler_start_and_stop_leave_stderr_quiet_and_as_it_was(capfd):
    """torch's profiler writes a line to fd 2 at each start and stop; the account hides them,
    and a line the step itself writes to stderr still reaches it."""
    import os

    a, b, step = _model_and_step()

    def loud_step():
        step()
        os.write(2, b"from the step\n")

    account(loud_step, {a: "a", b: "b"}, steps=2)
    err = capfd.readouterr().err
    assert "profiler_" not in err and "USDT" not in err and "STAGE" not in err
    assert err.count("from the step\n") == 5  # one plain step, then two profiled and plain
