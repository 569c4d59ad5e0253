"""How producers name the numbered saves of a run directory: one pattern each, group 1 the step.

Kept apart from the layouts that read those saves: finding a model's ``config.json`` above a
checkpoint (:func:`ckptools.views.export.find_model_files`) asks whether a directory is one numbered
save, and must not import every producer's reader for that (issue 27: start-up).
"""

from __future__ import annotations

import re

#: transformers Trainer ``checkpoint-N``
TRAINER = re.compile(r"^checkpoint-(\d+)$")
#: the tag names DeepSpeed's engines give their saves by default (``global_stepN``)
DEEPSPEED = re.compile(r"^global_step(\d+)$")
#: verl's trainer ``global_step_N``
VERL = re.compile(r"^global_step_(\d+)$")
#: torchtitan ``step-N``
TORCHTITAN = re.compile(r"^step-(\d+)$")
#: Megatron-LM ``iter_0000010`` (7 digits at least)
MEGATRON = re.compile(r"^iter_(\d{7,})$")

_ALL = (TRAINER, DEEPSPEED, VERL, TORCHTITAN, MEGATRON)


def is_numbered_save(name: str) -> bool:
    """Whether ``name`` is how one of the producers names one save of a run."""
    return any(p.match(name) for p in _ALL)
