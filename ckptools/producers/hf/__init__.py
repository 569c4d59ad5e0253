"""Hugging Face safetensors model directories, transformers' distributed (per-rank) safetensors,
and torch.save files (state dicts, Lightning's .ckpt, training checkpoints)."""

from __future__ import annotations

import re

#: the layouts this package defines: (name, module, detection priority; lower first): the
#: per-rank safetensors of transformers (25) before "safetensors" (30), which would read the
#: slices as whole tensors
LAYOUTS = (
    ("transformers_distributed", "distributed", 25),
    ("torch_save", "torch_save", 25),
    ("safetensors", "safetensors", 30),
)

PARTS = ((re.compile(r"^shard-\d+-.+\.safetensors$"), "transformers_distributed"),)
COUNTED_PARTS = (
    (re.compile(r"^.+-(?P<i>\d+)-of-(?P<n>\d+)\.(safetensors|bin)$"), "safetensors", 1),
)
