"""``python -m smelt_kernels.selftest``: see :mod:`smelt_kernels.selftest`."""

import sys

from .cli import main

sys.exit(main())
