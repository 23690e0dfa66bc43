"""Wall-clock against the FLOPs match: a budget-matched baseline / SMELT pair, side by side.

    python bench/looped_vs_baseline.py                       # CPU, the tiny pair, a few minutes
    python bench/looped_vs_baseline.py --preset 200M-S95 --device cuda --tokens 32768

For each architecture it measures (warm-up, repeats, median and spread) a training step
(forward + backward + AdamW), prefill, and per-token decode latency at batch 1 and a larger
batch, with tokens/s and memory. One table per mode puts the ledger's FLOPs ratio next to
the wall-clock ratio; their quotient is the efficiency gap (1.00: the loop costs exactly
its FLOPs), and each row gets a verdict against its target (meets, misses, or uncertain
when the run cannot tell). ``--json`` writes every number with the environment;
``--markdown`` the tables; ``--plot`` draws wall-clock against FLOPs. Nothing is written
unless asked. The printed legend explains every column.

How it measures, and why:

* **One architecture in memory at a time, in alternating blocks.** Before building anything
  the memory of the larger model (weights, gradients, AdamW state, activations, KV cache) is
  estimated and the run refused when it will not fit. Then the run is ``--rounds`` rounds;
  each round builds one architecture (seeded: the same weights every time), measures every
  mode for a block of repeats, frees it, and does the same for the other, in the order
  baseline, smelt | smelt, baseline | ... (ABBA), so a drift of the machine that is linear in
  time cancels out of the ratio, and each architecture is measured early and late. Calls of
  the two models cannot alternate one by one without both models in memory (the 100M pairs
  need ~12 GB each to train); rebuilding costs seconds, not timed.
* **Components add up to the step.** The step and its components (attention, MoE GEMMs,
  routing, norms, embedding + head + loss, the optimizer) are timed round-robin in one loop
  at the step's shapes and thread count (:func:`smelt_tools.timing.measure_parts`). Timed
  at other moments, as separate measurements after the step, they met other load on a shared
  machine and summed to up to 3.6x the step. Where the components still exceed the step by
  more than ``--tolerance``, the measurement is repeated (``--max-tries``) and the row says so.
* **Decode** runs the model's single-token step compiled once
  (:class:`smelt_model.generation.DecodeStep`; ``--eager-decode`` for the eager model), and
  prints the bytes a token has to read (executed layers' weights with the selected experts,
  the head, the KV cache) and the achieved GB/s: decode is bound by memory traffic.

The code lives in the ``lvb`` package beside this script (workload and memory, runners,
accounting, the ABBA driver, verdicts, report, command line).
"""

from lvb.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
