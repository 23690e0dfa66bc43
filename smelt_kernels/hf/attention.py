"""``attn_implementation="smelt"``: transformers' attention call on :func:`segment_attention`.

transformers calls ``fn(module, query (B, Hq, Tq, D), key, value (B, Hkv, Tk, Dv),
attention_mask, dropout=, scaling=, sliding_window=, softcap=, s_aux=, **kwargs)`` and wants
``(out (B, Tq, Hq, Dv), None)``. :func:`smelt_attention_forward` transposes the views,
builds what the kernel needs on the device -- no host synchronisation, so it captures and
compiles -- and runs the causal kernel:

* keys: the 2-D padding mask that :func:`smelt_attention_mask` (registered beside it in
  ``AttentionMaskInterface``) hands through is the kernel's ``key_mask``: each query sees the
  earlier keys the mask keeps, holes included (a right-padded batch in ``generate``, any
  mask); a query that sees no key gives zeros;
* segments: ``cu_seq_lens_k`` (the cumulative document lengths that
  ``DataCollatorWithFlattening`` makes for the flash-attention varlen path), or, as
  transformers reads packing, ``position_ids`` when there is no padding mask and the call has
  as many queries as keys (no cached prefix): a new segment wherever the position does not
  advance by one (packed documents restart at 0);
* ``sliding_window`` (Mistral's and Qwen's convention: a query sees ``window`` keys, itself
  included), ``softcap`` and the per-head sink logits (``s_aux``, gpt-oss's ``sinks``) are
  the kernel's own arguments; a value head dim of its own (DeepSeek's MLA) runs as is;
* caches: ``DynamicCache`` and the sliding-window caches hand keys that end at the last
  query, the kernel's decode form. ``StaticCache`` hands its whole buffer: the mask marks the
  keys past the last query (its unused tail) and the keys are rotated on the device so that
  the used ones end at the last query, the tail masked.

What the kernel does not compute runs transformers' ``sdpa`` with one log line saying why
(once per reason; strict mode -- ``set_strict`` or ``SMELT_HF_STRICT=1`` -- raises
:class:`UnsupportedAttention` instead): a 4-D mask passed by the caller, mask functions
other than causal, sliding-window and packing (``or_mask_function`` /
``and_mask_function``, chunked or bidirectional masks), attention dropout, non-causal
modules and an additive position bias.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from ..attention import segment_attention
from .experts import is_strict

__all__ = [
    "smelt_attention_forward",
    "smelt_attention_mask",
    "segments_from_mask",
    "segments_from_positions",
    "segments_from_cu_seqlens",
    "UnsupportedAttention",
]

logger = logging.getLogger("smelt.hf")
_logged: set[str] = set()

#: the mask a static cache's layer gets: 1 a key to keep, 0 padding, -1 no key yet (the
#: cache's unused tail, past the last query)
_TAIL = -1


class UnsupportedAttention(NotImplementedError):
    """Raised in strict mode for an attention call the smelt kernel cannot serve."""


def _fallback(reason: str) -> None:
    """Strict mode: raise. Otherwise log once per reason that transformers' sdpa runs."""
    if is_strict():
        raise UnsupportedAttention(f"smelt attention cannot serve {reason} (strict mode)")
    if reason not in _logged:
        _logged.add(reason)
        logger.warning("smelt attention: %s runs on transformers' sdpa instead", reason)


# ---------------------------------------------------------------------- segment ids
def _boundaries_to_ids(new: torch.Tensor) -> torch.Tensor:
    """new (B, T-1) bool, True where position t+1 starts a segment -> (B, T) ids from 0."""
    ids = new.to(torch.int32).cumsum(-1, dtype=torch.int32)
    return torch.cat([torch.zeros_like(ids[:, :1]), ids], dim=1)


