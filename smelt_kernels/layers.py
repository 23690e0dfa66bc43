"""Drop-in layers: config-free ``nn.Module`` s that put smelt's kernels into any model.

    from smelt_kernels.layers import MoE, RMSNorm, SegmentAttention

    attn = SegmentAttention(hidden_size=512, n_heads=8, n_kv_heads=2, head_dim=64)
    moe = MoE(hidden_size=512, n_experts=64, expert_size=256, top_k=8, aux_loss_weight=0.01)
    h = x + attn(norm1(x), segment_ids)        # x (B, T, 512), segment_ids (B, T)
    h = h + moe(norm2(h))                      # any leading dims
    loss = lm_loss + moe.aux_loss              # router losses of the last call

The layers take plain sizes and tensors and call the public ops only
(:func:`smelt_kernels.moe_gemm.route`, :func:`smelt_kernels.moe_gemm.moe_ffn`,
:func:`smelt_kernels.attention.segment_attention`); ``backend`` is passed through to them
(None: the best one available). Expert weights use Hugging Face transformers 5's layout:
``gate_up_proj`` (E, 2 * expert_size, hidden_size) with the gate rows first and
``down_proj`` (E, hidden_size, expert_size); attention uses ``q_proj``/``k_proj``/``v_proj``/
``o_proj``.

Parameter-free submodules (``SegmentAttention.core``, ``MoE.topk``) exist so forward hooks
can observe the attention inputs and routing without any branch in the layers' code.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from .attention import segment_attention
from .dense import linear
from .moe_gemm import moe_ffn, route, router_loss
from .norm import rms_norm
from .rotary import apply_rotary

__all__ = ["Linear", "RMSNorm", "Rotary", "SegmentAttention", "MoE"]


def _sizes(layer: str, **sizes: int) -> None:
    """Each size a positive int, else one error naming it."""
    for name, v in sizes.items():
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{layer}: {name} must be an int, got {type(v).__name__}")
        if v < 1:
            raise ValueError(f"{layer}: {name} must be positive, got {v}")


def _input(layer: str, x, hidden_size: int, weight: torch.Tensor) -> None:
    """``x`` a floating tensor ending in ``hidden_size``, of the layer's weight dtype."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{layer}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1 or x.shape[-1] != hidden_size:
        raise ValueError(
            f"{layer}: x must end in hidden_size={hidden_size}, got shape {tuple(x.shape)}"
        )
    if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(
            f"{layer}: x is {x.dtype} but the layer's weights are {weight.dtype}; "
            f"convert one to the other (e.g. layer.to({x.dtype})) or run under "
            "torch.autocast"
        )


