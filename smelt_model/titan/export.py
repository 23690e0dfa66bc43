"""``python -m smelt_model.titan.export CKPT_DIR OUT_DIR``: a SMELT run's torchtitan
checkpoint as a :meth:`smelt_model.SmeltLM.save_pretrained` folder.

``CKPT_DIR`` is one step's folder of a torchtitan run of a SMELT preset
(``<dump_folder>/checkpoint/step-N``) or a seed written by
:func:`smelt_model.titan.checkpoint.write_seed`; the model config is read from the
checkpoint itself. ``--seed-from SMELT_DIR`` does the reverse: ``OUT_DIR`` becomes a
torchtitan checkpoint of a ``save_pretrained`` folder. Errors are one line on stderr and
exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["export", "main"]


def export(ckpt_dir, out_dir, dtype: Optional[str] = None) -> Path:
    """Write the ``SmeltLM`` of the checkpoint ``ckpt_dir`` into ``out_dir``."""
    import torch

    from ..model import SmeltLM
    from .state_dict import load_model_state, to_smelt

    cfg, state = load_model_state(ckpt_dir)
    model = SmeltLM(cfg)
    model.load_state_dict(to_smelt(state))
    if dtype is not None:
        model = model.to(getattr(torch, dtype))
    return model.save_pretrained(out_dir)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m smelt_model.titan.export",
        description="torchtitan checkpoint of a SMELT run -> SmeltLM save_pretrained folder",
    )
    ap.add_argument(
        "ckpt_dir",
        help="a checkpoint step folder (checkpoint/step-N); with --seed-from, the folder to write",
    )
    ap.add_argument("out_dir", nargs="?", help="the SmeltLM folder to write")
    ap.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="cast the weights (default: as stored)",
    )
    ap.add_argument(
        "--seed-from",
        metavar="SMELT_DIR",
        help="write CKPT_DIR as a torchtitan seed from this SmeltLM folder",
    )
    args = ap.parse_args(argv)
    try:
        if args.seed_from:
            if args.out_dir is not None:
                raise ValueError("--seed-from takes one folder (the checkpoint to write)")
            from .state_dict import write_seed

            out = write_seed(args.seed_from, args.ckpt_dir)
        else:
            if args.out_dir is None:
                raise ValueError("OUT_DIR is required (the SmeltLM folder to write)")
            out = export(args.ckpt_dir, args.out_dir, args.dtype)
    except (ValueError, TypeError, FileNotFoundError, OSError, RuntimeError) as e:
        msg = " ".join(str(e).split())
        print(f"smelt_model.titan.export: error: {msg}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
