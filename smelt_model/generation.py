"""Generation with a static KV cache that has one slot per *executed* layer.

A span layer's second visit recomputes Q, K, V from the updated residual stream, so it has
K/V of its own: the cache holds ``executed_layers`` slots, exactly as the ledger counts KV
bytes. The prompt is prefilled with the segment-masked attention kernel; each decode step
then attends from the new token to the cache (the kernel's decode form).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["KVCache", "CacheSlot", "generate"]


class KVCache:
    """Static K/V buffers: ``k``, ``v`` of shape (slots, B, max_len, n_kv_heads, head_dim),
    and the segment ids of the cached positions, (B, max_len)."""

    def __init__(self, slots: int, batch: int, max_len: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device=None):
        for name, v in (("slots", slots), ("batch", batch), ("max_len", max_len),
                        ("n_kv_heads", n_kv_heads), ("head_dim", head_dim)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        shape = (slots, batch, max_len, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.segment_ids = torch.zeros(batch, max_len, dtype=torch.int64, device=device)
        self.max_len = max_len

    @classmethod
    def for_config(cls, cfg, batch: int, max_len: int, dtype: torch.dtype = torch.float32,
                   device=None) -> "KVCache":
        """A cache with one slot per executed layer of ``cfg``."""
        return cls(cfg.executed_layers, batch, max_len, cfg.n_kv_heads, cfg.head_dim,
                   dtype=dtype, device=device)

    @classmethod
    def for_model(cls, model, batch: int, max_len: int,
                  dtype: Optional[torch.dtype] = None) -> "KVCache":
        w = model.embed.weight
        return cls.for_config(model.cfg, batch, max_len, dtype=dtype or w.dtype, device=w.device)

    @property
    def nbytes(self) -> int:
        """Bytes of K and V (the segment-id row is bookkeeping, not counted)."""
        return self.k.nbytes + self.v.nbytes

    def bytes_per_token(self) -> float:
        return self.nbytes / (self.k.shape[1] * self.max_len)

    def update(self, slot: int, pos: int, k: torch.Tensor, v: torch.Tensor,
               segment_ids: Optional[torch.Tensor]):
        """Write this call's K/V at ``pos`` of ``slot``; return all K/V/segments so far."""
        T = k.shape[1]
        end = pos + T
        if end > self.max_len:
            raise ValueError(f"the cache holds {self.max_len} positions; writing up to {end}")
        self.k[slot, :, pos:end] = k
        self.v[slot, :, pos:end] = v
        if segment_ids is not None and slot == 0:
            self.segment_ids[:, pos:end] = segment_ids
        return self.k[slot, :, :end], self.v[slot, :, :end], self.segment_ids[:, :end]

    def slot(self, slot: int, pos: int) -> "CacheSlot":
        """One executed layer's view for a call whose tokens start at ``pos``: what
        :class:`smelt_kernels.layers.SegmentAttention` takes as ``kv_cache``."""
        return CacheSlot(self, slot, pos)


class CacheSlot:
    """Slot ``slot`` of a :class:`KVCache`, written at ``pos``: ``update(k, v, segment_ids)``
    stores this call's K/V and returns all K/V/segment ids cached so far."""

    __slots__ = ("cache", "index", "pos")

    def __init__(self, cache: KVCache, index: int, pos: int):
        self.cache, self.index, self.pos = cache, index, pos

    def update(self, k: torch.Tensor, v: torch.Tensor, segment_ids: Optional[torch.Tensor]):
        return self.cache.update(self.index, self.pos, k, v, segment_ids)


def _sample(logits: torch.Tensor, temperature: float, top_k: Optional[int],
            generator: Optional[torch.Generator]) -> torch.Tensor:
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    *,
    segment_ids: Optional[torch.Tensor] = None,
    use_cache: bool = True,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Continue ``prompt_ids`` (B, T) by ``max_new_tokens``; returns (B, T + n).

    ``temperature=0`` is greedy decoding; ``top_k`` restricts sampling to the k most likely
    tokens. ``segment_ids`` (B, T) may pack several documents in the prompt; new tokens
    continue the last one. ``use_cache=False`` recomputes the whole sequence every step
    (the reference the cache is tested against).
    """
    if not isinstance(prompt_ids, torch.Tensor) or prompt_ids.dim() != 2:
        raise ValueError("prompt_ids must be a (batch, seq) tensor")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
    if not (temperature >= 0):
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
    was_training = model.training
    model.eval()
    try:
        B, T = prompt_ids.shape
        out = torch.empty(B, T + max_new_tokens, dtype=prompt_ids.dtype, device=prompt_ids.device)
        out[:, :T] = prompt_ids
        seg = torch.zeros_like(out) if segment_ids is None else torch.empty_like(out)
        if segment_ids is not None:
            seg[:, :T] = segment_ids
            seg[:, T:] = segment_ids[:, -1:]
        if max_new_tokens == 0:
            return out
        if not use_cache:
            for i in range(max_new_tokens):
                n = T + i
                logits = model(out[:, :n], seg[:, :n]).logits[:, -1]
                out[:, n] = _sample(logits, temperature, top_k, generator)
            return out
        cache = KVCache.for_model(model, B, T + max_new_tokens)
        logits = model(prompt_ids, seg[:, :T], cache=cache, cache_pos=0).logits[:, -1]
        for i in range(max_new_tokens):
            n = T + i
            out[:, n] = _sample(logits, temperature, top_k, generator)
            if i + 1 < max_new_tokens:
                logits = model(out[:, n:n + 1], seg[:, n:n + 1], cache=cache,
                               cache_pos=n).logits[:, -1]
        return out
    finally:
        model.train(was_training)
