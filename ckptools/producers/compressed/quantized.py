"""A quantized Hugging Face model directory: safetensors files whose config.json has a
``quantization_config`` (compressed-tensors, DeepSeek's fp8, torchao...), or whose headers name
torchao's tensor subclasses.

Read as the safetensors model directory it is (:func:`ckptools.producers.hf.safetensors.
read_safetensors`: every tensor as stored, so a plain copy keeps the quantized form bit for
bit), with its form (:mod:`.forms`) in ``details["quantized"]``; its ``decodes``
(:mod:`.dequantize`) write the plain model for ``consolidate --dtype``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ckptools.core.manifest import Manifest
from ckptools.errors import CkptError, CorruptCheckpointError
from ckptools.formats import safetensors_header
from ckptools.io import storage
from ckptools.producers.base import Layout, register
from ckptools.producers.compressed.forms import KEY, form_of, torchao_metadata
from ckptools.producers.hf.safetensors import INDEX_SUFFIX, read_safetensors

NAME = "quantized_safetensors"
#: the largest config.json read while probing (a model's config is a few KB)
_MAX_CONFIG_BYTES = 4 * 2**20


def _config(directory: str) -> dict[str, Any] | None:
    """``directory``'s config.json as a mapping, None when absent or not JSON (the safetensors
    layout and the config rule then say what they say of it)."""
    path = storage.join(directory, "config.json")
    if not storage.isfile(path):
        return None
    try:
        value = storage.read_json(path, _MAX_CONFIG_BYTES, what="model config")
    except (OSError, CkptError):
        return None
    return value if isinstance(value, dict) else None


def _first_safetensors(path: str) -> str | None:
    if storage.isfile(path):
        return path if path.endswith(".safetensors") else None
    names = sorted(n for n in storage.listdir(path) if n.endswith(".safetensors"))
    return storage.join(path, names[0]) if names else None


def _torchao_header(path: str) -> bool:
    first = _first_safetensors(path)
    if first is None:
        return False
    try:
        header = safetensors_header.read_header(first)
    except (OSError, CorruptCheckpointError):
        return False
    return torchao_metadata({"": header.metadata})


class QuantizedSafetensorsLayout(Layout):
    name = NAME
    model_directory = True
    decodes = "compressed.dequantize"
    description = (
        "quantized Hugging Face model directory (FP8 weights and their scales: "
        "compressed-tensors, DeepSeek fp8, torchao)"
    )

    def probe(self, path: str) -> str | None:
        directory = path if storage.isdir(path) else storage.dirname(path)
        if storage.isdir(path):
            names = storage.listdir(path)
            if not any(n.endswith((".safetensors", INDEX_SUFFIX)) for n in names):
                return "no *.safetensors files"
        elif not path.endswith(".safetensors") or not storage.isfile(path):
            return "not a .safetensors file or a model directory"
        config = _config(directory)
        if isinstance((config or {}).get("quantization_config"), dict):
            return None
        if _torchao_header(path):
            return None
        return "no quantization_config in config.json and no torchao tensors"

    def read_manifest(self, path: str) -> Manifest:
        manifest = read_safetensors(path)
        directory = path if storage.isdir(path) else storage.dirname(path)
        form = form_of(_config(directory), manifest)
        details = dict(manifest.details)
        if form is not None:
            details[KEY] = form.to_dict()
        return replace(manifest, layout=NAME, details=details)


register(QuantizedSafetensorsLayout())
