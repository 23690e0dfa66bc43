"""``attn_implementation="smelt"``: transformers' attention call on :func:`segment_attention`.

transformers calls ``fn(module, query (B, Hq, Tq, D), key, value (B, Hkv, Tk, D),
attention_mask, dropout=, scaling=, sliding_window=, **kwargs)`` and wants
``(out (B, Tq, Hq, D), None)``. :func:`smelt_attention_forward` transposes the views,
derives ``segment_ids`` (B, Tk) on the device -- no host synchronisation -- and runs the
causal segment-masked kernel. The segments come from, in this order of union:

* the 2-D padding mask that :func:`smelt_attention_mask` (registered beside it in
  ``AttentionMaskInterface``) hands through: each run of kept or padded positions is a
  segment, so real tokens never see padding. A row must keep one contiguous run (left or
  right padding); a mask with holes raises;
* ``cu_seq_lens_k`` (the cumulative document lengths that ``DataCollatorWithFlattening``
  makes for the flash-attention varlen path): one segment per document;
* ``position_ids`` when the call has as many queries as keys (no cached prefix): a new
  segment wherever the position does not advance by one (packed documents restart at 0).

With a KV cache (``DynamicCache``, what ``generate`` uses) the queries are the last Tq
keys, which is the kernel's decode form. Refused with a ``ValueError`` naming the feature:
a sliding window shorter than the keys, logit soft-capping, attention sinks, dropout,
non-causal modules, arbitrary 4-D masks, caches whose keys do not end at the last query
(``StaticCache``), and custom mask functions (``or_mask_function`` / ``and_mask_function``).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..attention import segment_attention

__all__ = [
    "smelt_attention_forward",
    "smelt_attention_mask",
    "segments_from_mask",
    "segments_from_positions",
    "segments_from_cu_seqlens",
]


def _refuse(feature: str, hint: str = "") -> None:
    raise ValueError(f"smelt attention does not support {feature}" + (f"; {hint}" if hint else ""))


# ---------------------------------------------------------------------- segment ids
def _boundaries_to_ids(new: torch.Tensor) -> torch.Tensor:
    """new (B, T-1) bool, True where position t+1 starts a segment -> (B, T) ids from 0."""
    ids = new.to(torch.int32).cumsum(-1, dtype=torch.int32)
    return torch.cat([torch.zeros_like(ids[:, :1]), ids], dim=1)


def segments_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) padding mask (1 keep, 0 pad) -> segment ids: each run is a segment.

    A row may hold one contiguous run of kept positions only (left and/or right padding);
    more than one raises a ``ValueError`` (on CUDA a device-side assert, never a host read).
    """
    m = mask.to(torch.bool)
    rises = m & ~torch.cat([torch.zeros_like(m[:, :1]), m[:, :-1]], dim=1)
    holes = rises.sum(-1) > 1
    msg = (
        "smelt attention: attention_mask rows must keep one contiguous run of tokens "
        "(left or right padding), not several"
    )
    if m.device.type == "cuda":
        torch._assert_async(~holes.any(), msg)
    elif bool(holes.any()):
        raise ValueError(msg)
    return _boundaries_to_ids(m[:, 1:] != m[:, :-1])


def segments_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) positions -> a new segment wherever the position does not advance by one."""
    p = position_ids
    return _boundaries_to_ids(p[:, 1:] != p[:, :-1] + 1)


def segments_from_cu_seqlens(cu: torch.Tensor, length: int) -> torch.Tensor:
    """Cumulative lengths (n + 1,) of n flattened documents -> (1, length) segment ids."""
    pos = torch.arange(length, device=cu.device, dtype=cu.dtype)
    ids = torch.searchsorted(cu[1:].contiguous(), pos, right=True)
    return ids.to(torch.int32)[None]


def _union(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Segments that split wherever either split (both (B, T) non-decreasing ids)."""
    if a is None or b is None:
        return a if b is None else b
    a, b = torch.broadcast_tensors(a, b)
    return _boundaries_to_ids((a[:, 1:] != a[:, :-1]) | (b[:, 1:] != b[:, :-1]))


# ---------------------------------------------------------------------- mask interface
#: pieces of transformers' mask functions that the kernel's causal segment mask already is
#: (causal; packing, served through position_ids; a sliding window, checked against Tk)
_SERVED_PARTS = {"causal_mask_function", "sliding_window_overlay", "packed_sequence_mask_function"}


