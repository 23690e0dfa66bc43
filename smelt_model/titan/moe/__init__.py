"""The MoE on torchtitan and its communication.

:mod:`.layer` (smelt's routing on torchtitan's MoE seam), :mod:`.experts` (smelt's grouped
GEMM as torchtitan's ``GroupedExperts``), :mod:`.options` (the ``--moe_comm`` option parser:
the per-layer parallel plan, de-duplication, overlap), :mod:`.dispatch` (the token
dispatchers: stock rows with byte recording, or de-duplicated, both split in phases for
overlap), :mod:`.exchange` (all-to-alls left in flight, forward and backward) and
:mod:`.traffic` (the byte recorder and its reader). Importing a submodule needs torchtitan
unless it says torch only; this package itself imports nothing.
"""

__all__: list[str] = []
