"""What a push says about the model: its provenance and the ``README.md`` model card.

Unless the directory has its own ``README.md``, a push uploads a generated card: YAML metadata
(``library_name``, tags, and a ``ckptools`` block with the source checkpoint, step, world size,
dtype and each file's SHA-256) and a short body. The card is uploaded from memory, never written
into the directory: the directory stays exactly what ``ckpt consolidate`` (or the user) made it,
a read-only directory can be pushed, and a later push of the same directory regenerates the card
rather than mistaking an old generated card for the user's own.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptools.core.manifest import Manifest
from ckptools.core.sizes import human_count, human_size
from ckptools.errors import CkptError
from ckptools.io import storage

CARD_NAME = "README.md"
_STEP_PATTERNS = (
    re.compile(r"^checkpoint-(\d+)$"),  # transformers Trainer
    re.compile(r"^step[-_]?(\d+)$"),  # ckptools' CheckpointManager, torchtitan
    re.compile(r"^global_step_?(\d+)$"),  # DeepSpeed
    re.compile(r"(?:^|[-_])step=(\d+)"),  # Lightning's "epoch=0-step=100.ckpt"
)


@dataclass(frozen=True)
class HubFile:
    """One file of a push.

    Attributes:
        name: its path in the repository (``/``-separated).
        bytes: its size.
        sha256: hex SHA-256 of its content (None in a dry run, which reads no file data).
        generated: True for the model card ckptools generated (not a file of the directory).
    """

    name: str
    bytes: int
    sha256: str | None = None
    generated: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "bytes": self.bytes,
            "sha256": self.sha256,
            "generated": self.generated,
        }


def step_of(path: str) -> int | None:
    """The training step a checkpoint path names (``checkpoint-500``, ``step-1000``,
    ``global_step300``, ``epoch=0-step=100.ckpt``), or from a Trainer's ``trainer_state.json``."""
    state = os.path.join(path, "trainer_state.json")
    if os.path.isfile(state):
        with contextlib.suppress(OSError, CkptError, ValueError, TypeError, KeyError):
            return int(storage.read_json(state, what="trainer state")["global_step"])
    parts = os.path.normpath(os.path.abspath(path)).split(os.sep)
    for part in reversed(parts[-3:]):
        for pattern in _STEP_PATTERNS:
            m = pattern.search(part)
            if m:
                return int(m.group(1))
    return None


def provenance(
    manifest: Manifest,
    source: str | None = None,
    *,
    sha256: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Where the weights of a model directory came from: the ``ckptools`` block of the card.

    Args:
        manifest: the model directory's manifest.
        source: the checkpoint it was consolidated from; read (metadata only) for its layout,
            world size and step. Only its last two path components are recorded, since a full
            local path can leak private names into a public card.
        sha256: file name → hex SHA-256 of the files pushed.

    Raises:
        CkptError: ``source`` is given but cannot be read.
    """
    from ckptools._version import __version__

    out: dict[str, Any] = {"version": __version__}
    if source is not None:
        from ckptools.producers import read_manifest

        src = read_manifest(source)
        parts = os.path.normpath(os.path.abspath(source)).split(os.sep)
        out["source"] = "/".join(p for p in parts[-2:] if p)
        out["source_layout"] = src.layout
        if src.world_size is not None:
            out["world_size"] = src.world_size
        step = step_of(source)
        if step is not None:
            out["step"] = step
    per_dtype: dict[str, int] = {}
    for t in manifest.tensors.values():
        per_dtype[t.dtype] = per_dtype.get(t.dtype, 0) + t.numel
    ranked = sorted(per_dtype, key=lambda d: -per_dtype[d])
    if len(ranked) == 1:
        out["dtype"] = ranked[0]
    elif ranked:
        out["dtype"] = {d: per_dtype[d] for d in ranked}  # parameters per dtype
    out["parameters"] = manifest.total_params
    out["tensors"] = len(manifest.tensors)
    return with_checksums(out, sha256) if sha256 else out


def with_checksums(prov: Mapping[str, Any], sha256: Mapping[str, str]) -> dict[str, Any]:
    """``prov`` with the SHA-256 of each file pushed: the provenance is read (the source's
    metadata too) before hashing, and completed once the digests are known."""
    return {**prov, "checksums": {"algorithm": "sha256", "files": dict(sorted(sha256.items()))}}


def read_config(directory: str) -> dict[str, Any]:
    """``config.json`` of ``directory`` as a dict; ``{}`` when missing or unreadable."""
    path = os.path.join(directory, "config.json")
    try:
        cfg = storage.read_json(path, what="model config")
    except (OSError, CkptError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def model_card(
    repo_id: str,
    prov: Mapping[str, Any],
    files: Sequence[HubFile],
    config: Mapping[str, Any],
) -> str:
    """The ``README.md`` ckptools writes: YAML metadata (``library_name``, tags, the ``ckptools``
    provenance block), what the weights are and where they came from, the files, and how to load.
    """
    import yaml  # a dependency of huggingface_hub

    tags = ["ckptools"]
    if any(f.name.endswith(".safetensors") for f in files):
        tags.append("safetensors")
    model_type = config.get("model_type")
    if isinstance(model_type, str) and model_type:
        tags.append(model_type)
    meta = {"library_name": "transformers", "tags": tags, "ckptools": dict(prov)}
    front = yaml.safe_dump(meta, sort_keys=False, default_flow_style=False, allow_unicode=True)
    name = repo_id.rsplit("/", 1)[-1]
    lines = [f"---\n{front}---", "", f"# {name}", ""]
    if "source" in prov:
        lines.append(
            "Weights consolidated with ckptools from the PyTorch distributed checkpoint below."
        )
    else:
        lines.append("Model weights uploaded with ckptools.")
    lines += ["", "| | |", "|---|---|"]
    if "source" in prov:
        where = f"`{prov['source']}` ({prov['source_layout']}"
        if "world_size" in prov:
            where += f", {prov['world_size']} ranks"
        lines.append(f"| Source checkpoint | {where}) |")
    if "step" in prov:
        lines.append(f"| Step | {prov['step']} |")
    dtype = prov.get("dtype")
    if isinstance(dtype, Mapping):
        dtype = ", ".join(f"{d} ({human_count(n)} parameters)" for d, n in dtype.items())
    if dtype:
        lines.append(f"| dtype | {dtype} |")
    lines.append(f"| Parameters | {human_count(int(prov.get('parameters', 0)))} |")
    lines += ["", "## Files", "", "| file | size | sha256 |", "|---|---:|---|"]
    for f in files:
        if not f.generated:
            lines.append(f"| `{f.name}` | {human_size(f.bytes)} | `{f.sha256 or '-'}` |")
    arch = config.get("architectures")
    cls = arch[0] if isinstance(arch, list) and arch and isinstance(arch[0], str) else "AutoModel"
    lines += [
        "",
        "## Load",
        "",
        "```python",
        f"from transformers import {cls}",
        "",
        f'model = {cls}.from_pretrained("{repo_id}")',
        "```",
    ]
    if not config:
        lines += ["", "The repository has no `config.json`: `from_pretrained` needs one."]
    return "\n".join(lines) + "\n"


def default_message(prov: Mapping[str, Any]) -> str:
    """The commit summary when none is given: says ckptools, the source and the step."""
    message = "Upload model with ckptools"
    if "source" in prov:
        message += f" from {prov['source']}"
    if "step" in prov:
        message += f" (step {prov['step']})"
    return message
