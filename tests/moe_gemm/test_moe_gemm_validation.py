"""moe_gemm input validation: one error class per kind of failure (non-tensor and dtype:
TypeError; shape, rank, device and values: ValueError; unknown backend name: ValueError;
a backend that cannot run: BackendUnavailableError), raised before any kernel runs."""

import pytest
import torch
from helpers_moe import has_cpu_kernel, make_case

from smelt_kernels import backends
from smelt_kernels.moe_gemm import moe_ffn


def _call(**over):
    case = make_case(5, 8, 4, 4, 2, torch.float32)
    args = dict(
        x=case["x"], w1=case["w1"], w2=case["w2"], topk_weights=case["tw"], topk_ids=case["ids"]
    )
    args.update(over)
    return moe_ffn(**args)


@pytest.mark.parametrize(
    "over, err, match",
    [
        (dict(x=torch.randn(5, 8, 1)), ValueError, "x must have 2 dims"),
        (dict(w1=torch.randn(4, 7, 8)), ValueError, "w1"),
        (dict(w1=torch.randn(4, 8, 9)), ValueError, "w1"),
        (dict(w2=torch.randn(4, 8, 5)), ValueError, "w2"),
        (dict(topk_weights=torch.rand(4, 2)), ValueError, "topk_weights"),
        (dict(topk_ids=torch.zeros(5, 3, dtype=torch.int32)), ValueError, "topk_ids"),
        (dict(topk_ids=torch.zeros(5, 2)), TypeError, "topk_ids must be int32"),
        (dict(topk_weights=torch.ones(5, 2, dtype=torch.int32)), TypeError, "topk_weights"),
        (dict(x=torch.randn(5, 8, dtype=torch.float64)), TypeError, "w1 must have x's dtype"),
        (dict(x=torch.randn(5, 8, device="meta")), ValueError, "is on"),
        (
            dict(topk_ids=torch.zeros(5, 5, dtype=torch.int32), topk_weights=torch.rand(5, 5)),
            ValueError,
            "k=5",
        ),
        (dict(w1="w1"), TypeError, "w1 must be a torch.Tensor"),
        (dict(topk_ids=[[0, 1]] * 5), TypeError, "topk_ids must be a torch.Tensor"),
    ],
)
def test_rejects_bad_shapes_and_types(over, err, match):
    with pytest.raises(err, match=match):
        _call(**over)


def _backends_here():
    names = ["torch"]
    if has_cpu_kernel():
        names.append("cpu")
    if backends.triton_interpret() and not torch.cuda.is_available():
        names.append("triton")
    return names


@pytest.mark.parametrize("name", _backends_here())
@pytest.mark.parametrize(
    "ids, match",
    [
        ([[0, 4], [1, 2]], r"\[0, 4\)"),
        ([[0, -1], [1, 2]], r"\[0, 4\)"),
        ([[3, 3], [1, 2]], "twice"),
    ],
)
def test_rejects_bad_id_values(name, ids, match):
    T, H, de, E = 2, 8, 4, 4
    case = make_case(T, H, de, E, 2, torch.float32, ids=torch.tensor(ids, dtype=torch.int32))
    with pytest.raises(ValueError, match=match):
        moe_ffn(case["x"], case["w1"], case["w2"], case["tw"], case["ids"], backend=name)


def test_check_values_flag():
    case = make_case(
        2, 8, 4, 4, 2, torch.float32, ids=torch.tensor([[0, 4], [1, 2]], dtype=torch.int32)
    )
    args = (case["x"], case["w1"], case["w2"], case["tw"], case["ids"])
    with pytest.raises(TypeError, match="check_values must be None or a bool"):
        moe_ffn(*args, check_values="yes")
    # CPU tensors are always checked: skipping the check is only for device reads
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        moe_ffn(*args, check_values=False)


def test_rejects_unknown_or_unavailable_backend():
    case = make_case(3, 8, 4, 4, 2, torch.float32)
    args = (case["x"], case["w1"], case["w2"], case["tw"], case["ids"])
    with pytest.raises(ValueError, match="backend must be one of"):
        moe_ffn(*args, backend="tpu")
    with pytest.raises(backends.BackendUnavailableError):
        moe_ffn(*args, backend="cuda")
    c64 = make_case(3, 8, 4, 4, 2, torch.float64)
    names = (["cpu"] if has_cpu_kernel() else []) + (
        ["triton"] if backends.triton_interpret() else []
    )
    for name in names:  # a dtype the chosen backend does not take
        with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
            moe_ffn(c64["x"], c64["w1"], c64["w2"], c64["tw"], c64["ids"], backend=name)


def test_compiled_call_with_int64_ids_traces_and_still_refuses_wide_ids():
    """int64 ids are checked before they narrow to int32; compiled, without the host read
    that would break the graph, an id past int32 still reaches the op's check out of range
    (never as the id it wraps to)."""
    case = make_case(2, 8, 4, 4, 2, torch.float32)
    args = (case["x"], case["w1"], case["w2"], case["tw"])
    fn = torch.compile(moe_ffn, fullgraph=True, backend="eager")
    ok = torch.tensor([[0, 1], [2, 3]])
    torch.testing.assert_close(fn(*args, ok), moe_ffn(*args, ok))
    wide = torch.tensor([[0, 2**32 + 1], [2, 3]])  # 2**32 + 1 narrows to 1
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        fn(*args, wide)
    torch._dynamo.reset()
