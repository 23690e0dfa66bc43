"""The main job's modules (``python bench/looped_vs_baseline.py``), in the order a run uses
them:

* :mod:`.workload` -- the options checked into a :class:`~.workload.Workload`, and the memory
  estimate and refusal before anything is built;
* :mod:`.runners` -- one architecture's training step, prefill and decode, its components at
  the step's shapes, and one measured block (:func:`~.runners.measure_block`);
* :mod:`.accounting` -- the FLOPs and bytes of each measured call, read from the ledger;
* :mod:`.driver` -- the ABBA rounds, pooling, per-round gaps and the summary rows;
* :mod:`.verdict` -- the targets (one table) and each row's verdict against its target;
* :mod:`.report` -- the text tables, their Markdown and the plot;
* :mod:`.cli` -- the options and ``main``.
"""
