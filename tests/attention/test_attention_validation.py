"""segment_attention input validation: one error class per kind of failure (non-tensor and
dtype, including a dtype the chosen backend does not take: TypeError; shape, rank, device,
values and head dims a kernel cannot take: ValueError; unknown backend name: ValueError; a
backend that cannot run: BackendUnavailableError), raised before any kernel runs; the
segment bounds and the NaN policy for unchecked ids."""

import pytest
import torch
from helpers import triton_device
from helpers_attention import make_inputs

from smelt_kernels import backends
from smelt_kernels.attention import segment_attention, segment_bounds, select_backend

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)


def _qkv(B=1, Tq=8, Tk=8, hq=4, hkv=2, D=16, dtype=torch.float32):
    return make_inputs(B, Tq, Tk, hq, hkv, D, dtype, "cpu")[:3]


BAD_INPUTS = [
    ("q rank", lambda q, k, v: (q[0], k, v, None), ValueError, "q must be 4-D"),
    ("k rank", lambda q, k, v: (q, k[..., None], v, None), ValueError, "k must be 4-D"),
    ("heads", lambda q, k, v: (q[:, :, :3], k, v, None), ValueError, "multiple of k/v heads"),
    (
        "kv shapes",
        lambda q, k, v: (q, k, v[:, :5], None),
        ValueError,
        r"k and v must agree in \(B, Tk, Hkv\)",
    ),
    (
        "batch",
        lambda q, k, v: (q[:1], torch.cat([k, k]), torch.cat([v, v]), None),
        ValueError,
        "batch",
    ),
    ("head dim", lambda q, k, v: (q, k[..., :8], v[..., :8], None), ValueError, "head dim"),
    ("Tq > Tk", lambda q, k, v: (q, k[:, :5], v[:, :5], None), ValueError, "exceeds"),
    ("k dtype", lambda q, k, v: (q, k.half(), v, None), TypeError, "k must have q's dtype"),
    ("int q", lambda q, k, v: (q.long(), k.long(), v.long(), None), TypeError, "floating"),
    ("k device", lambda q, k, v: (q, k.to("meta"), v, None), ValueError, "k is on meta"),
    (
        "ids device",
        lambda q, k, v: (q, k, v, torch.zeros(1, 8, dtype=torch.long, device="meta")),
        ValueError,
        "segment_ids is on meta",
    ),
    ("ids dtype", lambda q, k, v: (q, k, v, torch.zeros(1, 8)), TypeError, "integer tensor"),
    (
        "ids bool",
        lambda q, k, v: (q, k, v, torch.zeros(1, 8, dtype=torch.bool)),
        TypeError,
        "integer tensor",
    ),
    (
        "ids shape",
        lambda q, k, v: (q, k, v, torch.zeros(1, 7, dtype=torch.long)),
        ValueError,
        r"shape \(B, Tk\)",
    ),
    (
        "not a tensor",
        lambda q, k, v: (q.tolist(), k, v, None),
        TypeError,
        "q must be a torch.Tensor",
    ),
    (
        "ids not a tensor",
        lambda q, k, v: (q, k, v, [[0] * 8]),
        TypeError,
        "segment_ids must be a torch.Tensor or None",
    ),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_inputs_raise_clear_errors(case):
    _, build, exc, match = case
    args = build(*_qkv())
    for name in ("torch", "cpu", None):
        with pytest.raises(exc, match=match):
            segment_attention(*args, backend=name)


def _forbid_kernels(monkeypatch):
    """Make every backend's compute raise, to show validation happens first."""

    def boom(*a, **kw):
        raise AssertionError("a kernel ran before validation")

    for impl in backends.implementations("segment_attention"):
        monkeypatch.setitem(
            backends._REGISTRY["segment_attention"],
            impl.backend,
            backends.Implementation(**{**impl.__dict__, "forward": boom}),
        )


def test_decreasing_segment_ids_rejected_before_launch(backend_device, monkeypatch):
    name, dev = backend_device
    q, k, v = (x.to(dev) for x in _qkv())
    seg = torch.tensor([[0, 0, 1, 1, 2, 1, 3, 3]], device=dev)
    _forbid_kernels(monkeypatch)
    with pytest.raises(ValueError, match="non-decreasing.*row 0 goes from 2 at position 4"):
        segment_attention(q, k, v, seg, backend=name)
    if dev.type == "cpu":  # CPU tensors are checked even when the caller opts out
        with pytest.raises(ValueError, match="non-decreasing"):
            segment_attention(q, k, v, seg, backend=name, check_values=False)
    with pytest.raises(TypeError, match="check_values must be None or a bool"):
        segment_attention(q, k, v, seg, backend=name, check_values=1)


def test_kernel_limits_and_backend_choice():
    q, k, v = _qkv(D=20)
    triton, cuda = (backends.implementation("segment_attention", n) for n in ("triton", "cuda"))
    assert "multiple of 8" in triton.feature_reason({"head_dim": 20})
    assert "multiple of 8" in cuda.feature_reason({"head_dim": 20})
    assert triton.feature_reason({"head_dim": 128}) is None
    assert "multiple of 8" in triton.feature_reason({"head_dim": 136})
    assert "takes" in cuda.dtype_reason(torch.float32)
    if triton.unavailable(q.device) is None:
        with pytest.raises(ValueError, match="multiple of 8"):
            segment_attention(q, k, v, backend="triton")
        # a dtype the chosen backend does not take is a TypeError, like any dtype error
        with pytest.raises(TypeError, match="takes float16, bfloat16 or float32"):
            segment_attention(q.double(), k.double(), v.double(), backend="triton")
    with pytest.raises(backends.BackendUnavailableError):
        segment_attention(q, k, v, backend="cuda")
    with pytest.raises(ValueError, match="backend must be one of"):
        segment_attention(q, k, v, backend="tpu")
    with pytest.raises(TypeError, match="scale"):
        segment_attention(q, k, v, scale="0.5")
    with pytest.raises(ValueError, match="scale must be finite"):
        segment_attention(q, k, v, scale=float("inf"))
    assert select_backend(q) == select_backend(q, "auto") == "cpu"
    assert select_backend(q.double()) == "cpu"
    q16 = q[..., :16]
    assert segment_attention(q16, k[..., :16], v[..., :16], backend="auto").shape == q16.shape


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's log2(0) and 0/0
def test_segment_bounds_and_nan_policy():
    """segment_bounds gives starts/ends; a row with decreasing ids gets empty intervals,
    which the kernels (and the reference backend) turn into NaN: what CUDA inputs get, as
    nothing is read back."""
    seg = torch.tensor([[4, 4, 4, 7, 9, 9], [0, 1, 1, 0, 2, 2]])
    start, end = segment_bounds(seg)
    assert start.dtype == end.dtype == torch.int32
    assert start[0].tolist() == [0, 0, 0, 3, 4, 4] and end[0].tolist() == [2, 2, 2, 3, 5, 5]
    assert start[1].tolist() == [1, 2, 3, 4, 5, 6]  # empty intervals
    dev = triton_device()
    for name in ("triton", "torch"):
        impl = backends.implementation("segment_attention", name)
        q, k, v, _ = make_inputs(2, 6, 6, 4, 2, 16, torch.float32, dev)
        o, lse, psink = impl.forward(q, k, v, start.to(dev), 0.25, True)
        assert torch.isfinite(o[0]).all() and torch.isfinite(lse[0]).all(), name
        assert torch.isnan(o[1]).all() and torch.isnan(lse[1]).all(), name
        assert torch.isnan(psink[1]).all(), name
