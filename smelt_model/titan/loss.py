"""The training loss of the SMELT models on torchtitan: cross-entropy plus router losses.

The SMELT model returns :class:`SmeltTitanOutput` (logits, and in training this rank's
share of the batch's weighted router losses). :class:`SmeltLoss` is torchtitan's
``CrossEntropyLoss`` (summed over this rank's valid tokens and divided by the global
count, so the shares of all ranks sum to the mean over the global batch) plus that share:
summed over the data-parallel ranks and the micro-batches of a step, the objective is
``mean CE + aux``, what :class:`smelt_model.SmeltLM`'s trainer minimises
(``out.loss + out.aux_loss``), computed over the whole batch at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch
from torchtitan.components.loss import CrossEntropyLoss

__all__ = ["SmeltTitanOutput", "SmeltLoss"]


class SmeltTitanOutput(NamedTuple):
    logits: torch.Tensor
    #: this rank's share of the weighted router losses of the step (None in eval mode)
    aux_loss: Optional[torch.Tensor] = None


class SmeltLoss(CrossEntropyLoss):
    """Cross-entropy (token-sum / global valid tokens) plus the router-loss share."""

    @dataclass(kw_only=True, slots=True)
    class Config(CrossEntropyLoss.Config):
        pass

    def __call__(
        self,
        pred: Any,
        labels: torch.Tensor,
        global_valid_tokens: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if isinstance(pred, SmeltTitanOutput):
            logits, aux = pred.logits, pred.aux_loss
        else:
            logits, aux = pred, None
        loss, metrics = CrossEntropyLoss.__call__(
            self, logits, labels, global_valid_tokens, **kwargs
        )
        if aux is not None:
            loss = loss + aux
        return loss, metrics
