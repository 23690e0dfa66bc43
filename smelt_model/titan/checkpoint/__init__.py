"""Checkpoints of a torchtitan run, under torchtitan's own role names:
:mod:`.state_dict_adapter` (torchtitan's ``StateDictAdapter`` for a SMELT model),
:mod:`.state_dict` (seeds: a ``SmeltLM`` folder as a run's first state; torch only),
:mod:`.resume` (torchtitan's checkpoint load, checked, with a fall-back) and :mod:`.export`
(a run's checkpoint as a ``SmeltLM`` folder, ``smelt-export``). What every checkpoint
reader shares (the error, the fit check, the safe DCP reader) is :mod:`smelt_model.checkpoint`.
Importing this package imports nothing.
"""

__all__: list[str] = []
