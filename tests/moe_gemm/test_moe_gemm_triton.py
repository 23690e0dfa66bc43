"""moe_gemm on the "triton" backend (the interpreter on CPU: 16-wide tiles, so small shapes
cross many tile edges) and, on a GPU machine, the "triton" and "cuda" kernels on the
device: against the fp64 reference, skewed routings, determinism, id checks before the
launch and CUDA-graph capture."""

import pytest
import torch
from helpers_moe import DTYPES, assert_deterministic, check, make_case, run, skewed_ids

from smelt_kernels import backends
from smelt_kernels.moe_gemm import moe_ffn

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TRITON_CASES = [
    ((1, 16, 8, 1, 1), torch.float32),
    ((7, 24, 12, 8, 2), torch.float16),
    ((7, 20, 9, 64, 8), torch.bfloat16),
    ((63, 20, 12, 64, 8), torch.float32),
    ((63, 18, 10, 8, 8), torch.float16),
    ((200, 16, 8, 288, 8), torch.float32),
    ((200, 17, 11, 8, 1), torch.bfloat16),
]


@pytest.mark.parametrize("shape,dtype", TRITON_CASES, ids=str)
def test_triton_matches_reference(shape, dtype, triton_device):
    case = make_case(*shape, dtype, device=triton_device)
    check(run(case, "triton"), case)


@pytest.mark.parametrize("kind,k", [("one_expert", 1), ("first_k", 8)])
def test_triton_skewed_routing(kind, k, triton_device):
    T, H, de, E = 40, 20, 12, 8
    case = make_case(
        T, H, de, E, k, torch.float32, device=triton_device, ids=skewed_ids(kind, T, E, k)
    )
    check(run(case, "triton"), case)


def test_triton_bitwise_deterministic(triton_device):
    assert_deterministic(make_case(40, 24, 12, 8, 4, torch.float32, device=triton_device), "triton")


# ----------------------------------------------------------------------------- GPU only
def _skip_without(name):
    reason = backends.implementation("moe_ffn", name).unavailable("cuda")
    if reason is not None:
        pytest.skip(reason)


@needs_gpu
@pytest.mark.parametrize("name", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape", [(200, 256, 64, 288, 8), (63, 72, 40, 8, 2), (1, 64, 32, 1, 1)], ids=str
)
def test_gpu_matches_reference(name, dtype, shape):
    _skip_without(name)
    if name == "cuda" and dtype == torch.float32:
        pytest.skip("the CUDA kernels take bf16 and fp16")
    case = make_case(*shape, dtype, device="cuda")
    check(run(case, name), case)


@needs_gpu
@pytest.mark.parametrize("name", ["triton", "cuda"])
def test_gpu_bad_ids_rejected_before_launch_unless_unchecked(name):
    _skip_without(name)
    ids = torch.tensor([[0, 1], [2, 4], [3, 3]], dtype=torch.int32, device="cuda")
    case = make_case(3, 64, 32, 4, 2, torch.bfloat16, device="cuda", ids=ids)
    args = (case["x"], case["w1"], case["w2"], case["tw"])
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        moe_ffn(*args, case["ids"], backend=name)
    ids[1, 1] = 1
    with pytest.raises(ValueError, match="twice in token 2"):
        moe_ffn(*args, ids, backend=name)
    # unchecked: the documented policy (an expert named twice is applied twice)
    y = moe_ffn(*args, ids, backend=name, check_values=False)
    assert torch.isfinite(y).all()


@needs_gpu
def test_gpu_forward_is_graph_capturable_and_deterministic():
    case = make_case(512, 128, 64, 64, 8, torch.bfloat16, device="cuda")
    args = (case["x"], case["w1"], case["w2"], case["tw"], case["ids"])
    first = moe_ffn(*args, backend="triton")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_ffn(*args, backend="triton")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, first)
    a, b = run(case, "triton"), run(case, "triton")
    for u, v in zip(a, b):
        assert torch.equal(u, v)