def _mask_parts(fn) -> list[str]:
    """The named pieces of a (composed) transformers mask function."""
    if fn is None:
        return ["causal_mask_function"]
    name = getattr(fn, "__qualname__", repr(fn))
    owner = name.split(".<locals>.")[0]
    if owner in ("and_masks", "remap_positions_for_packed_sequence"):
        parts = []
        for cell in fn.__closure__ or ():
            inner = cell.cell_contents
            for f in inner if isinstance(inner, tuple) else (inner,):
                if callable(f):
                    parts += _mask_parts(f)
        return parts
    return [owner]


# torch.compile cannot trace the name reading above: it runs once, when a graph is traced (a
# model's mask functions are fresh closures each call, of one structure per configuration)
@torch.compiler.assume_constant_result
def _unserved_part(fn) -> Optional[str]:
    """The first piece of mask function ``fn`` the kernel's mask does not serve, or None."""
    return next((p for p in _mask_parts(fn) if p not in _SERVED_PARTS), None)


def smelt_attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: Optional[torch.Tensor] = None,
    **kwargs,
):
    """``AttentionMaskInterface`` entry: hand the 2-D padding mask through (or None)."""
    if isinstance(q_offset, torch.Tensor) or (isinstance(kv_offset, torch.Tensor)):
        _refuse("caches with tensor offsets (e.g. StaticCache)", "use DynamicCache")
    if kv_offset != 0 or q_offset + q_length != kv_length:
        _refuse(
            f"a cache whose keys do not end at the last query (q_offset={q_offset}, "
            f"q_length={q_length}, kv_length={kv_length}, kv_offset={kv_offset}; "
            "StaticCache or a sliding-window cache)",
            "use DynamicCache",
        )
    part = _unserved_part(mask_function)
    if part is not None:
        _refuse(
            f"the mask function {part} (custom or_mask_function / and_mask_function, "
            "chunked or block masks)"
        )
    if attention_mask is None:
        return None
    return attention_mask[:, -kv_length:]


# ---------------------------------------------------------------------- attention
def smelt_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs,
):
    """The ``AttentionInterface`` entry (see the module docstring)."""
    B, Hq, Tq, D = query.shape
    Tk = key.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if not is_causal:
        _refuse("non-causal (bidirectional) attention")
    if softcap is not None:
        _refuse("logit soft-capping (softcap)")
    if kwargs.get("s_aux") is not None or getattr(module, "sinks", None) is not None:
        _refuse("attention sinks (s_aux / sinks)")
    if dropout:
        _refuse(f"attention dropout ({dropout})", "set attention_dropout=0")
    if sliding_window is not None and Tk > sliding_window:
        _refuse(f"a sliding window ({sliding_window}) shorter than the {Tk} keys")
    if kwargs.get("position_bias") is not None:
        _refuse("an additive position bias")
    Dv = value.shape[-1]
    if Dv > D:
        _refuse(f"a value head dim ({Dv}) larger than the query's ({D})")
    if Tq > Tk:
        _refuse(f"more queries ({Tq}) than keys ({Tk})")

    seg = None
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            _refuse(
                f"a {attention_mask.dim()}-D attention mask (only 2-D padding masks)",
                "pass a 2-D attention_mask, position_ids or cu_seq_lens",
            )
        if tuple(attention_mask.shape) != (B, Tk):
            raise ValueError(
                f"smelt attention: attention_mask has shape "
                f"{tuple(attention_mask.shape)}, keys need ({B}, {Tk})"
            )
        seg = segments_from_mask(attention_mask)
    cu = kwargs.get("cu_seq_lens_k")
    if cu is not None:
        if B != 1 or Tq != Tk:
            _refuse("cu_seq_lens with a batch of more than one row or with a cache")
        seg = _union(seg, segments_from_cu_seqlens(cu, Tk))
    else:
        pos = kwargs.get("position_ids")
        if pos is not None and pos.dim() == 3:  # multimodal RoPE (3, B, T): text positions
            pos = pos[0]
        if pos is not None and Tq == Tk and Tq > 1 and pos.shape[-1] == Tk:
            seg = _union(seg, segments_from_positions(pos.expand(B, -1)))

    q = query.transpose(1, 2)
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    if Dv < D:  # e.g. DeepSeek's MLA: zero columns in V give zero columns in the output
        v = torch.nn.functional.pad(v, (0, D - Dv))
    # the ids above are non-decreasing by construction (cumulative sums of starts)
    out = segment_attention(q, k, v, seg, scale=scaling, check_values=False)
    return (out[..., :Dv] if Dv < D else out), None
