"""segment_attention on every backend against the fp64 reference (forward, LSE, sink and
all gradients) over a grid of lengths, head dims, GQA ratios, segment layouts and dtypes,
with the one tolerance rule. Triton runs through the interpreter on CPU (tiny tiles, so
small T crosses many tile edges); on a GPU machine the same cases run on the device."""

import itertools

import pytest
import torch
from helpers_attention import DIMS, HEADS, LAYOUTS, make_segments, run_and_compare

# the Triton interpreter (numpy) warns on every scalar index; not ours to fix
pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)


def _grid():
    """A sample of T x D x heads x layout x dtype: every (T, layout, dtype) once, D and the
    head ratio cycling, so each value of each axis meets the others."""
    cases = []
    i = 0
    for T, layout, dtype in itertools.product(
        [1, 17, 64, 130], LAYOUTS, [torch.float32, torch.float16]
    ):
        if T == 1 and layout not in ("none", "ones"):
            continue
        cases.append((T, DIMS[i % 3], HEADS[(i // 3) % 3], layout, dtype))
        i += 1
    return cases


GRID = _grid()


@pytest.mark.parametrize(
    "T,D,heads,layout,dtype",
    GRID,
    ids=[f"T{c[0]}-D{c[1]}-H{c[2][0]}x{c[2][1]}-{c[3]}-{str(c[4])[6:]}" for c in GRID],
)
def test_against_reference(backend_device, T, D, heads, layout, dtype):
    name, dev = backend_device
    B = 2 if T <= 64 else 1
    scale = 0.3 if D == 88 else None
    run_and_compare(name, dev, B, T, T, heads, D, dtype, make_segments(layout, B, T), scale)


@pytest.mark.parametrize("D", [8, 24, 40])
def test_small_head_dims_pad_internally(D, triton_device):
    """Any multiple of 8 up to 128 runs on the kernel backends (padded inside the kernel)."""
    run_and_compare(
        "triton", triton_device, 1, 33, 33, (4, 2), D, torch.float32, make_segments("mixed", 1, 33)
    )


def test_bfloat16_paths(triton_device):
    seg = make_segments("mixed", 2, 40)
    for name in ("cpu", "triton", "torch"):
        run_and_compare(
            name,
            triton_device if name == "triton" else "cpu",
            2,
            40,
            40,
            (6, 2),
            64,
            torch.bfloat16,
            seg,
        )


@pytest.mark.parametrize("chunk", [16, 48])
@pytest.mark.parametrize("layout", ["none", "mixed", "inside", "ones"])
def test_cpu_chunking(monkeypatch, chunk, layout):
    """The CPU path's chunks at sizes that put every case (prefix folded into the masked
    call, prefix as its own unmasked call merged through the LSE, chunk-crossing
    segments) inside a short row, forward and backward, full and decode form."""
    from smelt_kernels.attention import cpu as attention_cpu

    monkeypatch.setattr(attention_cpu, "CHUNK", chunk)
    run_and_compare(
        "cpu",
        "cpu",
        2,
        130,
        130,
        (6, 2),
        24,
        torch.float32,
        make_segments(layout, 2, 130, seed=chunk),
    )
    run_and_compare(
        "cpu",
        "cpu",
        2,
        37,
        130,
        (4, 1),
        16,
        torch.float32,
        make_segments(layout, 2, 130, seed=chunk + 1),
    )
