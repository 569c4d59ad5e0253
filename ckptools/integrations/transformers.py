"""``CkptoolsCallback``: a Hugging Face model directory from each FSDP checkpoint a Trainer saves.

With FSDP and ``SHARDED_STATE_DICT`` the ``transformers`` Trainer saves ``checkpoint-<step>/`` as
DCP directories (``pytorch_model_fsdp_0/``, ``optimizer_0/``) that ``from_pretrained`` cannot
read. After each such save this callback runs :func:`ckptools.consolidate` on it, so
``checkpoint-<step>/hf/`` (by default) holds ``model.safetensors`` files, ``config.json`` and the
tokenizer files, ready for ``from_pretrained``. Checkpoints that are not sharded (no FSDP, or
``FULL_STATE_DICT``, which the Trainer already writes as safetensors) are left alone.

Example:
    >>> from transformers import Trainer
    >>> from ckptools.integrations.transformers import CkptoolsCallback
    >>> trainer = Trainer(model, args, train_dataset=ds,  # doctest: +SKIP
    ...                   callbacks=[CkptoolsCallback(max_shard_size="2GB", dtype="bfloat16")])
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any

from transformers import TrainerCallback

from ..consolidate import DEFAULT_MAX_SHARD_SIZE, CastDType, ConsolidateResult, consolidate
from ..errors import UsageError

__all__ = ["FSDP_MODEL_DIR", "CkptoolsCallback"]

log = logging.getLogger(__name__)

#: The DCP directory accelerate's ``save_fsdp_model`` writes for the first model, which the
#: Trainer calls for ``SHARDED_STATE_DICT``; its presence means the checkpoint is sharded.
FSDP_MODEL_DIR = "pytorch_model_fsdp_0"


def _group() -> Any:
    """``torch.distributed`` when a process group of more than one rank is initialised."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


class CkptoolsCallback(TrainerCallback):  # type: ignore[misc]
    """Consolidate each FSDP sharded checkpoint the Trainer saves into a model directory.

    ``on_save`` runs on every rank after ``Trainer._save_checkpoint``. When
    ``<output_dir>/checkpoint-<global_step>/pytorch_model_fsdp_0/`` exists (as rank 0 sees it; its
    decision is broadcast), every rank calls :func:`ckptools.consolidate` on that checkpoint: under
    an initialised process group consolidate is collective (each rank copies a share of the bytes;
    rank 0 creates the files, writes the index last and renames), so the other ranks are busy
    rather than waiting at a barrier, and all return together. Otherwise it does nothing.

    The model's ``config.json`` / ``generation_config.json`` (from the Trainer's model, when it is
    a ``transformers.PreTrainedModel``) and the tokenizer files (from the Trainer's
    ``processing_class``) are written to a temporary directory and passed as ``config=``, so the
    output loads with ``from_pretrained`` and ``tie_word_embeddings`` is honoured.

    Args:
        output_subdir: where the model directory goes, relative to the checkpoint directory (an
            absolute path is used as is; ``{step}`` is replaced by the global step).
        max_shard_size: largest safetensors file, e.g. ``"5GB"``.
        dtype: cast floating tensors to ``"bfloat16"``, ``"float16"`` or ``"float32"``.
        push_to_hub: reserved: pushing the consolidated model lands with the Hub issue; must be
            None until then.
        overwrite: replace an existing output directory (a resumed run saving the same step).

    Attributes:
        last_result: the :class:`~ckptools.ConsolidateResult` of the latest consolidation.

    Raises:
        UsageError: ``push_to_hub`` is given.

    Example:
        >>> from ckptools.integrations.transformers import CkptoolsCallback
        >>> callback = CkptoolsCallback("hf", max_shard_size="2GB")
        >>> callback.output_subdir
        'hf'
    """

    def __init__(
        self,
        output_subdir: str = "hf",
        *,
        max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
        dtype: CastDType | None = None,
        push_to_hub: str | None = None,
        overwrite: bool = True,
    ) -> None:
        if push_to_hub is not None:
            raise UsageError("push_to_hub is not available yet: it lands with the Hub issue")
        self.output_subdir = output_subdir
        self.max_shard_size = max_shard_size
        self.dtype = dtype
        self.push_to_hub = push_to_hub
        self.overwrite = overwrite
        self.last_result: ConsolidateResult | None = None

    def checkpoint_dir(self, args: Any, state: Any) -> str:
        """The directory ``Trainer._save_checkpoint`` just wrote."""
        return os.path.join(str(args.output_dir), f"checkpoint-{state.global_step}")

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Every rank: consolidate the checkpoint just saved, if it is an FSDP sharded one."""
        checkpoint = self.checkpoint_dir(args, state)
        sharded = os.path.isdir(os.path.join(checkpoint, FSDP_MODEL_DIR))
        dist = _group()
        if dist is not None:
            # Every rank must take the same branch: consolidate is collective.
            decision = [sharded]
            dist.broadcast_object_list(decision, src=0)
            sharded = bool(decision[0])
        if not sharded:
            log.debug("%s: no %s/, nothing to consolidate", checkpoint, FSDP_MODEL_DIR)
            return
        out = os.path.join(checkpoint, self.output_subdir.replace("{step}", str(state.global_step)))
        with tempfile.TemporaryDirectory(prefix="ckptools-config-") as config_dir:
            config = _write_model_files(
                kwargs.get("model"), kwargs.get("processing_class"), config_dir
            )
            self.last_result = consolidate(
                checkpoint,
                out,
                max_shard_size=self.max_shard_size,
                dtype=self.dtype,
                config=config,
                overwrite=self.overwrite,
                quiet=True,
            )
        if getattr(state, "is_world_process_zero", True):
            log.info("consolidated %s into %s", checkpoint, out)


def _write_model_files(model: Any, processing_class: Any, directory: str) -> str | None:
    """Write the model's config files and the tokenizer files into ``directory``; return it, or
    None when nothing was written (consolidate then looks beside the checkpoint)."""
    if model is not None:
        from ..training.state import write_model_config

        write_model_config(model, directory)
    if processing_class is not None and hasattr(processing_class, "save_pretrained"):
        processing_class.save_pretrained(directory)
    return directory if os.path.isfile(os.path.join(directory, "config.json")) else None
