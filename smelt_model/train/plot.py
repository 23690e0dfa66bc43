"""Validation loss against cumulative ledger FLOPs and against wall-clock seconds, one line
per run (both architectures of a pair on one figure)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence, Union

from smelt_model.plotting import pyplot, save

__all__ = ["read_log", "plot_runs"]

COLORS = {"baseline": "tab:blue", "smelt": "tab:orange"}


def read_log(run: Union[str, Path]) -> tuple[list[dict], list[dict]]:
    """(training records, evaluation records) of a run folder's ``log.jsonl``."""
    steps, evals = [], []
    path = Path(run) / "log.jsonl"
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            (evals if "val_loss" in rec else steps).append(rec)
    return steps, evals


def plot_runs(
    runs: Sequence[Union[str, Path]], path: Union[str, Path], title: str = "validation loss"
) -> Path:
    """Draw the runs' validation (solid) and training (faint) losses against FLOPs and
    seconds into ``path``."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for run in runs:
        steps, evals = read_log(run)
        label = (evals or steps or [{"arch": Path(run).name}])[0].get("arch", Path(run).name)
        color = COLORS.get(label)
        for ax, key in zip(axes, ("flops", "seconds")):
            if steps:
                ax.plot(
                    [r[key] for r in steps],
                    [r["loss"] for r in steps],
                    color=color,
                    alpha=0.25,
                    lw=1,
                )
            if evals:
                ax.plot(
                    [r[key] for r in evals],
                    [r["val_loss"] for r in evals],
                    "o-",
                    color=color,
                    label=f"{label} (val)",
                    ms=3,
                )
    axes[0].set_xlabel("cumulative training FLOPs (ledger)")
    axes[1].set_xlabel("wall-clock seconds in training steps")
    axes[0].set_ylabel("loss (nats / token)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title + " (faint: training loss)")
    fig.tight_layout()
    return save(fig, path)
