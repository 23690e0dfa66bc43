"""smelt on torchtitan (PyTorch's large-scale trainer): extra ``titan``.

Two ways in (``docs/titan.md`` has the commands):

* smelt's kernels inside STOCK torchtitan MoE models, switched on with
  ``--override.imports``: :func:`smelt_model.titan.experts.smelt_experts` (smelt's grouped
  GEMM as ``GroupedExperts``) and :func:`smelt_model.titan.attention.smelt_attention`
  (smelt's segment attention as the document-masked attention);
* SMELT and its baseline as torchtitan models, every preset under its own name:
  ``python -m smelt_model.titan --config tiny-smelt`` (the launcher,
  :mod:`smelt_model.titan.__main__`: one process, ``--nproc_per_node N``, or under
  ``torchrun``), with :mod:`smelt_model.titan.patches` (every change smelt makes to
  torchtitan and torch, each with the versions it is for).

Inside: ``model`` (:class:`~smelt_model.titan.model.SmeltTitan`: a ``SmeltLM`` that is a
torchtitan model), ``moe`` (smelt's routing on torchtitan's MoE seam), ``parallelize``
(EP, FSDP units, recompute), ``loss``, ``loader`` (smelt's packed documents as torchtitan's
tokenizer and dataloader), ``adapter`` (the state-dict adapter), ``state_dict`` and
``export`` (seeds, export to ``SmeltLM``; torch only), ``dcp_reader`` (reading a checkpoint
without running anything in it; torch only), ``resume`` (torchtitan's checkpoint load,
checked, with a fall-back), ``comm`` (all-to-all byte counting), ``overrides`` (the switch
back to torchtitan's kernels), ``stock`` (a stock model at CPU size) and
``config_registry``. Importing a submodule needs torchtitan unless it says torch only; this
package itself imports nothing heavy.
"""

__all__: list[str] = []
