"""``python -m smelt_model.train``: the ``smelt-train`` command (:mod:`smelt_model.train.cli`)."""

import gc

from smelt_model.train.cli import main

if __name__ == "__main__":
    # what the imports made lives as long as the process: the collector need not walk it
    gc.freeze()
    raise SystemExit(main())
