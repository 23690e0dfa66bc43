"""smelt_tools: what developers run around the kernels, not what a model imports.

* :mod:`.cli`: the one command-line convention (a bad option or setting is one line on
  stderr and exit status 2, never a usage block or a traceback); every smelt command parses
  through it;
* :mod:`.timing`: timing and machine description for the benchmarks;
* :mod:`.watch`: what the machine did while something was timed (contention, steal);
* :mod:`.audit`: the static sm_90a audit of the GPU kernels (``python -m smelt_tools.audit``);
* :mod:`.hf_bench`: smelt inside transformers against its own paths
  (``python -m smelt_tools.hf_bench``);
* :mod:`.selftest`: every kernel against its reference on this machine, the first thing
  to run on a new GPU (``smelt-selftest`` or ``python -m smelt_tools.selftest``).

It imports :mod:`smelt_kernels` (never :mod:`smelt_model` or ``bench``); nothing in
:mod:`smelt_kernels` imports it. This file imports nothing.
"""
