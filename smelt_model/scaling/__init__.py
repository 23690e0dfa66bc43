"""Scaling-law analysis of matched baseline / looped runs.

Fit a loss surface ``L = E + A (1-S)^b / F^a + K / D^c`` per architecture
(:func:`fit_surface`), find its compute-optimal frontier (:func:`frontier`, :func:`gamma`,
:func:`tpp`), turn the gap between two frontiers into the share of training compute saved
(:func:`ce_gain`), put intervals on all of it with a cell bootstrap (:func:`bootstrap`), and
check that loss predicts downstream scores the same way for both (:func:`calibrate`).

Inside: ``surface`` (the loss surface, its fit and its frontier), ``endpoints`` (tables of
finished runs, the cell bootstrap and the downstream calibration) and ``report`` (tables,
the frontier plot and the command line, ``python -m smelt_model.scaling``).
"""

from smelt_model.scaling import endpoints, report, surface

_MODULES = (surface, endpoints, report)
#: the package's names: each listed once, in the ``__all__`` of the module that defines it
__all__ = [name for module in _MODULES for name in module.__all__]
globals().update({name: getattr(module, name) for module in _MODULES for name in module.__all__})
