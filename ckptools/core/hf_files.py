"""The file names of a Hugging Face model directory, as ckptools writes and recognises them.

Below every layer that reads or writes one: the planners and views write these names, and the
OUT rules (:mod:`ckptools.io.out_rules`) recognise an earlier output by them.
"""

from __future__ import annotations

#: the sharded safetensors model's index, written last (the commit marker of a model directory)
INDEX_NAME = "model.safetensors.index.json"
#: a PEFT adapter's weights and config, as peft's ``save_pretrained`` names them
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_CONFIG_NAME = "adapter_config.json"
#: Files beside a checkpoint that make a loadable model directory.
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
)
#: Files any one of which is a tokenizer (``AutoTokenizer.from_pretrained`` reads them).
TOKENIZER_FILES = frozenset(
    {"tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "vocab.txt"}
)
