"""smelt's segment attention as torchtitan's document-masked attention.

:class:`SmeltVarlenAttention` replaces torchtitan's ``VarlenAttention`` (flash varlen,
CUDA only) as a model's inner attention. It subclasses ``VarlenAttention`` so the trainer
still hands it the per-document metadata it builds from the batch positions
(``VarlenMetadata``); from the cumulative document lengths ``cu_seq_q`` it derives the
segment ids of every token *on the device* (:func:`segment_ids_from_cu_seqlens`: one
``searchsorted``, no host loop) and calls :func:`smelt_kernels.attention.segment_attention`:
causal attention inside each document, GQA, in the dtype of q. A value head size smaller
than the query/key head size (MLA, as in deepseek-v3) is zero-padded for the kernel and
sliced off its output.

Switched on in a stock model with ``--override.imports
smelt_model.titan.attention.smelt_attention`` (from its flex or varlen attention).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torchtitan.config.override import derive, override
from torchtitan.models.common.attention import FlexAttention, VarlenAttention, VarlenMetadata

from smelt_kernels.attention import segment_attention

__all__ = [
    "SmeltVarlenAttention",
    "smelt_attention",
    "segment_ids_from_cu_seqlens",
    "segment_ids_from_positions",
]


def segment_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
    """(batch, seq_len) int32 document ids of packed rows from cumulative document starts.

    ``cu_seqlens``: (n_docs + 1,) the start of every document in the flattened
    ``batch * seq_len`` tokens, then the total (torchtitan's ``cu_seq_q``); documents never
    cross a row. Token t belongs to the last document starting at or before it.
    """
    tokens = torch.arange(batch * seq_len, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    ids = torch.searchsorted(cu_seqlens.contiguous(), tokens, right=True) - 1
    return ids.view(batch, seq_len).to(torch.int32)


def segment_ids_from_positions(positions: torch.Tensor) -> torch.Tensor:
    """(B, T) int32 document ids from per-document positions (a document starts at 0)."""
    return torch.cumsum(positions == 0, dim=1, dtype=torch.int32)


class SmeltVarlenAttention(VarlenAttention):
    """Inner attention by :func:`~smelt_kernels.attention.segment_attention` (see the
    module docstring). ``backend``: the smelt attention backend (None: best available)."""

    @dataclass(kw_only=True, slots=True)
    class Config(VarlenAttention.Config):
        backend: str | None = None

    def __init__(self, config: Config) -> None:
        if tuple(config.window_size) != (-1, 0):
            raise ValueError(
                f"SmeltVarlenAttention: window_size must be (-1, 0) (causal "
                f"inside documents), got {tuple(config.window_size)}"
            )
        super().__init__(config)
        self.backend = config.backend

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: VarlenMetadata,
        scale: float | None = None,
        out_transform: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if not isinstance(attention_masks, VarlenMetadata):
            raise TypeError(
                f"attention_masks must be a VarlenMetadata, got {type(attention_masks).__name__}"
            )
        if out_transform is not None:
            raise ValueError(
                "SmeltVarlenAttention: out_transform needs a differentiable "
                "log-sum-exp, which segment_attention does not return"
            )
        B, L = q_BLNH.shape[:2]
        segments = segment_ids_from_cu_seqlens(attention_masks.cu_seq_q, B, L)
        v_dim = v_BLNH.shape[-1]
        if v_dim < q_BLNH.shape[-1]:
            v_BLNH = F.pad(v_BLNH, (0, q_BLNH.shape[-1] - v_dim))
        out = segment_attention(
            q_BLNH,
            k_BLNH,
            v_BLNH.to(q_BLNH.dtype),
            segments,
            scale=scale,
            backend=self.backend,
            check_values=False,
        )
        return out[..., :v_dim]


@override(
    target=VarlenAttention.Config,
    exact=True,
    description="smelt segment attention from the document boundaries",
)
def smelt_attention_from_varlen(
    cfg: VarlenAttention.Config, backend: str | None = None
) -> SmeltVarlenAttention.Config:
    """Stock ``VarlenAttention`` -> :class:`SmeltVarlenAttention`."""
    return derive(cfg, SmeltVarlenAttention.Config, backend=backend)


@override(
    target=FlexAttention.Config,
    exact=True,
    description="smelt segment attention in place of FlexAttention",
)
def smelt_attention(
    cfg: FlexAttention.Config, backend: str | None = None
) -> SmeltVarlenAttention.Config:
    """Stock ``FlexAttention`` (the qwen3 and deepseek-v3 default) ->
    :class:`SmeltVarlenAttention`; the trainer then builds varlen metadata for it."""
    return SmeltVarlenAttention.Config(
        backend=backend, param_init=cfg.param_init, sharding_config=cfg.sharding_config
    )
