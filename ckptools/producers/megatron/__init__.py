"""Megatron-core torch_dist checkpoints: the run directory and its iter_*/ saves, the
distributed optimizer's buckets, the GPT <-> Hugging Face mapping (plan), and a save read as
the HF model's training checkpoint (training)."""

from __future__ import annotations

import re

#: Megatron-LM ``iter_0000010`` (7 digits at least)
ITER_SAVE = re.compile(r"^iter_(\d{7,})$")
#: the run's record of its last save (``iter_*`` or ``release``)
TRACKER_FILE = "latest_checkpointed_iteration.txt"
#: ``Manifest.details`` keys of a save's run facts (``layout.RunArgs`` as a dict) and of how
#: many entries each part of it holds (model, optimizer, rng, common...)
DETAILS_KEY, PARTS_KEY = "megatron", "megatron_parts"
#: the modules of what ``inspect`` shows of this family's checkpoints (``KEY``, ``facts``,
#: ``lines``: :func:`ckptools.producers.registry.inspected`)
FACTS = ("megatron.facts",)
SAVES = (ITER_SAVE,)
RUN_RECORDS = (TRACKER_FILE,)
#: what ``--masters`` takes from a save of this family (its views' ``with_masters``)
MASTERS = ("a Megatron distributed optimizer's fp32 masters",)
#: the model ``--masters`` exports from it (which LoRA options and ``--select`` do not apply to)
MASTERS_MODEL = ("a Megatron model",)
PARTS = (
    # a save's marker and a run's tracker: never a checkpoint alone
    (re.compile(r"^metadata\.json$"), "megatron"),
    (re.compile(r"^latest_checkpointed_iteration\.txt$"), "megatron"),
)
