"""The old import path of :mod:`smelt_model.block` (the model's block and the drop-in layers
it re-exports); new code imports :mod:`smelt_model.block`."""

from .block import *  # noqa: F401,F403
from .block import __all__  # noqa: F401
