"""segment_attention: every backend against the fp64 reference (forward, LSE, sink, grads),
SDPA as an independent oracle, the decode form, input validation, poisoning, determinism,
torch.library registration and torch.compile.

Triton runs through the interpreter on CPU (tiny tiles, so small T crosses many tile
edges); on a GPU machine the same cases run on the device.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F

from smelt_kernels import _alloc, backends, reference
from smelt_kernels.attention import ops as attention
from smelt_kernels.attention import segment_attention, segment_bounds, select_backend

# the Triton interpreter (numpy) warns on every scalar index; not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

HEADS = [(2, 2), (4, 2), (6, 1)]  # Hq/Hkv = 1, 2, 6
DIMS = [64, 88, 128]
LAYOUTS = ["none", "one", "ones", "mixed", "inside", "edge"]
# max |err| / max(1, max |ref|) per dtype and quantity
TOL = {
    torch.float32: dict(o=2e-5, lse=2e-5, sink=2e-5, grad=5e-5),
    torch.float16: dict(o=4e-3, lse=1e-3, sink=1e-3, grad=1e-2),
    torch.bfloat16: dict(o=3e-2, lse=1e-3, sink=2e-3, grad=6e-2),
}


def _triton_device():
    if torch.cuda.is_available():
        return torch.device("cuda")
    if backends.triton_interpret():
        return torch.device("cpu")
    pytest.skip("Triton needs a CUDA device or TRITON_INTERPRET=1")


@pytest.fixture(params=["torch", "cpu", "triton"])
def backend_device(request):
    name = request.param
    dev = _triton_device() if name == "triton" else torch.device("cpu")
    return name, dev


def _ids_from_lengths(lengths, first=-3, step=2):
    labels = torch.arange(len(lengths)) * step + first
    return torch.repeat_interleave(labels, torch.tensor(lengths))


def _lengths(T, boundaries):
    cuts = [0] + [b for b in boundaries if 0 < b < T] + [T]
    return [b - a for a, b in zip(cuts, cuts[1:])]


def _random_lengths(T, gen):
    lens, s = [], 0
    while s < T:
        n = int(torch.randint(1, max(2, T // 2) + 1, (1,), generator=gen))
        n = min(n, T - s)
        lens.append(n)
        s += n
    return lens


def make_segments(layout, B, T, seed=0):
    """(B, T) ids for a named layout (row 0; other rows mixed), or None for "none"."""
    if layout == "none":
        return None
    gen = torch.Generator().manual_seed(seed)
    if layout == "one":
        row0 = torch.full((T,), 3)
    elif layout == "ones":
        row0 = torch.arange(T) * 5
    elif layout == "mixed":
        row0 = _ids_from_lengths(_random_lengths(T, gen))
    elif layout == "inside":  # boundaries inside 16-wide (and 64-wide) tiles
        row0 = _ids_from_lengths(_lengths(T, [5, 21, 40, 100]))
    elif layout == "edge":  # boundaries exactly on tile edges
        row0 = _ids_from_lengths(_lengths(T, [16, 32, 64, 128]))
    else:
        raise KeyError(layout)
    rows = [row0] + [_ids_from_lengths(_random_lengths(T, gen), first=b) for b in range(1, B)]
    return torch.stack(rows)


def make_inputs(B, Tq, Tk, hq, hkv, D, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Tq, hq, D, generator=gen).to(dtype)
    k = torch.randn(B, Tk, hkv, D, generator=gen).to(dtype)
    v = torch.randn(B, Tk, hkv, D, generator=gen).to(dtype)
    do = torch.randn(B, Tq, hq, D, generator=gen).to(dtype)
    return [x.to(device) for x in (q, k, v, do)]


def oracle(q, k, v, seg, do, scale=None):
    """fp64 reference: o, lse, sink and (dq, dk, dv)."""
    q64, k64, v64 = (x.detach().cpu().double().requires_grad_() for x in (q, k, v))
    seg = seg.cpu() if seg is not None else None
    o, lse, sink = reference.segment_attention(q64, k64, v64, seg, scale)
    grads = torch.autograd.grad(o, (q64, k64, v64), do.detach().cpu().double())
    return o.detach(), lse, sink, grads


def close(name, got, ref, tol):
    got = got.detach().cpu()
    assert got.shape == ref.shape, (name, got.shape, ref.shape)
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err = (got.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
    bound = tol * max(1.0, ref.abs().max().item() if ref.numel() else 0.0)
    assert err <= bound, f"{name}: max error {err:.3e} > {bound:.3e}"


def run_and_compare(name, dev, B, Tq, Tk, heads, D, dtype, seg, scale=None, seed=0):
    q, k, v, do = make_inputs(B, Tq, Tk, *heads, D, dtype, dev, seed)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    seg_dev = seg.to(dev) if seg is not None else None
    o, lse, sink = segment_attention(q, k, v, seg_dev, scale=scale, return_lse=True,
                                     return_sink=True, backend=name)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    ro, rlse, rsink, (rdq, rdk, rdv) = oracle(q, k, v, seg, do, scale)
    tol = TOL[dtype]
    assert o.dtype == dtype and lse.dtype == torch.float32 and sink.dtype == torch.float32
    close("o", o, ro, tol["o"])
    close("lse", lse, rlse, tol["lse"])
    close("sink", sink, rsink, tol["sink"])
    for n, g, r in (("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        close(n, g, r, tol["grad"])


def _grid():
    """A sample of T x D x heads x layout x dtype: every (T, layout, dtype) once, D and the
    head ratio cycling, so each value of each axis meets the others."""
    cases = []
    i = 0
    for T, layout, dtype in itertools.product([1, 17, 64, 130], LAYOUTS,
                                              [torch.float32, torch.float16]):
        if T == 1 and layout not in ("none", "ones"):
            continue
        cases.append((T, DIMS[i % 3], HEADS[(i // 3) % 3], layout, dtype))
        i += 1
    return cases


GRID = _grid()


@pytest.mark.parametrize("T,D,heads,layout,dtype", GRID,
                         ids=[f"T{c[0]}-D{c[1]}-H{c[2][0]}x{c[2][1]}-{c[3]}-{str(c[4])[6:]}"
                              for c in GRID])
def test_against_reference(backend_device, T, D, heads, layout, dtype):
    name, dev = backend_device
    B = 2 if T <= 64 else 1
    scale = 0.3 if D == 88 else None
    run_and_compare(name, dev, B, T, T, heads, D, dtype, make_segments(layout, B, T), scale)


@pytest.mark.parametrize("D", [8, 24, 40])
def test_small_head_dims_pad_internally(D):
    """Any multiple of 8 up to 128 runs on the kernel backends (padded inside the kernel)."""
    dev = _triton_device()
    run_and_compare("triton", dev, 1, 33, 33, (4, 2), D, torch.float32, make_segments("mixed", 1, 33))


def test_bfloat16_paths():
    dev = _triton_device()
    seg = make_segments("mixed", 2, 40)
    for name in ("cpu", "triton"):
        run_and_compare(name, dev if name == "triton" else "cpu", 2, 40, 40, (6, 2), 64,
                        torch.bfloat16, seg)


@pytest.mark.parametrize("chunk", [16, 48])
@pytest.mark.parametrize("layout", ["none", "mixed", "inside", "ones"])
def test_cpu_chunking(monkeypatch, chunk, layout):
    """The CPU path's chunks at sizes that put every case (prefix folded into the masked
    call, prefix as its own unmasked call merged through the LSE, chunk-crossing
    segments) inside a short row, forward and backward, full and decode form."""
    from smelt_kernels.attention import cpu as attention_cpu

    monkeypatch.setattr(attention_cpu, "CHUNK", chunk)
    run_and_compare("cpu", "cpu", 2, 130, 130, (6, 2), 24, torch.float32,
                    make_segments(layout, 2, 130, seed=chunk))
    run_and_compare("cpu", "cpu", 2, 37, 130, (4, 1), 16, torch.float32,
                    make_segments(layout, 2, 130, seed=chunk + 1))


# ----------------------------------------------------------------------------- decode form
@pytest.mark.parametrize("Tq", [1, 5])
def test_decode_matches_full_recompute(backend_device, Tq):
    """Queries for the last Tq positions against a sliced KV cache == the last Tq rows of
    the full computation; gradients against the fp64 reference."""
    name, dev = backend_device
    B, n, cap, hq, hkv, D = 2, 37, 48, 6, 2, 64
    q_all, k_cache, v_cache, _ = make_inputs(B, cap, cap, hq, hkv, D, torch.float32, dev, seed=3)
    ids = make_segments("mixed", B, cap, seed=4).to(dev)
    k, v, seg = k_cache[:, :n], v_cache[:, :n], ids[:, :n]  # strided views, as in generation
    full = segment_attention(q_all[:, :n], k, v, seg, return_lse=True, return_sink=False,
                             backend=name)
    q = q_all[:, n - Tq:n].clone().requires_grad_()
    kk, vv = k.detach().clone().requires_grad_(), v.detach().clone().requires_grad_()
    o, lse = segment_attention(q, kk, vv, seg, return_lse=True, backend=name)
    close("o vs full", o, full[0][:, n - Tq:].cpu().double(), 1e-5)
    close("lse vs full", lse, full[1][:, :, n - Tq:].cpu().double(), 1e-5)
    do = torch.randn_like(o)
    dq, dk, dv = torch.autograd.grad(o, (q, kk, vv), do)
    ro, rlse, rsink, (rdq, rdk, rdv) = oracle(q, kk, vv, seg, do)
    close("o", o, ro, 2e-5)
    _, sink = segment_attention(q, kk, vv, seg, return_sink=True, backend=name)
    close("sink", sink, rsink, 2e-5)
    for nm, g, r in (("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        close(nm, g, r, 5e-5)


# ----------------------------------------------------------------------------- independent oracles
@pytest.mark.parametrize("name", ["torch", "cpu"])
@pytest.mark.parametrize("layout", ["none", "mixed", "inside"])
def test_against_sdpa(name, layout):
    """SDPA with the equivalent boolean mask (GQA through enable_gqa), in float64."""
    B, T, hq, hkv, D = 2, 45, 6, 2, 40
    q, k, v, do = make_inputs(B, T, T, hq, hkv, D, torch.float64, "cpu", seed=5)
    seg = make_segments(layout, B, T, seed=6)
    ids = seg if seg is not None else torch.zeros(B, T, dtype=torch.long)
    pos = torch.arange(T)
    mask = (ids[:, :, None] == ids[:, None, :]) & (pos[None, None, :] <= pos[None, :, None])
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask[:, None], enable_gqa=True).transpose(1, 2)
    got = segment_attention(q, k, v, seg, backend=name)
    assert (got - ref).abs().max().item() < 1e-12
    g_ref = torch.autograd.grad(ref, (q, k, v), do)
    g = torch.autograd.grad(got, (q, k, v), do)
    for a, b in zip(g, g_ref):
        assert (a - b).abs().max().item() < 1e-11


def test_sink_by_hand(backend_device):
    """q = 0 makes attention uniform over [start, i]: the start key gets 1 / (i - start + 1).
    A segment of length L contributes queries i = 1..L-1 with 1 / (i + 1)."""
    name, dev = backend_device
    lengths = [1, 4, 9, 2]
    T = sum(lengths)
    q = torch.zeros(1, T, 2, 16, device=dev)
    k = torch.randn(1, T, 1, 16, device=dev)
    v = torch.randn(1, T, 1, 16, device=dev)
    seg = _ids_from_lengths(lengths)[None].to(dev)
    _, sink = segment_attention(q, k, v, seg, return_sink=True, backend=name)
    terms = [1.0 / (i + 1) for L in lengths for i in range(1, L)]
    expect = sum(terms) / len(terms)
    assert torch.allclose(sink.cpu(), torch.full((1, 2), expect), atol=1e-6)
    # only segment starts: nothing counted, sink 0
    _, sink = segment_attention(q, k, v, torch.arange(T)[None].to(dev), return_sink=True,
                                backend=name)
    assert torch.equal(sink.cpu(), torch.zeros(1, 2))


def test_statistics_carry_no_gradient(backend_device):
    name, dev = backend_device
    q, k, v, _ = make_inputs(1, 9, 9, 2, 1, 16, torch.float32, dev)
    q.requires_grad_()
    o, lse, sink = segment_attention(q, k, v, return_lse=True, return_sink=True, backend=name)
    assert o.requires_grad and not lse.requires_grad and not sink.requires_grad


# ----------------------------------------------------------------------------- validation
def _qkv(B=1, Tq=8, Tk=8, hq=4, hkv=2, D=16, dtype=torch.float32):
    return make_inputs(B, Tq, Tk, hq, hkv, D, dtype, "cpu")[:3]


BAD_INPUTS = [
    ("q rank", lambda q, k, v: (q[0], k, v, None), ValueError, "q must be 4-D"),
    ("k rank", lambda q, k, v: (q, k[..., None], v, None), ValueError, "k must be 4-D"),
    ("heads", lambda q, k, v: (q[:, :, :3], k, v, None), ValueError, "multiple of k/v heads"),
    ("kv shapes", lambda q, k, v: (q, k, v[:, :5], None), ValueError, "k and v must have one shape"),
    ("batch", lambda q, k, v: (q[:1], torch.cat([k, k]), torch.cat([v, v]), None), ValueError,
     "batch"),
    ("head dim", lambda q, k, v: (q, k[..., :8], v[..., :8], None), ValueError, "head dim"),
    ("Tq > Tk", lambda q, k, v: (q, k[:, :5], v[:, :5], None), ValueError, "exceeds"),
    ("k dtype", lambda q, k, v: (q, k.half(), v, None), TypeError, "k must have q's dtype"),
    ("int q", lambda q, k, v: (q.long(), k.long(), v.long(), None), TypeError, "floating"),
    ("k device", lambda q, k, v: (q, k.to("meta"), v, None), ValueError, "k is on meta"),
    ("ids device", lambda q, k, v: (q, k, v, torch.zeros(1, 8, dtype=torch.long, device="meta")),
     ValueError, "segment_ids is on meta"),
    ("ids dtype", lambda q, k, v: (q, k, v, torch.zeros(1, 8)), TypeError, "integer tensor"),
    ("ids bool", lambda q, k, v: (q, k, v, torch.zeros(1, 8, dtype=torch.bool)), TypeError,
     "integer tensor"),
    ("ids shape", lambda q, k, v: (q, k, v, torch.zeros(1, 7, dtype=torch.long)), ValueError,
     r"shape \(B, Tk\)"),
    ("not a tensor", lambda q, k, v: (q.tolist(), k, v, None), TypeError, "q must be a torch.Tensor"),
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
    from smelt_kernels.attention import cpu as attention_cpu, triton as attention_triton

    def boom(*a, **kw):
        raise AssertionError("a kernel ran before validation")

    monkeypatch.setattr(attention_cpu, "forward", boom)
    monkeypatch.setattr(attention_triton, "forward", boom)
    monkeypatch.setattr(attention, "_torch_forward", boom)


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
    assert "multiple of 8" in attention._limits("triton", q)
    assert "multiple of 8" in attention._limits("cuda", q.half())
    assert "takes" in attention._limits("cuda", q)
    if backends.unavailable_reason("triton", q.device) is None:
        with pytest.raises(ValueError, match="multiple of 8"):
            segment_attention(q, k, v, backend="triton")
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


# ----------------------------------------------------------------------------- invalid ids on CUDA
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's log2(0) and 0/0
def test_segment_bounds_and_nan_policy():
    """segment_bounds gives starts/ends; a row with decreasing ids gets empty intervals,
    which the kernels turn into NaN (what CUDA inputs get, as nothing is read back)."""
    seg = torch.tensor([[4, 4, 4, 7, 9, 9], [0, 1, 1, 0, 2, 2]])
    start, end = segment_bounds(seg)
    assert start.dtype == end.dtype == torch.int32
    assert start[0].tolist() == [0, 0, 0, 3, 4, 4] and end[0].tolist() == [2, 2, 2, 3, 5, 5]
    assert start[1].tolist() == [1, 2, 3, 4, 5, 6]  # empty intervals
    dev = _triton_device()
    from smelt_kernels.attention import triton as attention_triton

    q, k, v, _ = make_inputs(2, 6, 6, 4, 2, 16, torch.float32, dev)
    o, lse, psink = attention_triton.forward(q, k, v, start.to(dev), 0.25, True)
    assert torch.isfinite(o[0]).all() and torch.isfinite(lse[0]).all()
    assert torch.isnan(o[1]).all() and torch.isnan(lse[1]).all() and torch.isnan(psink[1]).all()


# ----------------------------------------------------------------------------- poisoning, empties
def test_poisoned_outputs_are_overwritten(backend_device):
    """The suite allocates kernel outputs NaN-filled; odd shapes leave partial tiles, so an
    unwritten element shows up as NaN here (and in every comparison above)."""
    assert _alloc.poisoning()
    name, dev = backend_device
    for (B, Tq, Tk, hq, hkv, D) in [(3, 19, 23, 6, 2, 24), (1, 1, 1, 1, 1, 8), (2, 33, 33, 3, 1, 56)]:
        q, k, v, do = make_inputs(B, Tq, Tk, hq, hkv, D, torch.float32, dev, seed=B)
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        seg = make_segments("mixed", B, Tk, seed=Tk).to(dev)
        o, lse, sink = segment_attention(q, k, v, seg, return_lse=True, return_sink=True,
                                         backend=name)
        grads = torch.autograd.grad(o, (q, k, v), do)
        for t in (o, lse, sink, *grads):
            assert torch.isfinite(t).all()


def test_empty_inputs(backend_device):
    name, dev = backend_device
    for (B, Tq, Tk) in [(0, 4, 4), (2, 0, 5)]:
        q, k, v, _ = make_inputs(B, Tq, Tk, 4, 2, 16, torch.float32, dev)
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        o, lse, sink = segment_attention(q, k, v, return_lse=True, return_sink=True, backend=name)
        assert o.shape == q.shape and lse.shape == (B, 4, Tq) and sink.shape == (B, 4)
        assert torch.equal(sink, torch.zeros_like(sink))
        dk = torch.autograd.grad(o.sum(), k)[0]
        assert dk.shape == k.shape and not dk.any()


# ----------------------------------------------------------------------------- determinism
@pytest.mark.parametrize("name", ["cpu", "triton"])
def test_backward_is_bitwise_deterministic(name):
    dev = _triton_device() if name == "triton" else torch.device("cpu")
    q, k, v, do = make_inputs(2, 40, 40, 6, 2, 32, torch.float16, dev, seed=9)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    seg = make_segments("inside", 2, 40).to(dev)
    runs = []
    for _ in range(2):
        o = segment_attention(q, k, v, seg, backend=name)
        runs.append(torch.autograd.grad(o, (q, k, v), do))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- torch.library
@pytest.mark.parametrize("name", ["torch", "cpu", "triton"])
def test_opcheck(name):
    dev = _triton_device() if name == "triton" else torch.device("cpu")
    q, k, v, do = make_inputs(2, 20, 20, 4, 2, 16, torch.float32, dev)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    seg = make_segments("mixed", 2, 20).to(dev)
    fwd = torch.ops.smelt.segment_attention_fwd.default
    torch.library.opcheck(fwd, (q, k, v, seg, 0.25, name, True))
    torch.library.opcheck(fwd, (q, k, v, None, 0.25, name, False))
    o, lse, _ = fwd(q, k, v, seg, 0.25, name, False)
    bwd = torch.ops.smelt.segment_attention_bwd.default
    torch.library.opcheck(bwd, (do, q.detach(), k.detach(), v.detach(), o.detach(), lse, seg,
                                0.25, name))


@pytest.mark.parametrize("name", [None, "torch"])
def test_torch_compile_fullgraph(name):
    q, k, v, do = make_inputs(2, 24, 24, 6, 2, 16, torch.float32, "cpu", seed=2)
    seg = make_segments("mixed", 2, 24)

    def step(q, k, v, seg):
        o, lse, sink = segment_attention(q, k, v, seg, return_lse=True, return_sink=True,
                                         backend=name)
        return (o * do).sum(), lse, sink

    compiled = torch.compile(step, fullgraph=True)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    loss, lse, sink = compiled(*leaves, seg)
    grads = torch.autograd.grad(loss, leaves)
    leaves_e = [x.clone().requires_grad_() for x in (q, k, v)]
    loss_e, lse_e, sink_e = step(*leaves_e, seg)
    grads_e = torch.autograd.grad(loss_e, leaves_e)
    assert torch.allclose(loss, loss_e) and torch.equal(lse, lse_e) and torch.equal(sink, sink_e)
    for a, b in zip(grads, grads_e):
        assert torch.allclose(a, b, atol=1e-6)


# ----------------------------------------------------------------------------- GPU only
def _cuda_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device("cuda")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D,heads,layout", [(64, (4, 2), "mixed"), (88, (12, 2), "inside"),
                                            (128, (10, 2), "edge"), (40, (6, 6), "none")])
def test_cuda_kernel_against_reference(dtype, D, heads, layout):
    dev = _cuda_or_skip()
    reason = backends.unavailable_reason("cuda", dev, attention._cuda_op_missing)
    if reason is not None:
        pytest.skip(reason)
    T = 300
    seg = make_segments(layout, 2, T)
    run_and_compare("cuda", dev, 2, T, T, heads, D, dtype, seg)
    # decode form on the CUDA kernel
    q, k, v, _ = make_inputs(2, 7, T, *heads, D, dtype, dev)
    o = segment_attention(q, k, v, seg.to(dev) if seg is not None else None, backend="cuda")
    ro = oracle(q, k, v, seg, torch.zeros_like(q))[0]
    close("decode o", o, ro, TOL[dtype]["o"])


def test_cuda_invalid_ids_rejected_or_nan_when_unchecked():
    dev = _cuda_or_skip()
    q, k, v, _ = make_inputs(2, 64, 64, 4, 2, 64, torch.bfloat16, dev)
    seg = make_segments("mixed", 2, 64).to(dev)
    seg[1, 10:] = seg[1, 10:].flip(0)
    names = ["triton", "torch"]
    if backends.unavailable_reason("cuda", dev, attention._cuda_op_missing) is None:
        names.append("cuda")
    for name in names:
        with pytest.raises(ValueError, match="non-decreasing.*row 1"):
            segment_attention(q, k, v, seg, backend=name)
        o, lse, sink = segment_attention(q, k, v, seg, return_lse=True, return_sink=True,
                                         backend=name, check_values=False)
        assert torch.isfinite(o[0]).all() and torch.isfinite(sink[0]).all(), name
        assert torch.isnan(o[1]).all() and torch.isnan(lse[1]).all(), name
        assert torch.isnan(sink[1]).all(), name


@pytest.mark.parametrize("heads,D", [((10, 2), 128), ((12, 2), 88)])
def test_triton_gpu_paper_shapes(heads, D):
    """The paper's head shapes at a realistic length, bf16, with the GPU tile sizes."""
    dev = _cuda_or_skip()
    T = 1024
    seg = make_segments("mixed", 1, T)
    run_and_compare("triton", dev, 1, T, T, heads, D, torch.bfloat16, seg)
