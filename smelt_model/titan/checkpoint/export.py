"""``smelt-export CKPT_DIR OUT_DIR`` (``python -m smelt_model.titan.checkpoint.export``): a
SMELT run's torchtitan checkpoint as a :meth:`smelt_model.SmeltLM.save_pretrained` folder.

``CKPT_DIR`` is one step's folder of a torchtitan run of a SMELT preset
(``<dump_folder>/checkpoint/step-N``) or a seed written by
:func:`smelt_model.titan.checkpoint.state_dict.write_seed`; the model config is read from the
checkpoint itself, and the weights keep the dtype they are stored in unless ``--dtype``
says otherwise. ``--seed-from SMELT_DIR`` does the reverse: ``OUT_DIR`` becomes a
torchtitan checkpoint of a ``save_pretrained`` folder. The checkpoint is read by
:mod:`smelt_model.checkpoint.dcp` (nothing in it runs; what it declares is checked
against what it stores). A bad option is one line on stderr and exit status 2; a checkpoint
that cannot be used is one line and exit status 1 (:mod:`smelt_tools.cli`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from smelt_tools.cli import Parser, UsageError, command

__all__ = ["export", "main"]

PROG = "smelt-export"
DTYPES = ("float32", "bfloat16", "float16")


def export(ckpt_dir, out_dir, dtype: Optional[str] = None) -> Path:
    """Write the ``SmeltLM`` of the checkpoint ``ckpt_dir`` into ``out_dir``; the weights
    keep their stored dtype unless ``dtype`` (one of :data:`DTYPES`) is given."""
    # torch and the model: for an export, never for --help or an option error
    import torch

    # as torch above
    from smelt_model.model import SmeltLM
    from smelt_model.titan.checkpoint.state_dict import load_model_state, to_smelt

    cfg, state = load_model_state(ckpt_dir)
    weights = to_smelt(state)
    del state
    if dtype is not None:
        weights = {k: v.to(getattr(torch, dtype)) for k, v in weights.items()}
    with torch.device("meta"):
        model = SmeltLM(cfg)
    model.load_state_dict(weights, assign=True)  # the stored tensors, as they are
    return model.save_pretrained(out_dir)


def _parser() -> Parser:
    ap = Parser(
        prog=PROG,
        description="torchtitan checkpoint of a SMELT run -> SmeltLM save_pretrained folder",
    )
    ap.add_argument(
        "ckpt_dir",
        help="a checkpoint step folder (checkpoint/step-N); with --seed-from, the folder to write",
    )
    ap.add_argument("out_dir", nargs="?", help="the SmeltLM folder to write")
    ap.add_argument(
        "--dtype", choices=DTYPES, help="cast the weights (default: the dtype they are stored in)"
    )
    ap.add_argument(
        "--seed-from",
        metavar="SMELT_DIR",
        help="write CKPT_DIR as a torchtitan seed from this SmeltLM folder",
    )
    return ap


def _folder_to_write(value: str, what: str) -> Path:
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{what} {value}: exists and is not a folder")
    return path


def _run(argv: Optional[Sequence[str]] = None) -> None:
    args = _parser().parse_args(argv)
    if args.seed_from:
        if args.out_dir is not None:
            raise UsageError("--seed-from takes one folder (the checkpoint to write)")
        if args.dtype is not None:
            raise UsageError("--dtype applies to an export, not to --seed-from")
        # loads torch: after the options are checked, as in export()
        from smelt_model.titan.checkpoint.state_dict import write_seed

        out = write_seed(args.seed_from, _folder_to_write(args.ckpt_dir, "CKPT_DIR"))
    else:
        if args.out_dir is None:
            raise UsageError("OUT_DIR is required (the SmeltLM folder to write)")
        out = export(args.ckpt_dir, _folder_to_write(args.out_dir, "OUT_DIR"), args.dtype)
    print(out)


main = command(PROG, _run)

if __name__ == "__main__":
    import sys

    sys.exit(main())
