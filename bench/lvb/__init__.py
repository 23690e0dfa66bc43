"""The main job's modules (``python bench/looped_vs_baseline.py``), in the order a run uses
them:

* :mod:`.workload` -- the options checked into a :class:`~.workload.Workload`, and the memory
  estimate and refusal before anything is built;
* :mod:`.runners` -- one architecture's training step, prefill and decode, the account of a
  step, and one measured block (:func:`~.runners.measure_block`);
* :mod:`.account` -- a step's time part by part (the model's parts for
  :func:`smelt_tools.account.account`), the host's GEMM time at each part's shapes and its
  GEMM ceiling;
* :mod:`.accounting` -- the FLOPs and bytes of each measured call and of each part of the
  account, read from the ledger;
* :mod:`.driver` -- the ABBA rounds and the stopping rule;
* :mod:`.estimate` -- a row's pairs, its gap and the gap's confidence interval;
* :mod:`.verdict` -- the targets (one table), the rule that says a row is settled, and each
  row's verdict with what to do when it is not;
* :mod:`.summary` -- from the blocks to the pooled results and the summary rows;
* :mod:`.report` -- the text tables, their Markdown and the plot;
* :mod:`.cli` -- the options and ``main``.
"""
