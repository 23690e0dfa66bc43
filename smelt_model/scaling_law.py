"""The old import path of :mod:`smelt_model.scaling.surface` (the loss surface, its fit and
its frontier)."""

from .scaling.surface import *  # noqa: F401,F403
from .scaling.surface import __all__  # noqa: F401
