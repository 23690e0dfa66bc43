"""The thin SMELT / baseline language model.

``SmeltLM(cfg)`` builds the baseline (``cfg.loop is None``) or the SMELT model (a loop):
token embedding, pre-norm blocks (RMSNorm -> GQA attention with RoPE -> residual; RMSNorm ->
top-k MoE -> residual), final RMSNorm and an untied LM head. The blocks are held as
``prelude``, ``span`` (a :class:`smelt_model.executor.LoopedSpan` that runs its visits in
one call) and ``coda``; the executor runs them along the schedule. Inside the span every sublayer
update is scaled by 1/r on every visit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from smelt_kernels import backends
from smelt_model.block import (
    Block,
    ForwardContext,
    MoE,
    RMSNorm,
    Rotary,
    SegmentAttention,
    init_weights,
)
from smelt_model.budget.ledger import layer_params
from smelt_model.config import IGNORE_INDEX, ModelConfig
from smelt_model.executor import Executor, LoopedSpan, LoopSchedule

__all__ = ["SmeltLM", "SmeltOutput", "IGNORE_INDEX", "valid_targets"]


def valid_targets(labels: torch.Tensor, segment_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Which next-token targets the loss counts, (B, T-1) bool: position t predicts
    ``labels[:, t+1]`` unless that label is :data:`IGNORE_INDEX` or lies in another segment
    than position t (a document's first token is not predicted from the previous one)."""
    valid = labels[:, 1:] != IGNORE_INDEX
    if segment_ids is not None:
        valid = valid & (segment_ids[:, 1:] == segment_ids[:, :-1])
    return valid


@dataclass
class SmeltOutput:
    logits: torch.Tensor
    #: mean next-token cross-entropy (targets across a segment boundary ignored), or None
    loss: Optional[torch.Tensor] = None
    #: weighted router losses (load balancing + z-loss), averaged over executed layers;
    #: None outside training or when both weights are 0. Not included in ``loss``.
    aux_loss: Optional[torch.Tensor] = None


