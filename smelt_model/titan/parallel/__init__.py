"""How a SMELT model is parallelised on torchtitan: :mod:`.parallelize` (the run options
mapped onto the model, expert parallelism, the parallel plan resolved, recompute, the
``parallelize_fn``) and :mod:`.fsdp` (the FSDP2 units of a looped model: the span's layers
gathered once for all their visits). Importing this package imports nothing.
"""

__all__: list[str] = []
