"""Wall-clock against the FLOPs match: a budget-matched baseline / SMELT pair, side by side.

    python bench/looped_vs_baseline.py                       # CPU, the tiny pair, <= 15 minutes
    python bench/looped_vs_baseline.py --preset 200M-S95 --device cuda --tokens 32768

For each architecture it measures a training step (forward + backward + AdamW), prefill, and
per-token decode latency at batch 1 and a larger batch, with tokens/s and memory. One table
per mode puts the ledger's FLOPs ratio next to the wall-clock ratio; their quotient is the
efficiency gap (1.00: the loop costs exactly its FLOPs), given with a confidence interval,
and each row gets a verdict against its target: meets, misses, at target (within
``--resolution`` of it), unsettled (with what to do) or machine busy (with what the run
saw). ``--json`` writes every number with the
environment; ``--markdown`` the tables; ``--plot`` draws wall-clock against FLOPs. Nothing is
written unless asked. The printed legend explains every column.

How it measures, and why:

* **Paired blocks, one architecture in memory at a time.** Before building anything the
  memory of the larger model (weights, gradients, AdamW state, activations, KV cache) is
  estimated and the run refused when it will not fit. Then each round builds one
  architecture (seeded: the same weights every time), measures every mode for a block,
  frees it, and does the same for the other, in the order baseline, smelt | smelt,
  baseline | ... (ABBA), so a drift of the machine that is linear in time cancels and each
  architecture is measured early and late. A round's two blocks ran seconds apart: each
  row gets one pair per round, and its gap is estimated from the pairs.
* **An estimate load cannot drag along, and an interval.** A block's time is its fastest
  call (load only adds time); the row's gap is the median of its pairs' gaps with a
  distribution-free interval (``--confidence``, 95%): a burst of load landing on one
  architecture's block moves one pair, not the estimate (``lvb/estimate.py``).
* **It stops when the answer is settled.** After every round each row is asked: is its
  interval wholly at or below the target (meets), wholly above it (misses), or within
  ``--resolution`` (2%) of it on both sides (at target: a gap that is its target never
  gets an interval on one side)? The run ends
  when every row is settled, before a round that would pass ``--max-time`` (900 s), or at
  ``--max-rounds``; a row still unsettled says so, and why, and what to do.
* **It watches the machine.** Around every row's timed calls it reads the process's CPU
  time, what other processes, the hypervisor (steal) and a CPU quota took from its cores
  (:class:`smelt_tools.watch.Watch`). A pair with a block in which others held more than
  ``--busy-limit`` of the cores the threads needed is *contended* and left out; when most
  are, the row's verdict is "machine busy" with what was seen, not a number. Wall-clock
  stays the measured quantity.
* **An account of each step, part by part, inside the step.** In the first
  ``--account-rounds`` rounds each block, after timing its steps, profiles
  ``--account-steps`` more of the same steps and attributes every op, forward and
  backward, to a part: the experts, attention, the q/k/v/o projections, the head and loss,
  routing, norms and residual adds, the optimizer, the rest (:mod:`lvb.account`,
  :func:`smelt_tools.account.account`). The parts add up to the profiled step; the account
  says how much slower than the plain step the profiler made it (taken again, up to
  ``--max-tries``, while that exceeds ``--tolerance``), which parts carry the gap's
  excess, and for each part's GEMMs what the host's best GEMM (MKL's sgemm or oneDNN's
  matmul, timed at the part's shapes in the same block) would take, with the host's
  GEMM ceiling at 2048^3 and each step's share of it. CPU only: on CUDA a step's time is
  on the device.
* **Decode** runs the model's single-token step compiled once
  (:class:`smelt_model.generation.DecodeStep`; ``--eager-decode`` for the eager model), and
  prints the bytes a token has to read (executed layers' weights with the selected experts,
  the head, the KV cache) and the achieved GB/s: decode is bound by memory traffic.

The code lives in the ``lvb`` package beside this script.
"""

from lvb.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
