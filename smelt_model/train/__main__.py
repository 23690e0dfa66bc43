"""``python -m smelt_model.train``: the ``smelt-train`` command (:mod:`smelt_model.train.cli`)."""

from smelt_model.train.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