class Linear(nn.Linear):
    """``nn.Linear`` (the same parameters, state-dict names and initial draw) whose GEMMs run
    through :func:`smelt_kernels.dense.linear`: the fastest fp32 GEMM on the host, forward
    and backward. Under ``torch.autocast`` it is ``nn.Linear``'s own forward (autocast picks
    the dtype there). ``backend`` is handed to ``linear`` (None: the best available)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        backend: Optional[str] = None,
    ):
        super().__init__(in_features, out_features, bias, device, dtype)
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            return super().forward(x)
        y = linear(x, self.weight, backend=self.backend)
        return y if self.bias is None else y + self.bias


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain, computed in float32
    (:func:`smelt_kernels.norm.rms_norm`: one fused pass per row on the CPU)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        _sizes("RMSNorm", dim=dim)
        if not eps >= 0:
            raise ValueError(f"RMSNorm: eps must be >= 0, got {eps!r}")
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Rotary(nn.Module):
    """Rotary position embedding (rotate-half form) for heads of size ``head_dim``.

    :meth:`tables` gives cos/sin for a range of positions, :meth:`tables_at` for explicit
    (B, T) positions; :meth:`apply` rotates (B, T, heads, head_dim) by either. Only relative
    offsets inside a document reach the attention scores, so absolute positions in a packed
    context equal per-document positions under the segment mask.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        self.register_buffer("inv_freq", inv.float(), persistent=False)

    def tables(self, start: int, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of positions ``start .. start + length - 1``: (length, head_dim / 2)."""
        pos = torch.arange(start, start + length, device=device, dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq.to(device)[None, :]
        return freqs.cos(), freqs.sin()

    def tables_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of integer ``positions`` (B, T): (B, T, head_dim / 2)."""
        freqs = positions.float()[..., None] * self.inv_freq.to(positions.device)
        return freqs.cos(), freqs.sin()

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: (B, T, heads, D); cos/sin: (T, D/2) or (B, T, D/2)
        (:func:`smelt_kernels.rotary.apply_rotary`: one fused pass on the CPU)."""
        return apply_rotary(x, cos, sin)


class _Attend(nn.Module):
    """The attention op on prepared q, k, v: returns (output, sink or None).

    A module of its own so a forward hook sees the rotated q, k, v (k, v including any
    cached positions) and the output before ``o_proj``. ``keep_sink`` asks the op for the
    attention-sink statistic (B, n_heads) as well.
    """

    def __init__(self, backend: Optional[str]):
        super().__init__()
        self.backend = backend
        self.keep_sink = False

    def forward(self, q, k, v, segment_ids, check_values):
        if self.keep_sink:
            out, sink = segment_attention(
                q,
                k,
                v,
                segment_ids,
                return_sink=True,
                backend=self.backend,
                check_values=check_values,
            )
            return out, sink
        out = segment_attention(
            q, k, v, segment_ids, backend=self.backend, check_values=check_values
        )
        return out, None


class SegmentAttention(nn.Module):
    """GQA self-attention with RoPE and the causal segment mask, on (B, T, hidden_size).

    ``forward(x, segment_ids=None, positions=None)``: ``segment_ids`` (B, T), non-decreasing
    along T, keeps each packed document to itself (None: one document per row);
    ``positions`` (B, T) are the RoPE positions (default 0..T-1).

    Keyword-only extras for a model that drives many layers:

    * ``rope=(cos, sin)``: precomputed :class:`Rotary` tables for this call's positions
      (computed once per forward and shared by every layer) instead of ``positions``.
    * ``kv_cache``: generation. An object with ``update(k, v, segment_ids)`` that stores this
      call's rotated keys/values (B, T, n_kv_heads, head_dim) and returns the keys, values
      and segment ids of every cached position so far; the queries (this call's T tokens)
      are the last T positions. :meth:`smelt_model.generation.KVCache.slot` gives one.
    * ``check_values=False`` skips the op's host-side check of the segment-id values (for
      callers that checked them once already).
    """

    def __init__(
        self,
        hidden_size: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        rope_theta: float = 10000.0,
        backend: Optional[str] = None,
    ):
        super().__init__()
        _sizes(
            "SegmentAttention",
            hidden_size=hidden_size,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
        )
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.q_proj = Linear(hidden_size, n_heads * head_dim, bias=False)
        self.k_proj = Linear(hidden_size, n_kv_heads * head_dim, bias=False)
        self.v_proj = Linear(hidden_size, n_kv_heads * head_dim, bias=False)
        self.o_proj = Linear(n_heads * head_dim, hidden_size, bias=False)
        self.rotary = Rotary(head_dim, rope_theta)
        self.core = _Attend(backend)
        self.backend = backend

    @property
    def backend(self) -> Optional[str]:
        return self.core.backend

    @backend.setter
    def backend(self, name: Optional[str]) -> None:
        self.core.backend = name
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            if isinstance(proj, Linear):  # a user may have put another module there
                proj.backend = name

    def forward(
        self,
        x: torch.Tensor,
        segment_ids: Optional[torch.Tensor] = None,
        positions: Optional[torch.Tensor] = None,
        *,
        rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        kv_cache: Any = None,
        check_values: Optional[bool] = None,
    ) -> torch.Tensor:
        _input("SegmentAttention", x, self.q_proj.in_features, self.q_proj.weight)
        if x.dim() != 3:
            raise ValueError(f"x must be (batch, seq, hidden), got shape {tuple(x.shape)}")
        B, T, _ = x.shape
        if rope is not None:
            cos, sin = rope
        elif positions is not None:
            if positions.shape != (B, T):
                raise ValueError(f"positions must be {(B, T)}, got {tuple(positions.shape)}")
            cos, sin = self.rotary.tables_at(positions)
        else:
            cos, sin = self.rotary.tables(0, T, x.device)
        q = Rotary.apply(self.q_proj(x).view(B, T, self.n_heads, self.head_dim), cos, sin)
        k = Rotary.apply(self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        if kv_cache is not None:
            k, v, segment_ids = kv_cache.update(k, v, segment_ids)
        out, _ = self.core(q, k, v, segment_ids, check_values)
        return self.o_proj(out.reshape(B, T, self.n_heads * self.head_dim))


class _TopK(nn.Module):
    """Router logits -> (weights fp32, ids int32), both (N, top_k); hookable routing."""

    def __init__(self, top_k: int, renormalize: bool):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.backend: Optional[str] = None

    def forward(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(logits, top_k=self.top_k, renormalize=self.renormalize, backend=self.backend)


class MoE(nn.Module):
    """Top-k softmax router over SwiGLU experts (no shared experts), on (..., hidden_size).

    ``forward(x)`` returns the same shape as ``x``. The router losses of the last call in
    training mode (``aux_loss_weight`` times Switch-style load balancing
    ``E * sum_e f_e P_e``, plus ``z_loss_weight`` times the router z-loss) are kept in
    :attr:`aux_loss`, a scalar tensor, never added to the output; it is None when both
    weights are 0 and in eval mode.
    """

    def __init__(
        self,
        hidden_size: int,
        n_experts: int,
        expert_size: int,
        top_k: int = 8,
        renormalize: bool = True,
        aux_loss_weight: float = 0.0,
        z_loss_weight: float = 0.0,
        backend: Optional[str] = None,
    ):
        super().__init__()
        _sizes(
            "MoE",
            hidden_size=hidden_size,
            n_experts=n_experts,
            expert_size=expert_size,
            top_k=top_k,
        )
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k must be in [1, n_experts={n_experts}], got {top_k}")
        if aux_loss_weight < 0 or z_loss_weight < 0:
            raise ValueError("aux_loss_weight and z_loss_weight must be >= 0")
        self.hidden_size, self.n_experts, self.expert_size = hidden_size, n_experts, expert_size
        self.aux_loss_weight = aux_loss_weight
        self.z_loss_weight = z_loss_weight
        self.router = Linear(hidden_size, n_experts, bias=False)
        self.topk = _TopK(top_k, renormalize)
        self.backend = backend
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * expert_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(n_experts, hidden_size, expert_size))
        self.aux_loss: Optional[torch.Tensor] = None
        self.reset_parameters()

    @property
    def top_k(self) -> int:
        return self.topk.top_k

    @property
    def backend(self) -> Optional[str]:
        """The backend handed to ``route`` and ``moe_ffn`` (None: the best available)."""
        return self.topk.backend

    @backend.setter
    def backend(self, name: Optional[str]) -> None:
        self.topk.backend = name
        if isinstance(self.router, Linear):
            self.router.backend = name

    def reset_parameters(self, std: float = 0.02, out_std: Optional[float] = None) -> None:
        """Normal(0, std) weights; ``down_proj`` Normal(0, out_std) (default ``std``)."""
        nn.init.normal_(self.router.weight, 0.0, std)
        nn.init.normal_(self.gate_up_proj, 0.0, std)
        nn.init.normal_(self.down_proj, 0.0, std if out_std is None else out_std)

    def forward(self, x: torch.Tensor, *, return_aux: bool = False):
        """``y`` (x's shape); with ``return_aux=True`` the pair ``(y, aux)`` instead, and
        :attr:`aux_loss` is left alone (no state is written: what activation checkpointing
        under ``torch.compile`` needs, and what a model that sums the losses itself uses)."""
        _input("MoE", x, self.hidden_size, self.gate_up_proj)
        flat = x.reshape(-1, self.hidden_size)
        logits = self.router(flat).float()
        weights, ids = self.topk(logits)
        y = moe_ffn(
            flat,
            self.gate_up_proj,
            self.down_proj,
            weights,
            ids,
            backend=self.backend,
            check_values=False,
        )  # route() made the ids
        aux = None
        if self.training and (self.aux_loss_weight > 0 or self.z_loss_weight > 0):
            aux = self.router_loss(logits, ids)
        if return_aux:
            return y.view(x.shape), aux
        self.aux_loss = aux
        return y.view(x.shape)

    def router_loss(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The weighted router losses for router ``logits`` (N, E) and chosen ``ids``
        (N, top_k): :func:`smelt_kernels.moe_gemm.router_loss` over these N tokens."""
        flat = ids.reshape(-1).long()
        counts = torch.zeros(self.n_experts, device=logits.device, dtype=torch.float32)
        counts = counts.scatter_add(0, flat, torch.ones(flat.numel(), device=logits.device))
        return router_loss(
            logits,
            counts,
            top_k=ids.shape[-1],
            aux_loss_weight=self.aux_loss_weight,
            z_loss_weight=self.z_loss_weight,
        )

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, n_experts={self.n_experts}, "
            f"expert_size={self.expert_size}, top_k={self.top_k}"
        )
