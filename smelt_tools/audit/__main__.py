"""``python -m smelt_tools.audit``: see :mod:`smelt_tools.audit`."""

import sys

from . import main

sys.exit(main())
