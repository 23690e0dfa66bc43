"""``torchrun --nproc_per_node N -m smelt_model.titan --config PRESET [torchtitan options]``.

A thin launcher: it applies the compatibility shims this torchtitan / torch pair needs
(:mod:`smelt_model.titan.shims`, only those this process needs), checks the command line
(torchtitan's own parser, then what the SMELT models support), and runs torchtitan's
trainer (``torchtitan.train.main``). ``--module`` defaults to ``smelt_model.titan``; any
other module (a stock torchtitan model such as ``qwen3``) runs with the same shims. Every
checkpoint the run reads has its DCP metadata read by smelt's restricted unpickler
(:func:`smelt_model.titan.state_dict.restrict_dcp_loading`). Bad options give one line on
stderr and exit status 2.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
from typing import Optional, Sequence

PROG = "smelt_model.titan"
_BOX = re.compile(r"[\u2500-\u257f\u2580-\u259f│╭╮╰╯─]+")


def _fail(message: str) -> int:
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


def _option(args: Sequence[str], name: str) -> Optional[str]:
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _parser_message(text: str) -> str:
    """The message of a torchtitan / tyro parser error, without its box drawing."""
    lines = text.splitlines()
    box = [i for i, line in enumerate(lines) if line.lstrip().startswith("\u256d")]
    if box:  # tyro draws the error in a box: its title ("Value error"), then the message
        lines = lines[box[-1] + 1 :]
    kept = []
    for line in lines:
        line = _BOX.sub(" ", line).strip()
        if line.lower().startswith(("for full", "usage")):
            break
        if line:
            kept.append(line)
    return " ".join(kept) or "invalid command line"


def _parse(args: list[str]):
    from torchtitan.config import ConfigManager

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return ConfigManager().parse_args(list(args))
    except SystemExit as e:
        if e.code in (0, None):
            raise
        raise ValueError(_parser_message(err.getvalue())) from None
    except (ImportError, AttributeError) as e:
        raise ValueError(str(e)) from None


def _check(config) -> None:
    """What the parser cannot know: the mesh against the world and the model."""
    from .model import SmeltTitan
    from .parallelize import _check_parallelism, recompute_policy

    p = config.parallelism
    world = int(os.environ.get("WORLD_SIZE", "1"))
    degrees = {
        "data_parallel_replicate_degree": p.data_parallel_replicate_degree,
        "tensor_parallel_degree": p.tensor_parallel_degree,
        "context_parallel_degree": p.context_parallel_degree,
        "pipeline_parallel_degree": p.pipeline_parallel_degree,
        "expert_parallel_degree": p.expert_parallel_degree,
    }
    for name, value in degrees.items():
        if value < 1:
            raise ValueError(f"--parallelism.{name} must be >= 1, got {value}")
    rest = (
        p.data_parallel_replicate_degree
        * p.tensor_parallel_degree
        * p.context_parallel_degree
        * p.pipeline_parallel_degree
    )
    shard = p.data_parallel_shard_degree
    if shard == -1:
        if world % rest:
            raise ValueError(
                f"replicate x tp x cp x pp = {rest} does not divide the {world} "
                f"processes torchrun started (--nproc_per_node)"
            )
        shard = world // rest
    if shard < 1 or shard * rest != world:
        raise ValueError(
            f"the parallel degrees multiply to {shard * rest}, but torchrun "
            f"started {world} processes (--nproc_per_node)"
        )
    ep = p.expert_parallel_degree
    if (shard * p.context_parallel_degree * p.tensor_parallel_degree) % ep:
        raise ValueError(
            f"--parallelism.expert_parallel_degree {ep} must divide "
            f"data_parallel_shard x cp x tp = {shard}"
        )
    model = config.model_spec.model if config.model_spec is not None else None
    if isinstance(model, SmeltTitan.Config):
        _check_parallelism(model.arch, p)
        recompute_policy(config.activation_checkpoint)
    if (
        config.training.steps < 1
        or config.training.local_batch_size < 1
        or config.training.seq_len < 1
    ):
        raise ValueError(
            "--training.steps, --training.local_batch_size and --training.seq_len must be >= 1"
        )


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        import torchtitan  # noqa: F401
    except ImportError:
        return _fail("torchtitan is not installed (pip install -c constraints.txt 'smelt[titan]')")
    from . import shims
    from .state_dict import restrict_dcp_loading

    shims.apply()
    restrict_dcp_loading()  # nothing a checkpoint holds can run code in this process
    args = shims.launch_args(args)
    if _option(args, "--module") is None:
        args = ["--module", PROG] + args
    if _option(args, "--config") is None and not {"-h", "--help"} & set(args):
        return _fail("--config PRESET is required (a name of smelt_model.presets.names())")
    if _option(args, "--module") == PROG and _option(args, "--config") is not None:
        from .. import presets

        try:  # any case, pair or model name: presets.model_name says what a model is
            presets.model_name(_option(args, "--config"))
        except ValueError as e:
            return _fail(f"--config: {e}")
    try:
        if not {"-h", "--help"} & set(args):
            _check(_parse(args))
        import torchtitan.train as tt_train

        sys.argv = [PROG] + args
        tt_train.main()
    except (ValueError, TypeError) as e:
        # torchtitan's @record wrote the traceback for torchrun to print; the line is enough
        error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if error_file:
            with contextlib.suppress(OSError):
                os.remove(error_file)
        return _fail(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
