"""Megatron-core torch_dist checkpoints: the run directory and its iter_*/ saves, the
distributed optimizer's buckets, the GPT <-> Hugging Face mapping (plan), and a save read as
the HF model's training checkpoint (training)."""

from __future__ import annotations

import re

#: the layouts this package defines: (name, module, detection priority; lower first): a run
#: directory and its iter_*/ saves hold DCP data, so before "dcp"
LAYOUTS = (("megatron", "layout", 14),)
#: ``shard --to NAME``: this package's writer module, which plans a save in its layout
WRITE_TARGETS = (("megatron", "writer"),)

#: Megatron-LM ``iter_0000010`` (7 digits at least)
ITER_SAVE = re.compile(r"^iter_(\d{7,})$")
#: the run's record of its last save (``iter_*`` or ``release``)
TRACKER_FILE = "latest_checkpointed_iteration.txt"
SAVES = (ITER_SAVE,)
RUN_RECORDS = (TRACKER_FILE,)
#: what ``--masters`` takes from a save of this family (its views' ``with_masters``)
MASTERS = ("a Megatron distributed optimizer's fp32 masters",)
PARTS = (
    # a save's marker and a run's tracker: never a checkpoint alone
    (re.compile(r"^metadata\.json$"), "megatron"),
    (re.compile(r"^latest_checkpointed_iteration\.txt$"), "megatron"),
)
