"""The router losses of a top-k softmax MoE layer: :func:`router_loss`.

    aux = aux_loss_weight * E * sum_e f_e * P_e      (Switch-style load balancing)
    z   = z_loss_weight * sum_t lse_t^2 / n          (router z-loss)

with ``f_e = counts_e / (n * top_k)`` the share of the (token, slot) pairs routed to expert
``e``, ``P_e = sum_t p_te / n`` the mean router probability of ``e``, ``lse_t`` the
log-sum-exp of token ``t``'s logits and ``n`` the tokens the statistics cover.

One function serves every MoE path (:class:`smelt_kernels.layers.MoE`, the torchtitan
model's ``SmeltMoE``). With ``counts`` and ``n_tokens`` summed over data-parallel ranks,
each rank's result is its share (its own tokens' sums over the global ``n``): the shares
sum to the loss of the whole batch, and so do their gradients.

The result is bitwise the same at any CPU thread count, value and gradient: the
probabilities are ``exp(logits - logsumexp)`` rather than ``softmax`` (ATen's softmax
backward depends on the thread count; these backwards are element-wise), and the sums over
tokens go through :func:`token_sum`, whose reductions never split one output over threads.
"""

from __future__ import annotations

from typing import Union

import torch

__all__ = ["router_loss", "token_sum"]

#: tokens summed per row by :func:`token_sum` (below ATen's parallel grain of 32768)
_CHUNK = 1024


def token_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum of a 1-D tensor, in an order that does not depend on the thread count.

    ATen splits one large sum over threads, each with its own partial sum; a sum along the
    rows of a matrix gives each row to one thread. So: rows of :data:`_CHUNK` (zero-padded,
    which adds exact zeros), summed per row, until one row is left."""
    while x.numel() > _CHUNK:
        pad = -x.numel() % _CHUNK
        if pad:
            x = torch.cat([x, x.new_zeros(pad)])
        x = x.view(-1, _CHUNK).sum(1)
    return x.sum()


def _check(logits, counts, top_k, aux_loss_weight, z_loss_weight) -> None:
    if not isinstance(logits, torch.Tensor) or not isinstance(counts, torch.Tensor):
        raise TypeError("router_loss: logits and counts must be tensors")
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(
            f"router_loss: logits must be a floating (tokens, experts) tensor, got "
            f"{logits.dtype} of shape {tuple(logits.shape)}"
        )
    E = logits.shape[1]
    if counts.shape != (E,):
        raise ValueError(
            f"router_loss: counts must have shape ({E},) (one per expert), "
            f"got {tuple(counts.shape)}"
        )
    if counts.device != logits.device:
        raise ValueError(f"router_loss: counts is on {counts.device}, logits on {logits.device}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise ValueError(f"router_loss: top_k must be an int in [1, {E}], got {top_k!r}")
    for name, w in (("aux_loss_weight", aux_loss_weight), ("z_loss_weight", z_loss_weight)):
        if not (isinstance(w, (int, float)) and w >= 0):
            raise ValueError(f"router_loss: {name} must be a number >= 0, got {w!r}")


def router_loss(
    logits: torch.Tensor,
    counts: torch.Tensor,
    *,
    top_k: int,
    aux_loss_weight: float = 0.0,
    z_loss_weight: float = 0.0,
    n_tokens: Union[torch.Tensor, int, None] = None,
) -> torch.Tensor:
    """The weighted router losses (module docstring) of router ``logits`` (N, E).

    ``counts`` (E,): how many (token, slot) pairs went to each expert (any dtype; not
    differentiated). ``n_tokens``: the tokens ``counts`` covers (default N, this call's);
    pass the sums over ranks for a rank's share of a global-batch loss. Returns a scalar
    of the logits' dtype (0 when both weights are 0)."""
    _check(logits, counts, top_k, aux_loss_weight, z_loss_weight)
    E = logits.shape[1]
    n = logits.shape[0] if n_tokens is None else n_tokens
    n = torch.as_tensor(n, dtype=logits.dtype, device=logits.device).clamp_min(1)
    loss = logits.new_zeros(())
    lse = torch.logsumexp(logits, -1, keepdim=True)
    if aux_loss_weight > 0:
        frac = counts.detach().to(logits.dtype) / (n * top_k)
        per_token = (torch.exp(logits - lse) * frac).sum(-1)  # sum_e f_e p_te
        loss = loss + aux_loss_weight * E * token_sum(per_token) / n
    if z_loss_weight > 0:
        loss = loss + z_loss_weight * token_sum(lse.squeeze(-1).pow(2)) / n
    return loss
