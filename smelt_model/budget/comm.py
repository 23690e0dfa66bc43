"""The communication ledger: bytes one rank sends per training step under FSDP2 and expert
parallelism (EP), for one configuration and for a SMELT / baseline pair.

    from smelt_model import budget, presets
    base, smelt = presets.pair("200M-S95")
    c = budget.comm(smelt, 262144, ep=8, dp_shard=8)    # a Comm: bytes per step per rank
    c.ep_bytes, c.fsdp_bytes                              # the two kinds of traffic
    budget.ratios(base, smelt, 262144, ep=8, dp_shard=8)  # CommRatios(ep=1.2375, ...)

The counts come from the ledger (:func:`smelt_model.budget.ledger`): the number of executed
MoE layers, and the parameters by part. What is counted, and how:

* **Mesh.** ``dp_shard`` data-parallel ranks; the ``ep`` ranks of an expert-parallel group
  are carved out of them (``dp_shard = efsdp x ep``, as torchtitan's mesh rule has it).
  ``tokens_per_step`` is the global batch in tokens; each rank holds ``tokens_per_step /
  dp_shard`` of them. One micro-batch per step; no tensor, context or pipeline parallelism,
  no replicated data-parallel axis.
* **EP all-to-alls.** Every executed MoE layer (a span layer once per visit) runs a
  dispatch and a combine all-to-all in the forward, and their two mirrors in the backward:
  the combine's backward sends gradients the way the dispatch sent tokens, the dispatch's
  backward the way the combine sent outputs. One row of ``hidden_size`` elements of
  ``dtype`` moves per (token, slot) pair routed to an expert on another rank, as
  torchtitan's all-to-all dispatcher does (no de-duplication of a token's slots that land on
  the same rank). Only what a rank **sends to other ranks** is counted: the split that stays
  on the rank crosses no link. Experts are placed contiguously, ``n_experts / ep`` per rank
  (rank ``i`` holds experts ``i*E/ep .. (i+1)*E/ep - 1``, torchtitan's ``Shard(0)``).
  Under uniform routing (the default) a rank sends ``(ep - 1) / ep`` of its
  ``tokens x top_k`` rows in each of the four collectives. With a ``routing`` (one
  ``(ep, n_experts)`` matrix per executed MoE layer: entry ``[i][e]`` is how many (token,
  slot) pairs rank ``i`` routes to expert ``e``), each collective field is the sum over
  layers of what the **busiest** rank sends in it (the collective ends when that rank is
  done), and ``dispatch_by_rank`` / ``combine_by_rank`` give every rank's own forward sums.
  The exchange of the split sizes (``ep`` integers per rank) and activation recompute
  (which would repeat a recomputed block's forward all-to-alls) are not counted.
* **FSDP2.** Parameters are all-gathered in ``dtype`` before the forward and again before
  the backward when ``reshard_after_forward``, and their gradients reduce-scattered once in
  ``reduce_dtype`` (fp32 by default, torchtitan's ``mixed_precision_reduce``). The looped
  span is one FSDP unit, so its shared weights are gathered once per forward and reduced
  once per step: every physical parameter counts once, never once per visit. Expert weights
  are sharded over the EP group's FSDP axis (``efsdp = dp_shard / ep`` ranks; each EP rank
  holds ``1/ep`` of them), everything else (attention, router, norms, the final norm, and
  the untied input and output embeddings) over all ``dp_shard`` ranks. Collectives follow
  the ring convention: over ``n`` ranks a rank sends ``(n - 1) / n`` of the gathered (or
  reduced) buffer.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from ..config import ModelConfig, _check_int
from .ledger import compare, embedding_params, ledger

__all__ = ["DTYPE_BYTES", "Comm", "CommRatios", "comm", "ratios", "dtype_bytes"]

#: element sizes of the dtypes communication may use
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}

#: the parameter parts (of ``Ledger.params_by_part``) that FSDP shards over the EP mesh
EXPERT_PARTS = ("experts",)


def dtype_bytes(dtype: Any, name: str = "dtype") -> int:
    """Bytes per element of ``dtype``: a name from :data:`DTYPE_BYTES` or a torch dtype."""
    key = str(dtype).removeprefix("torch.")
    if key not in DTYPE_BYTES:
        raise ValueError(f"{name} must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    return DTYPE_BYTES[key]


def _ring(n: int) -> float:
    return (n - 1) / n


@dataclass(frozen=True)
class Comm:
    """Bytes one rank sends in one training step (see the module docstring for the rules).

    The four EP fields are the dispatch and combine all-to-alls of the forward and of the
    backward, summed over the executed MoE layers; the three FSDP fields are the forward
    all-gather, the backward re-gather (0 without ``reshard_after_forward``) and the gradient
    reduce-scatter. ``fsdp_by_part`` splits the FSDP bytes by parameter part (the ledger's
    parts plus ``embeddings``).
    """

    tokens_per_step: int
    ep: int
    dp_shard: int
    dtype: str
    reduce_dtype: str
    #: executed MoE layers (span layers once per visit): one dispatch and one combine each
    moe_layers: int
    dispatch_forward: float
    combine_forward: float
    dispatch_backward: float
    combine_backward: float
    fsdp_all_gather_forward: float
    fsdp_all_gather_backward: float
    fsdp_reduce_scatter: float
    #: what each EP rank sends in the forward dispatches (the backward combines send as much)
    dispatch_by_rank: tuple[float, ...] = ()
    #: what each EP rank sends in the forward combines (the backward dispatches send as much)
    combine_by_rank: tuple[float, ...] = ()
    fsdp_by_part: dict[str, float] = field(default_factory=dict)

    @property
    def efsdp(self) -> int:
        """Size of the FSDP axis the expert weights shard over (``dp_shard / ep``)."""
        return self.dp_shard // self.ep

    @property
    def tokens_per_rank(self) -> int:
        return self.tokens_per_step // self.dp_shard

    @property
    def ep_bytes(self) -> float:
        """The four EP all-to-alls together."""
        return (
            self.dispatch_forward
            + self.combine_forward
            + self.dispatch_backward
            + self.combine_backward
        )

    @property
    def ep_by_rank(self) -> tuple[float, ...]:
        """What each EP rank sends in all four all-to-alls of all layers."""
        return tuple(2 * (d + c) for d, c in zip(self.dispatch_by_rank, self.combine_by_rank))

    @property
    def fsdp_bytes(self) -> float:
        """The FSDP all-gathers and reduce-scatter together."""
        return (
            self.fsdp_all_gather_forward + self.fsdp_all_gather_backward + self.fsdp_reduce_scatter
        )

    @property
    def total_bytes(self) -> float:
        return self.ep_bytes + self.fsdp_bytes

    @property
    def ep_bytes_per_token(self) -> float:
        """EP bytes per token the rank holds."""
        return self.ep_bytes / self.tokens_per_rank


def _routing_rows(
    routing: Any, layers: int, ep: int, n_experts: int, rows_per_rank: int
) -> list[list[list[int]]]:
    """``routing`` as nested lists of ints, checked: ``layers`` matrices of ``(ep,
    n_experts)`` non-negative counts whose rows each sum to ``rows_per_rank``."""
    if isinstance(routing, (str, bytes)) or not hasattr(routing, "__len__"):
        raise TypeError(
            f"routing must be a sequence of (ep, n_experts) count matrices, got "
            f"{type(routing).__name__}"
        )
    if len(routing) != layers:
        raise ValueError(
            f"routing must hold one matrix per executed MoE layer ({layers}), got {len(routing)}"
        )
    out = []
    for li, m in enumerate(routing):
        m = m.tolist() if hasattr(m, "tolist") else m
        where = f"routing[{li}]"
        if not (
            isinstance(m, (list, tuple))
            and len(m) == ep
            and all(isinstance(r, (list, tuple)) and len(r) == n_experts for r in m)
        ):
            raise ValueError(f"{where} must be an (ep, n_experts) = ({ep}, {n_experts}) matrix")
        rows = []
        for i, r in enumerate(m):
            for v in r:
                if (
                    isinstance(v, bool)
                    or not isinstance(v, numbers.Real)
                    or not v >= 0
                    or v != int(v)
                ):
                    raise ValueError(
                        f"{where} must hold non-negative integer counts, got {v!r} in row {i}"
                    )
            r = [int(v) for v in r]
            if sum(r) != rows_per_rank:
                raise ValueError(
                    f"{where} row {i} routes {sum(r)} (token, slot) pairs; a rank holding "
                    f"tokens_per_step / dp_shard tokens routes tokens x top_k = {rows_per_rank}"
                )
            rows.append(r)
        out.append(rows)
    return out


def _ep_rows(
    cfg: ModelConfig, layers: int, ep: int, rows_per_rank: int, routing: Any
) -> tuple[list[float], list[float], float, float]:
    """Rows sent per rank in the forward dispatches and combines (summed over layers), and
    the sums over layers of the busiest rank's dispatch and combine rows."""
    if routing is None:
        sent = layers * rows_per_rank * (ep - 1) / ep
        return [sent] * ep, [sent] * ep, sent, sent
    per_rank = cfg.n_experts // ep
    dispatch, combine = [0.0] * ep, [0.0] * ep
    worst_d = worst_c = 0.0
    for m in _routing_rows(routing, layers, ep, cfg.n_experts, rows_per_rank):
        # out[i]: rows rank i sends to experts on other ranks; back[i]: rows it received from
        # other ranks for its own experts, which its combine sends back
        out = [sum(v for e, v in enumerate(m[i]) if e // per_rank != i) for i in range(ep)]
        back = [
            sum(
                m[j][e]
                for j in range(ep)
                if j != i
                for e in range(i * per_rank, (i + 1) * per_rank)
            )
            for i in range(ep)
        ]
        for i in range(ep):
            dispatch[i] += out[i]
            combine[i] += back[i]
        worst_d += max(out)
        worst_c += max(back)
    return dispatch, combine, worst_d, worst_c


def _check_mesh(cfg: ModelConfig, tokens_per_step: int, ep: int, dp_shard: int) -> None:
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    _check_int("tokens_per_step", tokens_per_step, 1)
    _check_int("ep", ep, 1)
    _check_int("dp_shard", dp_shard, 1)
    if tokens_per_step % dp_shard:
        raise ValueError(
            f"tokens_per_step ({tokens_per_step}) must be a multiple of dp_shard "
            f"({dp_shard}): every data-parallel rank holds an equal share"
        )
    if dp_shard % ep:
        raise ValueError(
            f"ep ({ep}) must divide dp_shard ({dp_shard}): the EP ranks are "
            f"carved out of the data-parallel ranks (dp_shard = efsdp x ep)"
        )
    if cfg.n_experts % ep:
        raise ValueError(
            f"ep ({ep}) must divide n_experts ({cfg.n_experts}): each EP rank "
            f"holds an equal contiguous block of experts"
        )


def comm(
    cfg: ModelConfig,
    tokens_per_step: int,
    *,
    ep: int = 1,
    dp_shard: int = 1,
    dtype: Any = "bfloat16",
    routing: Optional[Sequence[Any]] = None,
    reduce_dtype: Any = "float32",
    reshard_after_forward: bool = True,
) -> Comm:
    """Bytes one rank sends per training step of ``cfg`` (see the module docstring).

    ``tokens_per_step``: the global batch in tokens; ``ep``: the expert-parallel degree;
    ``dp_shard``: the data-parallel ranks (``ep`` of them form an EP group); ``dtype``: of
    the activations and gradients the all-to-alls move and of the gathered parameters;
    ``routing``: ``None`` for uniform routing, or one ``(ep, n_experts)`` matrix of (token,
    slot) counts per executed MoE layer, in execution order (nested lists, numpy arrays or
    tensors); ``reduce_dtype``: of the reduce-scattered gradients.
    """
    _check_mesh(cfg, tokens_per_step, ep, dp_shard)
    act = dtype_bytes(dtype, "dtype")
    red = dtype_bytes(reduce_dtype, "reduce_dtype")
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"reshard_after_forward must be a bool, got {reshard_after_forward!r}")
    led = ledger(cfg)
    layers = led.executed_layers
    rows_per_rank = tokens_per_step // dp_shard * cfg.top_k
    row = cfg.hidden_size * act
    dispatch, combine, worst_d, worst_c = _ep_rows(cfg, layers, ep, rows_per_rank, routing)

    efsdp = dp_shard // ep
    gathered = {}  # parameters each rank gathers (and reduces) per part, scaled by the ring
    for part, n in led.params_by_part.items():
        if part in EXPERT_PARTS:
            gathered[part] = _ring(efsdp) * n / ep
        else:
            gathered[part] = _ring(dp_shard) * n
    gathered["embeddings"] = _ring(dp_shard) * embedding_params(cfg)
    passes = 2 if reshard_after_forward else 1
    by_part = {part: n * (passes * act + red) for part, n in gathered.items()}
    all_gather = sum(gathered.values()) * act
    return Comm(
        tokens_per_step=tokens_per_step,
        ep=ep,
        dp_shard=dp_shard,
        dtype=str(dtype).removeprefix("torch."),
        reduce_dtype=str(reduce_dtype).removeprefix("torch."),
        moe_layers=layers,
        dispatch_forward=worst_d * row,
        combine_forward=worst_c * row,
        dispatch_backward=worst_c * row,
        combine_backward=worst_d * row,
        fsdp_all_gather_forward=all_gather,
        fsdp_all_gather_backward=all_gather if reshard_after_forward else 0.0,
        fsdp_reduce_scatter=sum(gathered.values()) * red,
        dispatch_by_rank=tuple(d * row for d in dispatch),
        combine_by_rank=tuple(c * row for c in combine),
        fsdp_by_part=by_part,
    )


@dataclass(frozen=True)
class CommRatios:
    """Looped / baseline ratios of the bytes a rank sends per step, beside the FLOPs ratio.

    ``ep`` is ``None`` when neither model sends EP bytes (``ep=1``), ``fsdp`` when neither
    sends FSDP bytes (``dp_shard=1``), ``total`` when neither sends anything. At the same
    tokens per step the byte ratios are also the ratios per token.
    """

    ep: Optional[float]
    fsdp: Optional[float]
    total: Optional[float]
    flops: float


def _ratio(a: float, b: float) -> Optional[float]:
    return None if a == 0 else b / a


def ratios(
    baseline_cfg: ModelConfig,
    looped_cfg: ModelConfig,
    tokens_per_step: int,
    *,
    ep: int = 1,
    dp_shard: int = 1,
    dtype: Any = "bfloat16",
    reduce_dtype: Any = "float32",
    reshard_after_forward: bool = True,
    mean_doc_len: float = 800,
    seq_len: int = 4096,
) -> CommRatios:
    """Looped / baseline communication ratios under uniform routing (:func:`comm` for the
    arguments), and the training-FLOPs ratio of :func:`smelt_model.budget.compare`
    (``mean_doc_len``, ``seq_len``)."""
    kw = dict(
        ep=ep,
        dp_shard=dp_shard,
        dtype=dtype,
        reduce_dtype=reduce_dtype,
        reshard_after_forward=reshard_after_forward,
    )
    if not isinstance(baseline_cfg, ModelConfig):
        raise TypeError(f"baseline_cfg must be a ModelConfig, got {type(baseline_cfg).__name__}")
    if not isinstance(looped_cfg, ModelConfig):
        raise TypeError(f"looped_cfg must be a ModelConfig, got {type(looped_cfg).__name__}")
    a = comm(baseline_cfg, tokens_per_step, **kw)
    b = comm(looped_cfg, tokens_per_step, **kw)
    return CommRatios(
        ep=_ratio(a.ep_bytes, b.ep_bytes),
        fsdp=_ratio(a.fsdp_bytes, b.fsdp_bytes),
        total=_ratio(a.total_bytes, b.total_bytes),
        flops=compare(baseline_cfg, looped_cfg, mean_doc_len, seq_len).flops,
    )
