"""FSDP1 flat parameters (FlatParameter shards found and unflattened) and verl's per-rank
FSDP checkpoints."""

from __future__ import annotations

import re

#: the layouts this package defines: (name, module, detection priority; lower first): before
#: torch_save (25), since a one-rank verl directory is also a directory of .pt files; FSDP1's
#: LOCAL_STATE_DICT before every layout that would read its flat parameters as a model (the
#: DCP wrappers from 10, DCP, torch_save)
LAYOUTS = (("fsdp1_local", "local_state", 9), ("verl", "verl", 22))
#: recognised only to be refused (its read_manifest names it): never handed to dcp.load
REFUSED = ("fsdp1_local",)

#: verl's trainer ``global_step_N``
VERL_SAVE = re.compile(r"^global_step_(\d+)$")
#: verl's record of its last save
VERL_TRACKER = "latest_checkpointed_iteration.txt"
SAVES = (VERL_SAVE,)
RUN_RECORDS = (VERL_TRACKER,)
#: (file name whose group ``n`` counts the files of the whole and ``i`` numbers this one,
#: layout, the number of the first file): one part when ``n`` is over 1
COUNTED_PARTS = (
    (
        re.compile(r"^(model|optim|extra_state)_world_size_(?P<n>\d+)_rank_(?P<i>\d+)\.pt$"),
        "verl",
        0,
    ),
)
#: ``ckpt --help``'s row of what this family recognises only to refuse (cli/options.producers_say)
HELP = (
    ("refuses", ("FSDP1 LOCAL_STATE_DICT", "flat-parameter shards, no names or shapes stored")),
)
