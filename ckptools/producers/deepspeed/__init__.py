"""DeepSpeed ZeRO 1/2/3 checkpoints, read without DeepSpeed: the rank files, ZeRO's flat
partitions placed on each parameter, and its optimizer named as torch's FQN-keyed state dict."""

from __future__ import annotations

import re

#: the layouts this package defines: (name, module, detection priority; lower first): before
#: safetensors (30), since a Trainer + DeepSpeed ``checkpoint-N`` holds both the 16-bit
#: ``model.safetensors`` and ``global_stepN/``, and the fp32 masters are the truth
#: (``--format safetensors`` reads the other)
LAYOUTS = (("deepspeed", "layout", 25),)

#: the tag names DeepSpeed's engines give their saves by default (``global_stepN``)
TAG_SAVE = re.compile(r"^global_step(\d+)$")
#: the run's record of its last save's tag
LATEST_FILE = "latest"
SAVES = (TAG_SAVE,)
RUN_RECORDS = (LATEST_FILE,)
PARTS = (
    (re.compile(r"^(.+_)?zero_pp_rank_\d+_mp_rank_\d+_(model|optim)_states\.pt$"), "deepspeed"),
    (re.compile(r"^(.+_)?mp_rank_\d+_optim_states\.pt$"), "deepspeed"),
)
#: (file name, a name beside it, layout): one part when a file of the second kind lies beside.
#: ``mp_rank_00_model_states.pt`` beside ZeRO optimizer rank files: ZeRO 1/2 keep there the
#: module's low-precision copy, not the fp32 masters the directory's reading exports; the run's
#: ``latest`` beside its ``global_stepN`` tags (the run directory is what to point at)
PARTS_BESIDE = (
    (
        re.compile(r"^mp_rank_\d+_model_states\.pt$"),
        re.compile(r"^(?:bf16_)?zero_pp_rank_\d+_mp_rank_\d+_optim_states\.pt$"),
        "deepspeed",
    ),
    (re.compile(rf"^{LATEST_FILE}$"), TAG_SAVE, "deepspeed"),
)
