"""Scaling-law analysis of matched baseline / looped runs.

Fit a loss surface ``L = E + A (1-S)^b / F^a + K / D^c`` per architecture
(:func:`fit_surface`), find its compute-optimal frontier (:func:`frontier`, :func:`gamma`,
:func:`tpp`), turn the gap between two frontiers into the share of training compute saved
(:func:`ce_gain`), put intervals on all of it with a cell bootstrap (:func:`bootstrap`), and
check that loss predicts downstream scores the same way for both (:func:`calibrate`).

Inside: ``surface`` (the loss surface, its fit and its frontier), ``endpoints`` (tables of
finished runs, the cell bootstrap and the downstream calibration), ``checks`` (what a report
must show before it prints: :func:`check_report`) and ``report`` (tables, the frontier plot
and the command line, ``python -m smelt_model.scaling``).
"""

from smelt_model.scaling.checks import TPP_RANGE, check_report
from smelt_model.scaling.endpoints import (
    BootstrapResult,
    Endpoints,
    Sigmoid,
    bootstrap,
    calibrate,
    fit_sigmoid,
    read_csv,
)
from smelt_model.scaling.report import PAPER_SPARSITIES, main, plot_frontiers, report
from smelt_model.scaling.surface import (
    EXPONENT_BOUNDS,
    LOSS_RANGE,
    PAPER_BASELINE,
    PAPER_SMELT,
    Frontier,
    Surface,
    ce_gain,
    compute_for_loss,
    fit_surface,
    frontier,
    gamma,
    tpp,
)

# ``report`` is the function (its module is smelt_model.scaling.report)
__all__ = [
    "Surface",
    "Frontier",
    "PAPER_BASELINE",
    "PAPER_SMELT",
    "fit_surface",
    "frontier",
    "gamma",
    "compute_for_loss",
    "ce_gain",
    "tpp",
    "LOSS_RANGE",
    "EXPONENT_BOUNDS",
    "Endpoints",
    "read_csv",
    "BootstrapResult",
    "bootstrap",
    "Sigmoid",
    "fit_sigmoid",
    "calibrate",
    "PAPER_SPARSITIES",
    "report",
    "plot_frontiers",
    "main",
    "TPP_RANGE",
    "check_report",
]
