"""SMELT and its baseline as a torchtitan model: :class:`SmeltTitan`.

``SmeltTitan`` *is* a :class:`smelt_model.SmeltLM` (the same embedding, blocks, loop plan,
executor and forward), made a torchtitan ``BaseModel`` as torchtitan's own ``Linear`` is
an ``nn.Linear``: by inheriting both. What changes is swapped in at build time:

* every block's MoE is a :class:`~smelt_model.titan.moe.layer.SmeltMoE` (torchtitan's router /
  dispatcher / grouped-experts seam, so its expert parallelism applies; smelt's routing
  and router losses), configured per physical layer by ``Config.moe``;
* with ``Config.attention = "flex"`` every block's attention op is torchtitan's
  FlexAttention on the segment mask (:class:`FlexSegmentAttention`) instead of smelt's
  ``segment_attention``.

``forward(tokens, positions=None, attention_masks=None)`` takes torchtitan's batch: segment
ids come from the per-document ``positions`` on the device
(:func:`~smelt_model.titan.attention.segment_ids_from_positions`); it returns
:class:`~smelt_model.titan.loss.SmeltTitanOutput` (logits, and this rank's share of the
router losses in training, scaled by 1 / gradient-accumulation steps).

With ``Config.overlap`` (and a batch of at least ``Config.chunks`` rows) the forward splits
the batch into ``chunks`` chunks of rows and interleaves them through every executed layer
(:class:`smelt_model.executor.Interleaved`): each MoE layer's dispatch and combine of one
chunk are in flight while the other chunks compute, forward and backward (the schedule is
in docs/titan.md, *Communication*). A layer the recompute policy recomputes runs its chunks
together under one activation checkpoint, interleaved again when the backward recomputes
it. The result equals the forward without overlap; the router losses are computed over
all chunks together.

Parameters and FLOPs come from the ledger (:func:`smelt_model.budget.ledger`); the model
config travels inside every checkpoint as the uint8 buffer ``config_json`` (its JSON), so
:mod:`smelt_model.titan.checkpoint.export` needs nothing else.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import torch
from torch import nn
from torchtitan.models.common.attention import FlexAttention, create_attention_mask
from torchtitan.protocols.model import BaseModel
from torchtitan.protocols.module import Module
from torchtitan.tools.logging import logger

from smelt_model.block import ForwardContext, Rotary, SegmentAttention
from smelt_model.budget import embedding_params, ledger
from smelt_model.config import ModelConfig
from smelt_model.executor import Interleaved
from smelt_model.model import SmeltLM, SmeltOutput
from smelt_model.titan.attention import segment_ids_from_positions
from smelt_model.titan.checkpoint.state_dict import config_bytes
from smelt_model.titan.loss import SmeltTitanOutput
from smelt_model.titan.moe.layer import moe_config
from smelt_model.titan.parallel.parallelize import update_model_config

__all__ = ["SmeltTitan", "FlexSegmentAttention"]

ATTENTION = ("smelt", "flex")


class FlexSegmentAttention(Module):
    """torchtitan's FlexAttention on the causal segment mask, as a SMELT attention op.

    Called as smelt's attention op is: ``(q, k, v, segment_ids, check_values) ->
    (out, None)`` with q (B, T, Hq, D), k and v (B, T, Hkv, D). The block mask is built
    once per ``segment_ids`` tensor (every layer of a forward shares it; the chunks of an
    overlapped forward keep one each, up to :attr:`KEPT`).
    """

    #: block masks kept (one per chunk of an overlapped forward)
    KEPT = 8

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        flex: FlexAttention.Config = field(default_factory=FlexAttention.Config)

    def __init__(self, config: Config):
        super().__init__()
        self.flex = config.flex.build()
        self.block_size = config.flex.block_size
        self._masks: list[tuple[Any, Any]] = []  # (weakref to segment_ids, mask), newest last

    def _block_mask(self, segment_ids: torch.Tensor, B: int, T: int, device):
        for ref, mask in self._masks:
            if ref() is segment_ids:
                return mask
        seg = segment_ids

        def mask_mod(b, h, q_idx, kv_idx):
            causal = q_idx >= kv_idx
            if seg is None:
                return causal
            return causal & (seg[b, q_idx] == seg[b, kv_idx])

        mask = create_attention_mask(
            mask_mod, B, None, T, T, device=device, BLOCK_SIZE=self.block_size
        )
        if segment_ids is not None:
            live = [(ref, m) for ref, m in self._masks if ref() is not None]
            self._masks = live[-(self.KEPT - 1) :] + [(weakref.ref(segment_ids), mask)]
        return mask

    def forward(self, q, k, v, segment_ids, check_values=None):
        B, T = q.shape[:2]
        mask = self._block_mask(segment_ids, B, T, q.device)
        out = self.flex(q, k, v, attention_masks=mask, enable_gqa=q.shape[2] != k.shape[2])
        return out, None


class SmeltTitan(SmeltLM, BaseModel):
    """A SMELT (or baseline) model that torchtitan builds, shards and trains."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        arch: ModelConfig
        #: the preset it came from (a name for logs)
        preset: str = ""
        #: one MoE config per physical layer (torchtitan's MoE seam)
        moe: list = field(default_factory=list)
        #: "smelt" (segment_attention) or "flex" (torchtitan's FlexAttention)
        attention: Literal["smelt", "flex"] = "smelt"
        flex: FlexSegmentAttention.Config = field(default_factory=FlexSegmentAttention.Config)
        #: smelt's activation policy (smelt_model.executor.RECOMPUTE_POLICIES)
        recompute: str = "none"
        #: gradient-accumulation steps of the run (scales the router-loss share)
        grad_accum_steps: int = 1
        #: mean document length the ledger's attention FLOPs assume (torchtitan's MFU)
        mean_doc_len: float = 800.0
        #: chunked overlap of the expert-parallel exchanges with compute (module docstring)
        overlap: bool = False
        #: the chunks of rows the overlap splits each batch into
        chunks: int = 2
        #: the parallel plan the run uses (a smelt_model.cluster.ParallelPlan; None: every
        #: layer expert-parallel, torchtitan's layout)
        plan: Any = None
        #: ranks per node of the run (a gather layer's experts with gather_group "node")
        node_size: int = 1

        def __post_init__(self) -> None:
            if not isinstance(self.arch, ModelConfig):
                raise TypeError(f"arch must be a ModelConfig, got {type(self.arch).__name__}")
            if not self.moe:
                self.moe = [moe_config(self.arch) for _ in range(self.arch.n_layers)]
            if len(self.moe) != self.arch.n_layers:
                raise ValueError(
                    f"moe needs one config per layer ({self.arch.n_layers}), got {len(self.moe)}"
                )
            if self.attention not in ATTENTION:
                raise ValueError(f"attention must be one of {ATTENTION}, got {self.attention!r}")
            if isinstance(self.chunks, bool) or not isinstance(self.chunks, int):
                raise TypeError(f"chunks must be an int, got {self.chunks!r}")
            if self.chunks < 2:
                raise ValueError(f"chunks must be 2 or more, got {self.chunks}")

        def update_from_config(self, *, config, **kwargs) -> None:
            update_model_config(self, config)

        def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
            """(parameters including embeddings, training FLOPs per token) from the ledger.

            The attention part assumes documents of ``mean_doc_len`` tokens packed into
            contexts of ``seq_len``; the looped span counts once in parameters and r
            times in FLOPs.
            """
            led = ledger(self.arch, mean_doc_len=min(self.mean_doc_len, seq_len), seq_len=seq_len)
            logger.info(
                f"smelt ledger ({self.preset or 'model'}, seq_len {seq_len}): "
                f"params by part {led.params_by_part}, training FLOPs per token "
                f"by part { {k: f'{v:.4g}' for k, v in led.flops_by_part.items()} }"
            )
            return led.total_params + embedding_params(self.arch), int(round(led.flops_per_token))

    def __init__(self, config: Config):
        SmeltLM.__init__(self, config.arch, recompute=config.recompute)
        self.config = config
        self.grad_accum_steps = config.grad_accum_steps
        self.overlap = config.overlap
        self.chunks = config.chunks
        for i, moe_cfg in enumerate(config.moe):
            self.layer(i).moe = moe_cfg.build()
        if config.attention == "flex":
            for m in self.modules():
                if isinstance(m, SegmentAttention):
                    m.core = config.flex.build()
        self.register_buffer("config_json", config_bytes(config.arch), persistent=True)

    # ------------------------------------------------------------------ torchtitan protocol
    def verify_module_protocol(self) -> None:
        """smelt's own layers are plain ``nn.Module`` s (initialised by
        :meth:`SmeltLM.reset_parameters`); only the MoE layers must be torchtitan
        ``Module`` s, since torchtitan shards and initialises them."""
        for i in range(self.cfg.n_layers):
            if not isinstance(self.layer(i).moe, Module):
                raise RuntimeError(f"layer {i}: the MoE is not a torchtitan Module")

    def _init_self_buffers(self, *, buffer_device: Optional[torch.device] = None) -> None:
        device = buffer_device or self.config_json.device
        for m in self.modules():
            if isinstance(m, Rotary):
                fresh = Rotary(self.cfg.head_dim, self.cfg.rope_theta)
                m.inv_freq = fresh.inv_freq.to(device)
        self.config_json = config_bytes(self.cfg).to(device)

    def set_router_stats_group(self, group) -> None:
        """Sum the router statistics over ``group`` (the data-parallel ranks)."""
        for i in range(self.cfg.n_layers):
            self.layer(i).moe.stats_group = group

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        tokens: torch.Tensor,
        positions: Optional[torch.Tensor] = None,
        attention_masks: Any = None,
    ) -> SmeltTitanOutput:
        segment_ids = None if positions is None else segment_ids_from_positions(positions)
        if self.overlap and tokens.dim() == 2 and tokens.shape[0] >= self.chunks:
            out = self._forward_interleaved(tokens, segment_ids)
        else:
            out = SmeltLM.forward(self, tokens, segment_ids)
        aux = out.aux_loss
        if aux is not None and self.grad_accum_steps != 1:
            aux = aux / self.grad_accum_steps
        return SmeltTitanOutput(out.logits, aux)

    def _forward_interleaved(
        self, tokens: torch.Tensor, segment_ids: Optional[torch.Tensor]
    ) -> SmeltOutput:
        """``SmeltLM.forward`` (logits and router losses) on ``chunks`` chunks of rows at
        once (their sizes differ by one row at most)."""
        self._check_inputs(tokens, segment_ids, None)
        B, T = tokens.shape
        bounds = [c * B // self.chunks for c in range(self.chunks + 1)]
        rows = [slice(a, b) for a, b in zip(bounds, bounds[1:])]
        cos, sin = self.rotary.tables(0, T, tokens.device)
        state = Interleaved.start(
            [self.embed(tokens[r]) for r in rows],
            [
                ForwardContext(cos, sin, None if segment_ids is None else segment_ids[r], chunk=c)
                for c, r in enumerate(rows)
            ],
        )
        ex, p = self.executor, self.schedule
        state, _ = ex.run(lambda i: self.prelude[i], state, None, p.prelude)
        if self.span is not None:
            state, _ = self.span(state, None)
        state, _ = ex.run(lambda i: self.coda[i - p.end], state, None, p.coda)
        logits = torch.cat(state.finish(lambda x: self.lm_head(self.norm(x))))
        aux = None
        for step, stats in zip(p.steps, state.extras()):
            if stats[0] is None:
                continue
            loss = self.layer(step.layer).moe.router_loss(
                torch.cat([s.logits for s in stats]), sum(s.counts for s in stats)
            )
            aux = loss if aux is None else aux + loss
        if aux is not None:
            aux = aux / p.executed_layers
        return SmeltOutput(logits=logits, aux_loss=aux)

    @classmethod
    def from_arch(cls, cfg: ModelConfig, **config_fields: Any) -> "SmeltTitan":
        """A model of ``cfg`` outside the trainer (tests, export)."""
        return cls(cls.Config(arch=cfg, **config_fields))
