"""What each measured call does, in the ledger's terms: its useful FLOPs, the FLOPs of each
part of the account, and the bytes a decode step reads.

Every count comes from :func:`smelt_model.budget.ledger` (``flops_per_token``,
``forward_flops_per_token``, ``flops_by_part``, ``params_by_part``, ``kv_bytes_per_token``)
and :func:`smelt_model.budget.decode_flops_per_token`; the one fact added here is a workload
fact: how many distinct experts a decode batch selects.
"""

from __future__ import annotations

from smelt_model import budget
from smelt_model.config import ModelConfig

from .account import LEDGER_PARTS, PARTS
from .workload import Workload

__all__ = ["flops_for", "part_flops", "distinct_experts", "decode_bytes"]


def flops_for(
    mode: str, led: budget.Ledger, cfg: ModelConfig, wl: Workload, ctx: int = 0, batch: int = 1
) -> float:
    """Useful FLOPs of one measured call (the ledger's convention, non-embedding): a
    training step or a prefill of the workload's tokens, or one decode step of ``batch``
    tokens against ``ctx`` cached positions."""
    if mode == "train":
        return led.flops_per_token * wl.tokens
    if mode == "prefill":
        return led.forward_flops_per_token * wl.tokens
    if mode == "decode":
        return batch * budget.decode_flops_per_token(cfg, ctx)
    raise ValueError(f"mode must be train, prefill or decode, got {mode!r}")


def part_flops(led: budget.Ledger, tokens: int, train: bool) -> dict[str, float]:
    """The ledger's FLOPs of each part of the account (:data:`.account.PARTS`) over one step
    of ``tokens`` tokens (training, or a forward when not ``train``); 0.0 for the parts the
    ledger counts none of (head, optimizer, the rest). They sum to the step's FLOPs."""
    share = 1.0 if train else led.forward_flops_per_token / led.flops_per_token
    by_part = led.flops_by_part
    return {
        name: tokens * share * sum(by_part[p] for p in LEDGER_PARTS.get(name, ())) for name in PARTS
    }


def distinct_experts(n_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts ``batch`` tokens select under uniform routing:
    ``E (1 - (1 - k/E)^B)``."""
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** batch)


def decode_bytes(
    cfg: ModelConfig, led: budget.Ledger, batch: int, context: int, dtype_bytes: int
) -> float:
    """Bytes one decode step reads: per executed layer its attention, router and norm
    weights and the experts the batch selects (:func:`distinct_experts`); the final norm,
    the head and the batch's embedding rows; the KV cache up to ``context`` (the ledger's
    ``kv_bytes_per_token``, at the element size it was built with)."""
    parts, L = led.params_by_part, cfg.n_layers
    shared = (parts["attention"] + parts["router"] + parts["norms"]) / L
    per_expert = parts["experts"] / (L * cfg.n_experts)
    per_layer = shared + distinct_experts(cfg.n_experts, cfg.top_k, batch) * per_expert
    H = cfg.hidden_size
    weights = led.executed_layers * per_layer + parts["final_norm"] + cfg.vocab_size * H + batch * H
    return weights * dtype_bytes + batch * context * led.kv_bytes_per_token