def segments_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) padding mask (1 keep, 0 pad) -> segment ids: each run of kept or padded
    positions is a segment. (The attention entry hands the mask to the kernel as its
    ``key_mask`` instead, which also serves masks with holes.)"""
    m = mask.to(torch.bool)
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


# ---------------------------------------------------------------------- mask interface
#: pieces of transformers' mask functions that the kernel's own masking is (causal; a
#: sliding window, from the layer's ``sliding_window``; packing, served through position_ids)
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
    """``AttentionMaskInterface`` entry: what the layers' attention calls get as their mask.

    None (no padding, keys ending at the last query); the 2-D padding mask over the layer's
    keys (bool (B, kv_length)); or, where keys may run past the last query (a static cache,
    whose ``q_offset`` is a tensor), an int8 (B, kv_length) mask that also marks that unused
    tail (-1). A mask function the kernel does not serve gets transformers' own 4-D sdpa
    mask, which the attention call hands to sdpa (with one log line)."""
    part = _unserved_part(mask_function)
    if part is not None:
        from transformers.masking_utils import sdpa_mask  # 5.x internals, used when needed

        _fallback(f"the mask function {part} (custom or_mask/and_mask, chunked or bidirectional)")
        return sdpa_mask(
            batch_size=batch_size,
            q_length=q_length,
            kv_length=kv_length,
            q_offset=q_offset,
            kv_offset=kv_offset,
            mask_function=mask_function,
            attention_mask=attention_mask,
            allow_is_causal_skip=False,
            **{
                k: v
                for k, v in kwargs.items()
                if k in ("local_size", "allow_torch_fix", "use_vmap")
            },
        )
    keys_end = kv_offset + kv_length
    tail = isinstance(q_offset, torch.Tensor) or q_offset + q_length != keys_end
    if attention_mask is None and not tail:
        return None
    device = attention_mask.device if attention_mask is not None else kwargs.get("device")
    if attention_mask is None:
        keep = torch.ones(batch_size, kv_length, dtype=torch.bool, device=device)
    else:
        keep = attention_mask.to(torch.bool)
        if keep.shape[-1] < keys_end:  # a static cache's buffer outruns the mask
            keep = torch.nn.functional.pad(keep, (0, keys_end - keep.shape[-1]))
        keep = keep[:, kv_offset:keys_end]
    if not tail:
        return keep
    if not isinstance(q_offset, torch.Tensor) and q_offset + q_length > keys_end:
        raise ValueError(
            f"smelt attention: the queries end at {q_offset + q_length}, past the cache's "
            f"keys ({keys_end})"
        )
    pos = torch.arange(kv_offset, keys_end, device=keep.device)
    past = pos > q_offset + (q_length - 1)
    return torch.where(past[None, :], _TAIL, keep.to(torch.int8)).to(torch.int8)


# ---------------------------------------------------------------------- attention
def _rotate_static(key, value, mask):
    """Keys of a static cache (int8 ``mask`` with its unused tail at -1) rotated on the
    device so that the used keys end at the last query (the kernel's decode form), with
    the key mask in the same order (the tail cleared)."""
    B, Hkv, Tk, _ = key.shape
    used = (mask != _TAIL).sum(-1, keepdim=True)  # (B, 1): the last query's key + 1
    idx = (torch.arange(Tk, device=mask.device)[None, :] + used) % Tk  # (B, Tk)
    key = torch.gather(key, 2, idx[:, None, :, None].expand(B, Hkv, Tk, key.shape[-1]))
    value = torch.gather(value, 2, idx[:, None, :, None].expand(B, Hkv, Tk, value.shape[-1]))
    return key, value, torch.gather(mask, 1, idx) > 0


def _sdpa(module, query, key, value, attention_mask, dropout, scaling, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward  # 5.x, as above

    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )


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
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    sinks = kwargs.pop("s_aux", None)
    if sinks is None:
        sinks = getattr(module, "sinks", None)
    reason = None
    if attention_mask is not None and attention_mask.dim() != 2:
        reason = f"a {attention_mask.dim()}-D attention mask (a custom mask)"
    elif not causal:
        reason = "non-causal (bidirectional) attention"
    elif dropout:
        reason = f"attention dropout ({dropout})"
    elif kwargs.get("position_bias") is not None:
        reason = "an additive position bias"
    if reason is not None:
        if softcap is not None or sinks is not None:
            raise ValueError(
                f"smelt attention: {reason} with soft-capping or sinks is served by neither "
                "smelt nor sdpa"
            )
        _fallback(reason)
        return _sdpa(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if Tq > Tk:
        raise ValueError(f"smelt attention: more queries ({Tq}) than keys ({Tk})")

    key_mask = None
    if attention_mask is not None:
        if tuple(attention_mask.shape) != (B, Tk):
            raise ValueError(
                f"smelt attention: attention_mask has shape "
                f"{tuple(attention_mask.shape)}, keys need ({B}, {Tk})"
            )
        if attention_mask.dtype == torch.int8:  # a static cache's buffer (see the mask entry)
            key, value, key_mask = _rotate_static(key, value, attention_mask)
        else:
            key_mask = attention_mask.to(torch.bool)
    seg = None
    cu = kwargs.get("cu_seq_lens_k")
    if cu is not None:
        if B != 1 or Tq != Tk:
            raise ValueError(
                "smelt attention: cu_seq_lens with a batch of more than one row or with a "
                "cache is not supported"
            )
        seg = segments_from_cu_seqlens(cu, Tk)
    elif attention_mask is None:  # as transformers: packing is read from positions only then
        pos = kwargs.get("position_ids")
        if pos is not None and pos.dim() == 3:  # multimodal RoPE (3, B, T): text positions
            pos = pos[0]
        if pos is not None and Tq == Tk and Tq > 1 and pos.shape[-1] == Tk:
            seg = segments_from_positions(pos.expand(B, -1))

    window = sliding_window if sliding_window is not None and sliding_window < Tk else None
    # the ids above are non-decreasing by construction (cumulative sums of starts)
    out = segment_attention(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        seg,
        scale=scaling,
        window=window,
        key_mask=key_mask,
        softcap=softcap,
        sinks=sinks,
        check_values=False,
    )
    return out, None
