"""The old import path of :mod:`smelt_model.scaling.endpoints` (endpoint tables, the cell
bootstrap and the downstream calibration)."""

from .scaling.endpoints import *  # noqa: F401,F403
from .scaling.endpoints import __all__  # noqa: F401
