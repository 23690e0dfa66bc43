"""smelt on torchtitan (PyTorch's large-scale trainer): extra ``titan``.

Two ways in (``docs/titan.md`` has the commands):

* smelt's kernels inside STOCK torchtitan MoE models, switched on with
  ``--override.imports``: :func:`smelt_model.titan.moe.experts.smelt_experts` (smelt's grouped
  GEMM as ``GroupedExperts``) and :func:`smelt_model.titan.attention.smelt_attention`
  (smelt's segment attention as the document-masked attention);
* SMELT and its baseline as torchtitan models, every preset under its own name:
  ``python -m smelt_model.titan --config tiny-smelt`` (the launcher,
  :mod:`smelt_model.titan.__main__`: one process, ``--nproc_per_node N``, or under
  ``torchrun``), with :mod:`smelt_model.titan.patches` (every change smelt makes to
  torchtitan and torch, each with the versions it is for).

Inside, by concept: ``model`` (:class:`~smelt_model.titan.model.SmeltTitan`: a ``SmeltLM``
that is a torchtitan model), ``attention``, ``loss`` and ``loader`` (smelt's packed documents
as torchtitan's tokenizer and dataloader, from :mod:`smelt_model.data`); ``moe/`` (the MoE
on torchtitan and its expert-parallel communication); ``parallel/`` (the parallel plan
applied: EP, FSDP units, recompute); ``checkpoint/`` (state-dict adapter, seeds, checked
resume, export); the launcher (``__main__``) and ``patches``; and, where torchtitan finds
them by name, ``config_registry``, ``overrides`` (the switch back to torchtitan's kernels)
and ``stock`` (a stock model at CPU size). Importing a submodule needs torchtitan unless it
says torch only; this package itself imports nothing heavy.
"""

__all__: list[str] = []
