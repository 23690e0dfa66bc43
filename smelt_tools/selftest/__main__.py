"""``python -m smelt_tools.selftest``: see :mod:`smelt_tools.selftest`."""

import sys

from .cli import main

sys.exit(main())
