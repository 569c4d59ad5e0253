"""Hugging Face safetensors model directories, transformers' distributed (per-rank) safetensors,
and torch.save files (state dicts, Lightning's .ckpt, training checkpoints)."""

from __future__ import annotations

import re

PARTS = ((re.compile(r"^shard-\d+-.+\.safetensors$"), "transformers_distributed"),)
COUNTED_PARTS = (
    (re.compile(r"^.+-(?P<i>\d+)-of-(?P<n>\d+)\.(safetensors|bin)$"), "safetensors", 1),
)
