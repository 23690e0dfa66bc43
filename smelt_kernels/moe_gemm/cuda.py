"""The ``"cuda"`` backend of the MoE op: the forward kernels of ``csrc/moe_gemm/cuda.cu``
(``torch.ops.smelt_cuda.moe_up`` / ``moe_down`` / ``moe_combine``, from the optional
``smelt_kernels._cuda`` extension), on the Triton routing metadata. It is forward-only; the
backward runs the Triton kernels."""

from __future__ import annotations

import torch

from .. import _alloc
from . import routing as moe_routing

__all__ = ["forward", "BLOCK_M"]

BLOCK_M = 64  # row tile of the CUDA kernels


def forward(x, w1, w2, tw, ids):
    T, H = x.shape
    E, two_de, _ = w1.shape
    de, k = two_de // 2, ids.shape[1]
    tiles = moe_routing.tiles(ids, E, BLOCK_M, use_triton=True)
    pre = _alloc.empty((T * k, two_de), x.dtype, x.device)
    hid = _alloc.empty((T * k, de), x.dtype, x.device)
    out = _alloc.empty((T * k, H), x.dtype, x.device)
    y = _alloc.empty((T, H), x.dtype, x.device)
    ops = torch.ops.smelt_cuda
    ops.moe_up(x, w1, tiles.tok, tiles.tile_e, tiles.tile_r0, tiles.tile_r1, pre, hid)
    ops.moe_down(hid, w2, tiles.tile_e, tiles.tile_r0, tiles.tile_r1, out)
    ops.moe_combine(out, tiles.rev, tw, y)
    return y, pre, tiles.order, tiles.rev, tiles.offsets