class SmeltLM(nn.Module):
    """Baseline or SMELT model from one :class:`ModelConfig`.

    ``backend``: ``"auto"`` (best available per device), ``"torch"``, ``"cpu"``, ``"triton"``
    or ``"cuda"``, passed to the attention and MoE ops. ``recompute``: the executor's
    activation policy (``"none"``, ``"visit1"``, ``"all"``, ``"all-but-N"``).
    """

    def __init__(self, cfg: ModelConfig, backend: str = "auto", recompute: str = "none"):
        super().__init__()
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        if backend not in backends.choices():
            raise ValueError(f"backend must be one of {backends.choices()}, got {backend!r}")
        self.schedule = LoopSchedule.from_config(cfg)
        self.executor = Executor(self.schedule, recompute)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        blocks = [Block(cfg) for _ in range(cfg.n_layers)]
        p = self.schedule
        self.prelude = nn.ModuleList(blocks[: p.start])
        self.span = LoopedSpan(blocks[p.start : p.end], self.executor) if p.length else None
        self.coda = nn.ModuleList(blocks[p.end :])
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        self.backend = backend  # hands the kernel backend to every layer
        self.reset_parameters()

    # ------------------------------------------------------------------ set-up
    def reset_parameters(self, std: float = 0.02) -> None:
        nn.init.normal_(self.embed.weight, 0.0, std)
        nn.init.normal_(self.lm_head.weight, 0.0, std)
        nn.init.ones_(self.norm.weight)
        init_weights(self, self.cfg, std)

    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, name: str) -> None:
        if name not in backends.choices():
            raise ValueError(f"backend must be one of {backends.choices()}, got {name!r}")
        self._backend = name
        op_backend = None if name == "auto" else name
        for m in self.modules():  # the layers carry the backend; forward never branches on it
            if isinstance(m, (SegmentAttention, MoE)):
                m.backend = op_backend

    @property
    def recompute(self) -> str:
        return self.executor.recompute

    @recompute.setter
    def recompute(self, policy: str) -> None:
        self.executor.recompute = policy

    def layer(self, i: int) -> Block:
        """Physical layer ``i`` (0-based)."""
        p = self.schedule
        if not 0 <= i < self.cfg.n_layers:
            raise IndexError(f"layer {i} outside 0..{self.cfg.n_layers - 1}")
        if i < p.start:
            return self.prelude[i]
        if i < p.end:
            return self.span.layers[i - p.start]
        return self.coda[i - p.end]

    def num_params(self, kind: str = "total", embeddings: bool = False) -> int:
        """Parameter count: ``"total"`` or ``"active"`` (top-k experts per token).

        Non-embedding by default, which is what :func:`smelt_model.budget.ledger` counts.
        """
        if kind not in ("total", "active"):
            raise ValueError(f"kind must be 'total' or 'active', got {kind!r}")
        skip = set() if embeddings else {id(self.embed.weight), id(self.lm_head.weight)}
        n = sum(p.numel() for p in self.parameters() if id(p) not in skip)
        if kind == "active":  # the experts a token does not use, as the ledger counts them
            p = layer_params(self.cfg)
            n -= self.cfg.n_layers * (p["experts_total"] - p["experts_active"])
        return n

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.Tensor,
        segment_ids: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        *,
        cache=None,
        cache_pos: int = 0,
    ) -> SmeltOutput:
        """Logits for ``input_ids`` (B, T); loss when ``labels`` (B, T) are given.

        ``segment_ids`` (B, T) marks packed documents (non-decreasing along T); None means
        one document per row. ``labels`` follow the inputs' positions (the model shifts:
        position t predicts ``labels[:, t+1]``); ``-100`` is ignored. With a ``cache``
        (see :mod:`smelt_model.generation`), the tokens are written at ``cache_pos``.
        """
        self._check_inputs(input_ids, segment_ids, labels)
        B, T = input_ids.shape
        x = self.embed(input_ids)
        cos, sin = self.rotary.tables(cache_pos, T, x.device)
        ctx = ForwardContext(
            cos=cos, sin=sin, segment_ids=segment_ids, cache=cache, cache_pos=cache_pos
        )
        ex, p = self.executor, self.schedule
        x, aux = ex.run(lambda i: self.prelude[i], x, ctx, p.prelude)
        if self.span is not None:
            x, aux = self.span(x, ctx, aux)
        x, aux = ex.run(lambda i: self.coda[i - p.end], x, ctx, p.coda, aux)
        logits = self.lm_head(self.norm(x))

        loss = None if labels is None else self.lm_loss(logits, labels, segment_ids)
        if aux is not None:
            aux = aux / p.executed_layers
        return SmeltOutput(logits=logits, loss=loss, aux_loss=aux)

    @staticmethod
    def lm_loss(
        logits: torch.Tensor, labels: torch.Tensor, segment_ids: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Mean next-token cross-entropy; targets in another segment or -100 are ignored."""
        V = logits.shape[-1]
        pred = logits[:, :-1].reshape(-1, V).float()
        tgt = labels[:, 1:]
        valid = valid_targets(labels, segment_ids)
        tgt = torch.where(valid, tgt, torch.zeros_like(tgt)).reshape(-1).long()
        ce = F.cross_entropy(pred, tgt, reduction="none")
        valid = valid.reshape(-1)
        return (ce * valid).sum() / valid.sum().clamp_min(1)

    def _check_inputs(self, input_ids, segment_ids, labels) -> None:
        V = self.cfg.vocab_size
        dev = self.embed.weight.device
        for name, t in (("input_ids", input_ids), ("segment_ids", segment_ids), ("labels", labels)):
            if t is None:
                continue
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype not in (torch.int64, torch.int32):
                raise TypeError(f"{name} must be int64 or int32, got {t.dtype}")
            if t.dim() != 2:
                raise ValueError(f"{name} must be (batch, seq), got shape {tuple(t.shape)}")
            if t.shape != input_ids.shape:
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)}, input_ids {tuple(input_ids.shape)}"
                )
            if t.device != dev:
                raise ValueError(f"{name} is on {t.device}, the model on {dev}")
        if input_ids.shape[1] == 0:
            raise ValueError("input_ids has no tokens")
        if torch.compiler.is_compiling():
            return  # value checks need the data; shapes and dtypes were checked above
        bad_ids = (input_ids < 0) | (input_ids >= V)
        bad_labels = None
        if labels is not None:
            bad_labels = ((labels < 0) | (labels >= V)) & (labels != IGNORE_INDEX)
        decreasing = None
        if segment_ids is not None and segment_ids.shape[1] > 1:
            decreasing = segment_ids[:, 1:] < segment_ids[:, :-1]
        if dev.type == "cuda":  # no host sync: device-side asserts
            torch._assert_async(~bad_ids.any(), f"input_ids must lie in [0, {V})")
            if bad_labels is not None:
                torch._assert_async(~bad_labels.any(), f"labels must lie in [0, {V}) or be -100")
            if decreasing is not None:
                torch._assert_async(~decreasing.any(), "segment_ids must be non-decreasing")
            return
        if bad_ids.any():
            raise ValueError(
                f"input_ids must lie in [0, {V}); got values "
                f"{input_ids.min().item()}..{input_ids.max().item()}"
            )
        if bad_labels is not None and bad_labels.any():
            raise ValueError(f"labels must lie in [0, {V}) or be {IGNORE_INDEX}")
        if decreasing is not None and decreasing.any():
            raise ValueError("segment_ids must be non-decreasing along the sequence")

    # ------------------------------------------------------------------ save / load
    def save_pretrained(self, path: Union[str, Path]) -> Path:
        """Write ``model.safetensors`` and ``config.json`` into the folder ``path``."""
        from safetensors.torch import save_file

        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        self.cfg.to_json(out / "config.json")
        return out

    @classmethod
    def from_pretrained(
        cls, path: Union[str, Path], device=None, dtype=None, **kwargs
    ) -> "SmeltLM":
        """Load a folder written by :meth:`save_pretrained`."""
        from safetensors.torch import load_file

        src = Path(path)
        for f in ("config.json", "model.safetensors"):
            if not (src / f).exists():
                raise FileNotFoundError(f"{src / f} not found (expected a save_pretrained folder)")
        cfg = ModelConfig.from_json(src / "config.json")
        model = cls(cfg, **kwargs)
        state = load_file(str(src / "model.safetensors"))
        expected = model.state_dict()
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        if missing or unexpected:
            raise ValueError(
                f"{src / 'model.safetensors'} does not hold this config's parameters: "
                f"missing {missing[:3]}{' ...' if len(missing) > 3 else ''}, "
                f"unexpected {unexpected[:3]}{' ...' if len(unexpected) > 3 else ''}"
            )
        for name, t in state.items():
            if t.shape != expected[name].shape:
                raise ValueError(
                    f"{src / 'model.safetensors'}: {name} has shape {tuple(t.shape)}, the "
                    f"config's model has {tuple(expected[name].shape)}"
                )
        model.load_state_dict(state)
        if device is not None or dtype is not None:
            model = model.to(device=device, dtype=dtype)
        return model
