"""smelt on torchtitan (PyTorch's large-scale trainer): extra ``titan``.

Two ways in (``docs/titan.md`` has the commands):

* smelt's kernels inside STOCK torchtitan MoE models, switched on with
  ``--override.imports``: :func:`smelt_model.titan.experts.smelt_experts` (smelt's grouped
  GEMM as ``GroupedExperts``) and :func:`smelt_model.titan.attention.smelt_attention`
  (smelt's segment attention as the document-masked attention);
* SMELT and its baseline as torchtitan models, every preset under its own name:
  ``torchrun -m smelt_model.titan --config tiny-smelt`` (the launcher,
  :mod:`smelt_model.titan.__main__`, with :mod:`smelt_model.titan.shims`), or
  ``-m torchtitan.train --module smelt_model.titan --config tiny-smelt`` where no shim is
  needed.

Inside: ``model`` (:class:`~smelt_model.titan.model.SmeltTitan`: a ``SmeltLM`` that is a
torchtitan model), ``moe`` (smelt's routing on torchtitan's MoE seam), ``parallelize``
(EP, FSDP units, recompute), ``loss``, ``data`` (smelt's packed documents as torchtitan's
loader), ``checkpoint`` and ``export`` (state-dict adapter, seeds, export to
``SmeltLM``), ``dispatch`` (the token dispatchers: stock rows with byte recording, or
de-duplicated, both split in phases for overlap), ``exchange`` (all-to-alls left in flight,
forward and backward), ``traffic`` (the byte recorder), ``moe_comm`` (the ``--moe_comm``
options: the per-layer parallel plan, de-duplication, overlap), ``overrides`` (the switch back to
torchtitan's kernels) and ``config_registry``. Importing a submodule needs torchtitan;
this package itself imports nothing heavy.
"""

__all__: list[str] = []
