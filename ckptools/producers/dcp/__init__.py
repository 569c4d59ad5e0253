"""DCP and its wrappers: torch.distributed.checkpoint directories (FSDP1/FSDP2/HSDP/TP),
accelerate, the Trainer, Lightning and torchtitan saves, per-rank metadata without a global
one, and ckptools' own CheckpointManager saves."""

# The family's facts read without its readers (run-directory rules, part files): see
# docs/architecture.md, "What a family's package declares".

from __future__ import annotations

import re

#: the layouts this package defines: (name, module, detection priority; lower first). The
#: wrappers (10-13) come before the plain DCP they hold, so the outer directory a user has is
#: recognised as what it is; the rank-local form (19) before "dcp", which would call a
#: directory without a global .metadata uncommitted.
LAYOUTS = (
    ("trainer", "wrappers", 10),
    ("accelerate", "wrappers", 11),
    ("lightning", "wrappers", 12),
    ("torchtitan", "wrappers", 13),
    ("dcp_rank_local", "rank_local", 19),
    ("dcp", "layout", 20),
)

#: transformers Trainer ``checkpoint-N``
TRAINER_SAVE = re.compile(r"^checkpoint-(\d+)$")
#: torchtitan's (and a script's ``dcp.save`` per step, and the CheckpointManager's) ``step-N``
STEP_SAVE = re.compile(r"^step-(\d+)$")
#: accelerate's ``save_state()`` under ``ProjectConfiguration(automatic_checkpoint_naming=True)``:
#: ``<project_dir>/checkpoints/checkpoint_N``
ACCELERATE_SAVE = re.compile(r"^checkpoint_(\d+)$")
#: Lightning ``ModelCheckpoint``'s default name, a folder under ``FSDPStrategy``'s sharded state:
#: ``lightning_logs/version_0/checkpoints/epoch=E-step=N.ckpt/``
LIGHTNING_SAVE = re.compile(r"^epoch=\d+-step=(\d+)\.ckpt$")
#: how this family's producers name one numbered save of a run (group 1: the step)
SAVES = (TRAINER_SAVE, STEP_SAVE, ACCELERATE_SAVE, LIGHTNING_SAVE)
#: ``ckpt list --help``'s runs of this family's saves beyond the Trainer's and torchtitan's
HELP = (
    ("list saves", ("accelerate's automatic naming", "checkpoint_N in checkpoints/")),
    ("list saves", ("Lightning's ModelCheckpoint", "epoch=E-step=N.ckpt in checkpoints/")),
)
#: file names that are one part of a checkpoint of this family's layout (never one alone)
PARTS = (
    (re.compile(r".+\.distcp$"), "dcp"),
    (re.compile(r"^(__\d+)?\.metadata$"), "dcp"),
)
