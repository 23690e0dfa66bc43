"""The thin SMELT / baseline language model.

``SmeltLM(cfg)`` builds the baseline (``cfg.loop is None``) or the SMELT model (a loop):
token embedding, pre-norm blocks (RMSNorm -> GQA attention with RoPE -> residual; RMSNorm ->
top-k MoE -> residual), final RMSNorm and an untied LM head. The blocks are held as
``prelude``, ``span`` (a :class:`smelt_model.executor.LoopedSpan` that runs its visits in
one call) and ``coda``; the executor runs them along the schedule. Inside the span every sublayer
update is scaled by 1/r on every visit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from smelt_kernels import backends
from smelt_model.block import (
    Block,
    ForwardContext,
    Linear,
    MoE,
    RMSNorm,
    Rotary,
    SegmentAttention,
    init_weights,
)
from smelt_model.budget import memory
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
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
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
            if isinstance(m, (SegmentAttention, MoE, Linear)):
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
        """Load a folder written by :meth:`save_pretrained`.

        Before anything is built, ``config.json`` is checked against the weights' shapes as
        the safetensors header gives them (nothing loaded) and the model it describes against
        the memory this machine has (:mod:`smelt_model.budget.memory`): a config that does not
        fit its weights, or whose model (its loop schedule included) could not be held, is one
        ``ValueError`` naming the file."""
        src = Path(path)
        for f in ("config.json", "model.safetensors"):
            if not (src / f).exists():
                raise FileNotFoundError(f"{src / f} not found (expected a save_pretrained folder)")
        cfg = ModelConfig.from_json(src / "config.json")
        weights = src / "model.safetensors"
        shapes, stored = stored_shapes(weights)
        check_fits_weights(cfg, shapes, stored, src)
        model = cls(cfg, **kwargs)
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        missing = sorted(set(expected) - set(shapes))
        unexpected = sorted(set(shapes) - set(expected))
        if missing or unexpected:
            raise ValueError(
                f"{weights} does not hold this config's parameters: "
                f"missing {missing[:3]}{' ...' if len(missing) > 3 else ''}, "
                f"unexpected {unexpected[:3]}{' ...' if len(unexpected) > 3 else ''}"
            )
        for name, shape in shapes.items():
            if shape != expected[name]:
                raise ValueError(
                    f"{weights}: {name} has shape {shape}, the config's model has {expected[name]}"
                )
        model.load_state_dict(load_file(str(weights)))
        if device is not None or dtype is not None:
            model = model.to(device=device, dtype=dtype)
        return model


#: bytes per element of the safetensors dtypes (an unknown one counts as the widest)
_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2}
_DTYPE_BYTES.update({"I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1})
#: host bytes of one executed step of the loop schedule and its executor (measured: about 190)
SCHEDULE_STEP_BYTES = 256


def stored_shapes(weights: Path) -> tuple[dict[str, tuple[int, ...]], int]:
    """The shape of every tensor in the safetensors file ``weights`` and the bytes they take,
    from its header alone; ``ValueError`` naming the file when it is not a safetensors file."""
    try:
        with safe_open(str(weights), framework="pt") as f:
            slices = {k: f.get_slice(k) for k in f.keys()}
            found = {k: (tuple(s.get_shape()), s.get_dtype()) for k, s in slices.items()}
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{weights}: not a readable safetensors file ({e})") from None
    stored = sum(math.prod(shape) * _DTYPE_BYTES.get(dt, 8) for shape, dt in found.values())
    return {k: shape for k, (shape, _) in found.items()}, stored


def check_fits_weights(
    cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], stored: int, folder: Path
) -> None:
    """Refuse ``cfg`` (read from ``folder``'s ``config.json``) before its model is built: its
    parameter count must be the number of elements ``shapes`` holds (the stored weights, of
    ``stored`` bytes), and the model built in fp32, the weights loaded beside it and the loop
    schedule expanded must fit the memory this machine has."""
    # the loop schedule first, by arithmetic: the estimate expands it
    loop = cfg.loop
    executed = cfg.n_layers + ((loop.count - 1) * loop.length if loop is not None else 0)
    schedule = {"loop schedule": executed * SCHEDULE_STEP_BYTES, "runtime": memory.RUNTIME_BYTES}
    what = f"loading {folder} ({executed:,} executed layers)"
    hint = "check config.json's loop and sizes"
    available = memory.available()
    memory.check({"model": schedule}, available, what=what, hint=hint)
    parts = memory.estimate(cfg, tokens=0, seq_len=1, train=False, forward=False)
    count = parts["weights"] // 4  # the estimate's fp32 weights: 4 bytes per parameter
    held = sum(math.prod(shape) for shape in shapes.values())
    if count != held:
        raise ValueError(
            f"{folder / 'config.json'} describes a model of {count:,} parameters "
            f"(vocab_size {cfg.vocab_size}, n_layers {cfg.n_layers}, hidden_size "
            f"{cfg.hidden_size}), but {folder / 'model.safetensors'} holds {held:,}"
        )
    parts.update(schedule, **{"stored weights": stored})
    memory.check({"model": parts}, available, what=what, hint=hint)
