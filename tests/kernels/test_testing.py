"""smelt_kernels.testing: the one tolerance rule (NaN never passes; an error over twice plain
torch's plus the floor fails) and the one list of edge cases per op, which the self-test and
the tests both run."""

import math

import pytest
import torch

from smelt_kernels import backends, testing
from smelt_tools.selftest.cases import CASES


def test_the_rule_lets_no_nan_through():
    ref = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    plain = ref + 4e-3  # plain torch's error in bf16
    near = (ref + 6e-3).to(torch.bfloat16)
    norm, why = testing.compare("y", near, ref, plain, torch.bfloat16)
    assert why is None and 0 < norm <= 1
    norm, why = testing.compare("y", (ref + 0.05).float(), ref, plain, torch.bfloat16)
    assert norm > 1 and "max error" in why
    bad = ref.clone()
    bad[1] = math.nan
    norm, why = testing.compare("y", bad, ref, plain, torch.bfloat16)
    assert norm == math.inf and "1 NaN or inf values" in why
    norm, why = testing.compare(
        "ids", torch.tensor([1, 2]), torch.tensor([1, 3]), None, torch.float32, exact=True
    )
    assert norm == math.inf and "1 of 2 values differ" in why
    norm, why = testing.compare("y", ref[:2], ref, plain, torch.float32)
    assert norm == math.inf and "shape" in why


def test_bound_is_twice_plain_torch_plus_the_floor():
    eps = torch.finfo(torch.bfloat16).eps
    assert testing.bound(1e-2, 3.0, torch.bfloat16) == pytest.approx(2e-2 + 2 * eps * 3.0)
    assert testing.bound(0.0, 0.5, torch.float32) == pytest.approx(1e-5)  # the floor's minimum
    # an fp32 output of bf16 inputs, computed in fp32 whatever the inputs: float32's floor
    assert testing.bound(0.0, 1.0, torch.bfloat16, torch.float32) == pytest.approx(1e-5)


def test_assert_close_raises_with_what_failed():
    ref = torch.ones(4, dtype=torch.float64)
    testing.assert_close("y", ref.float(), ref, ref.float())
    with pytest.raises(AssertionError, match="y: max error 1.000e-01 > bound"):
        testing.assert_close("y", (ref + 0.1).float(), ref, ref.float())
    with pytest.raises(AssertionError, match="NaN or inf"):
        testing.assert_close("y", torch.full((4,), math.nan), ref, ref.float())


def test_edge_cases_cover_every_shipped_op_and_mark_one_smoke_case():
    report = backends.report("cpu")
    assert set(testing.EDGES) == set(CASES) and set(testing.EDGES) <= set(report)
    for op, edges in testing.EDGES.items():
        names = [e.name for e in edges]
        assert len(set(names)) == len(names), op
        assert sum(e.quick for e in edges) == 1, op
        assert [c.name for c in CASES[op]()] == names  # the self-test runs exactly these
    moe = {e.name: e for e in testing.EDGES["moe_ffn"]}
    assert {"T=1", "experts with no tokens", "all tokens on one expert", "T=0"} <= set(moe)
    att = {e.name for e in testing.EDGES["segment_attention"]}
    assert {"length-1 segments", "one segment filling the context, GQA 2:1"} <= att


def test_routings_and_segment_layouts():
    assert testing.moe_ids(3, 6, 2, "first_k").tolist() == [[1, 0]] * 3
    assert testing.moe_ids(2, 4, 1, "one_expert").tolist() == [[3], [3]]
    ids = testing.moe_ids(5, 7, 3, None, torch.Generator().manual_seed(0))
    assert ids.dtype == torch.int32 and all(len(set(r)) == 3 for r in ids.tolist())
    for layout in testing.SEGMENT_LAYOUTS:
        seg = testing.segment_ids(layout, 3, 40, seed=1)
        assert seg.shape == (3, 40) and bool((seg[:, 1:] >= seg[:, :-1]).all()), layout
    assert testing.segment_ids("ones", 1, 5).unique().numel() == 5
    assert testing.segment_ids("one", 2, 5)[0].unique().numel() == 1
    assert testing.segment_ids((2, 3), 2, 5)[0].tolist() == [-3, -3, -1, -1, -1]
    assert testing.segment_ids(None, 2, 5) is None
    with pytest.raises(ValueError, match="do not sum"):
        testing.segment_ids((2, 2), 1, 5)
