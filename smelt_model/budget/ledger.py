"""The ledger: parameters, training FLOPs and KV-cache bytes of one configuration, by part.

Every accounting formula of smelt lives here; the matcher, the model's ``num_params``, the
main benchmark, the trainer and the communication ledger read it. The convention reproduces
the SMELT paper's appendix (Wang et al., 2026) for all twelve sparse cells:

* Per physical layer, non-embedding parameters are attention ``2*H*(n_q*d_h) +
  2*H*(n_kv*d_h)`` (Q and O, K and V), router ``H*E``, two RMSNorm gains ``2*H`` and
  ``3*H*d_e`` per SwiGLU expert. *Active* parameters count ``top_k`` experts, *total*
  parameters all ``E``. The final RMSNorm (``H``) is added once to both, so the counts equal
  the model's ``num_params()`` exactly. A looped layer's weights count once.
* Training FLOPs per token: ``F = 6*N_exec + 12*L_exec*(n_q*d_h)*c_bar``, where ``N_exec``
  sums active parameters over *executed* layers (span layers ``r`` times) and ``c_bar`` is
  the mean number of keys a query attends to (:func:`mean_attended`). A forward is a third
  of that.
* KV-cache bytes per token: ``2 * L_exec * n_kv * d_h * bytes_per_element``.
* Compute-equivalent sparsity: ``S = 1 - N_act_eq / N`` with ``N_act_eq = (F/F0) * N0``,
  where ``F0, N0`` belong to a control that activates all of its experts (by default the
  same geometry with ``E = top_k``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from smelt_model.config import ModelConfig

__all__ = [
    "PARTS",
    "Ledger",
    "Ratios",
    "layer_params",
    "layer_counts",
    "embedding_params",
    "head_flops",
    "mean_attended",
    "ledger",
    "compare",
    "dense_control",
    "decode_flops_per_token",
]

#: the parts a layer's parameters and FLOPs are counted by (``final_norm`` once per model)
PARTS = ("attention", "router", "norms", "experts")


def layer_counts(
    hidden: int, q_dim: int, kv_dim: int, n_experts: int, expert_size: int, top_k: int
) -> dict[str, int]:
    """Parameters of one physical layer by part, from the bare geometry: ``attention``,
    ``router``, ``norms``, ``experts_active`` (top-k experts) and ``experts_total``.

    The one formula of the convention; :func:`layer_params` applies it to a config, the
    matcher to the candidates it tries."""
    expert = 3 * hidden * expert_size
    return {
        "attention": 2 * hidden * q_dim + 2 * hidden * kv_dim,
        "router": hidden * n_experts,
        "norms": 2 * hidden,
        "experts_active": top_k * expert,
        "experts_total": n_experts * expert,
    }


def layer_params(cfg: ModelConfig) -> dict[str, int]:
    """Parameters of one physical layer of ``cfg``, by part (see :func:`layer_counts`)."""
    return layer_counts(
        cfg.hidden_size, cfg.q_dim, cfg.kv_dim, cfg.n_experts, cfg.expert_size, cfg.top_k
    )


def embedding_params(cfg: ModelConfig) -> int:
    """Parameters of the untied input embedding and output head (vocab x hidden each): the
    budgets leave them out; FSDP traffic and memory estimates count them."""
    return 2 * cfg.vocab_size * cfg.hidden_size


def head_flops(cfg: ModelConfig) -> int:
    """Training FLOPs per token of the output head's matmul (``6 x vocab x hidden``): F
    leaves it out, as the paper does; a projected step counts it, since a step runs it."""
    return 6 * cfg.vocab_size * cfg.hidden_size


def shared_params(p: dict[str, int]) -> int:
    return p["attention"] + p["router"] + p["norms"]


def train_flops(
    executed_active: float, executed_layers: int, q_dim: int, c_bar: float
) -> tuple[float, float]:
    """(training FLOPs per token, its attention-score part)."""
    scores = 12.0 * executed_layers * q_dim * c_bar
    return 6.0 * executed_active + scores, scores


def mean_attended(mean_doc_len: float, seq_len: int) -> float:
    """Mean number of keys a query attends to (``c_bar``), causal inside documents.

    Documents of length ``l = min(mean_doc_len, seq_len)`` are packed into a context of
    ``seq_len`` tokens; the last one is cut at the context end. A query at position ``p``
    of its document attends to ``p + 1`` keys, so a document contributes ``l(l+1)/2``.
    With the paper's 800-token documents in 4096-token contexts, ``c_bar`` is about 392
    (the paper's tables fit 400).
    """
    if not (isinstance(seq_len, int) and seq_len >= 1):
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    if not (mean_doc_len > 0 and math.isfinite(mean_doc_len)):
        raise ValueError(f"mean_doc_len must be positive and finite, got {mean_doc_len!r}")
    doc = min(float(mean_doc_len), float(seq_len))
    full = int(seq_len // doc)
    rest = seq_len - full * doc
    total = full * doc * (doc + 1) / 2 + rest * (rest + 1) / 2
    return total / seq_len


def dense_control(cfg: ModelConfig) -> ModelConfig:
    """The same geometry with every expert active (E = top_k): the S = 0 control."""
    return cfg.replace(n_experts=cfg.top_k)


@dataclass(frozen=True)
class Ledger:
    """The budgets of one configuration (all counts non-embedding)."""

    active_params: int
    total_params: int
    flops_per_token: float
    kv_bytes_per_token: int
    executed_layers: int
    sparsity: float
    #: mean number of keys a query attends to (c-bar) used for the attention FLOPs
    mean_attended: float
    #: the attention-score part of ``flops_per_token`` (12 * L_exec * n_q * d_h * c_bar)
    attention_flops_per_token: float
    #: active parameters summed over executed layers, plus the final norm (``N_exec``)
    executed_active_params: int = 0
    #: total parameters by part: ``attention``, ``router``, ``norms``, ``experts`` (all
    #: physical layers, each once) and ``final_norm``; they sum to ``total_params``
    params_by_part: dict[str, int] = field(default_factory=dict)
    #: active parameters by the same parts; they sum to ``active_params``
    active_params_by_part: dict[str, int] = field(default_factory=dict)
    #: training FLOPs per token by part: the weight matmuls of ``attention``, ``router``,
    #: ``norms``, ``experts`` over executed layers, ``final_norm``, and ``attention_scores``
    #: (QK^T and PV); they sum to ``flops_per_token``
    flops_by_part: dict[str, float] = field(default_factory=dict)

    @property
    def forward_flops_per_token(self) -> float:
        """A forward's share of the training FLOPs (a third: forward 2, backward 4)."""
        return self.flops_per_token / 3.0


@dataclass(frozen=True, repr=False)
class Ratios:
    """Looped / baseline ratios of the three budgets."""

    flops: float
    params: float
    kv: float

    def __repr__(self) -> str:
        return f"Ratios(flops={self.flops:.4g}, params={self.params:.4g}, kv={self.kv:.4g})"

    def worst(self) -> float:
        return max(abs(self.flops - 1), abs(self.params - 1), abs(self.kv - 1))

    def within(self, tolerances: Sequence[float]) -> bool:
        tf, tp, tk = tolerances
        return abs(self.flops - 1) <= tf and abs(self.params - 1) <= tp and abs(self.kv - 1) <= tk


def _check_kv_bytes(kv_dtype_bytes) -> None:
    if not (isinstance(kv_dtype_bytes, int) and kv_dtype_bytes >= 1):
        raise ValueError(f"kv_dtype_bytes must be a positive int, got {kv_dtype_bytes!r}")


def _counts(cfg: ModelConfig, c_bar: float, kv_dtype_bytes: int) -> dict:
    p = layer_params(cfg)
    L, l_exec, H = cfg.n_layers, cfg.executed_layers, cfg.hidden_size
    total = {part: L * p[part] for part in ("attention", "router", "norms")}
    total["experts"] = L * p["experts_total"]
    total["final_norm"] = H
    active = dict(total, experts=L * p["experts_active"])
    executed = l_exec * (shared_params(p) + p["experts_active"]) + H
    flops, scores = train_flops(executed, l_exec, cfg.q_dim, c_bar)
    by_flops = {part: 6.0 * l_exec * p[part] for part in ("attention", "router", "norms")}
    by_flops["experts"] = 6.0 * l_exec * p["experts_active"]
    by_flops["final_norm"] = 6.0 * H
    by_flops["attention_scores"] = scores
    return dict(
        active=sum(active.values()),
        total=sum(total.values()),
        flops=flops,
        scores=scores,
        kv=2 * l_exec * cfg.kv_dim * kv_dtype_bytes,
        executed=executed,
        params_by_part=total,
        active_by_part=active,
        flops_by_part=by_flops,
    )


def ledger(
    cfg: ModelConfig,
    mean_doc_len: float = 800,
    seq_len: int = 4096,
    kv_dtype_bytes: int = 2,
    control: Optional[ModelConfig] = None,
) -> Ledger:
    """The budgets of ``cfg``; ``control`` (default :func:`dense_control`) sets the sparsity."""
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    _check_kv_bytes(kv_dtype_bytes)
    c_bar = mean_attended(mean_doc_len, seq_len)
    c = _counts(cfg, c_bar, kv_dtype_bytes)
    ctrl = dense_control(cfg) if control is None else control
    if not isinstance(ctrl, ModelConfig):
        raise TypeError(f"control must be a ModelConfig, got {type(ctrl).__name__}")
    c0 = _counts(ctrl, c_bar, kv_dtype_bytes)
    sparsity = 1.0 - (c["flops"] / c0["flops"]) * c0["total"] / c["total"]
    return Ledger(
        active_params=c["active"],
        total_params=c["total"],
        flops_per_token=c["flops"],
        kv_bytes_per_token=c["kv"],
        executed_layers=cfg.executed_layers,
        sparsity=sparsity,
        mean_attended=c_bar,
        attention_flops_per_token=c["scores"],
        executed_active_params=c["executed"],
        params_by_part=c["params_by_part"],
        active_params_by_part=c["active_by_part"],
        flops_by_part=c["flops_by_part"],
    )


def decode_flops_per_token(cfg: ModelConfig, context: int) -> float:
    """FLOPs of one decoded token against ``context`` cached positions: the forward of the
    executed active weights (2 per parameter) and the scores against every cached key
    (``4 * L_exec * n_q * d_h * context``)."""
    c = _counts(cfg, 1.0, 2)
    return 2.0 * c["executed"] + 4.0 * cfg.executed_layers * cfg.q_dim * context


def compare(
    baseline_cfg: ModelConfig,
    looped_cfg: ModelConfig,
    mean_doc_len: float = 800,
    seq_len: int = 4096,
) -> Ratios:
    """Looped / baseline ratios of training FLOPs, total params and KV bytes per token."""
    a = ledger(baseline_cfg, mean_doc_len, seq_len)
    b = ledger(looped_cfg, mean_doc_len, seq_len)
    return Ratios(
        flops=b.flops_per_token / a.flops_per_token,
        params=b.total_params / a.total_params,
        kv=b.kv_bytes_per_token / a.kv_bytes_per_token,
    )


@functools.lru_cache(maxsize=64)
def cached_ledger(cfg: ModelConfig, mean_doc_len: float = 800, seq_len: int = 4096) -> Ledger:
    """:func:`ledger` of ``cfg``, computed once (for the budget's inner loops; treat the
    result as read-only)."""
    return ledger(cfg, mean_doc_len, seq_len)
