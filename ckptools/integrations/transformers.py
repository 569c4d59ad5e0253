"""``CkptoolsCallback``: a Hugging Face model directory from each FSDP checkpoint a Trainer saves.

With FSDP and ``SHARDED_STATE_DICT`` the ``transformers`` Trainer saves ``checkpoint-<step>/`` as
DCP directories (``pytorch_model_fsdp_0/``, ``optimizer_0/``) that ``from_pretrained`` cannot
read. After each such save this callback runs :func:`ckptools.consolidate` on it, so
``checkpoint-<step>/hf/`` (by default) holds ``model.safetensors`` files, ``config.json`` and the
tokenizer files, ready for ``from_pretrained``. With ``push_to_hub="me/model"`` each consolidated
model is then published with :func:`ckptools.push_to_hub`, in the background. Checkpoints that are
not sharded (no FSDP, or ``FULL_STATE_DICT``, which the Trainer already writes as safetensors) are
left alone.

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
import threading
from typing import Any

from transformers import TrainerCallback

from ckptools.engine import collective
from ckptools.hub import PushResult, push_to_hub
from ckptools.verbs.consolidate import (
    DEFAULT_MAX_SHARD_SIZE,
    CastDType,
    ConsolidateResult,
    consolidate,
)

__all__ = ["FSDP_MODEL_DIR", "CkptoolsCallback"]

log = logging.getLogger(__name__)

#: The DCP directory accelerate's ``save_fsdp_model`` writes for the first model, which the
#: Trainer calls for ``SHARDED_STATE_DICT``; its presence means the checkpoint is sharded.
FSDP_MODEL_DIR = "pytorch_model_fsdp_0"


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

    With ``push_to_hub``, rank 0 then publishes the model directory with
    :func:`ckptools.push_to_hub` (the same checks, model card and upload as ``ckpt push``, the
    checkpoint recorded as its source) in a background thread: an upload can take longer than a
    collective's timeout, so training goes on meanwhile. One push runs at a time; before the next
    save (which may rotate old checkpoints away, ``save_total_limit``) and at the end of training
    the callback waits for it. A failed push is logged and does not stop training;
    :meth:`wait_for_push` returns the result or raises the error.

    Args:
        output_subdir: where the model directory goes, relative to the checkpoint directory (an
            absolute path is used as is; ``{step}`` is replaced by the global step).
        max_shard_size: largest safetensors file, e.g. ``"5GB"``.
        dtype: cast floating tensors to ``"bfloat16"``, ``"float16"`` or ``"float32"``.
        push_to_hub: a Hub repository id (``"me/model"``) to publish each consolidated model to.
        hub_private: create that repository private.
        hub_revision: the branch to push to (default: the repository's default branch).
        hub_token: a Hub token (default: ``HF_TOKEN`` or the saved login).
        hub_endpoint: the Hub's URL (default: ``HF_ENDPOINT`` or huggingface.co).
        overwrite: replace an existing output directory (a resumed run saving the same step).

    Attributes:
        last_result: the :class:`~ckptools.ConsolidateResult` of the latest consolidation.
        last_push: the :class:`~ckptools.PushResult` of the latest push that succeeded.
        push_error: the error of the latest push, when it failed.

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
        hub_private: bool = False,
        hub_revision: str | None = None,
        hub_token: str | None = None,
        hub_endpoint: str | None = None,
        overwrite: bool = True,
    ) -> None:
        self.output_subdir = output_subdir
        self.max_shard_size = max_shard_size
        self.dtype = dtype
        self.push_to_hub = push_to_hub
        self.hub_private = hub_private
        self.hub_revision = hub_revision
        self.hub_token = hub_token
        self.hub_endpoint = hub_endpoint
        self.overwrite = overwrite
        self.last_result: ConsolidateResult | None = None
        self.last_push: PushResult | None = None
        self.push_error: BaseException | None = None
        self._push_thread: threading.Thread | None = None

    def checkpoint_dir(self, args: Any, state: Any) -> str:
        """The directory ``Trainer._save_checkpoint`` just wrote."""
        return os.path.join(str(args.output_dir), f"checkpoint-{state.global_step}")

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Every rank: consolidate the checkpoint just saved, if it is an FSDP sharded one."""
        checkpoint = self.checkpoint_dir(args, state)
        seen = os.path.isdir(os.path.join(checkpoint, FSDP_MODEL_DIR))
        ranks = collective.current()
        # Every rank must take rank 0's branch: consolidate is collective.
        sharded = ranks.from_root(lambda: seen, "CkptoolsCallback")
        if not sharded:
            log.debug("%s: no %s/, nothing to consolidate", checkpoint, FSDP_MODEL_DIR)
            return
        out = os.path.join(checkpoint, self.output_subdir.replace("{step}", str(state.global_step)))
        with tempfile.TemporaryDirectory(prefix="ckptools-config-") as config_dir:
            config = _write_model_files(
                kwargs.get("model"), kwargs.get("processing_class"), config_dir
            )
            self.last_result = consolidate(
                # the model's DCP directory, not checkpoint-N: OUT lies beside the source, never
                # inside it (checkpoint-N/hf/ is this callback's design, refused to the CLI)
                os.path.join(checkpoint, FSDP_MODEL_DIR),
                out,
                max_shard_size=self.max_shard_size,
                dtype=self.dtype,
                config=config,
                # a save must not stop the training: with no config (a model that is no
                # PreTrainedModel, none beside the checkpoint) OUT holds the weights, as noted
                weights_only=True,
                overwrite=self.overwrite,
                quiet=True,
            )
        if ranks.is_root and getattr(state, "is_world_process_zero", True):
            log.info("consolidated %s into %s", checkpoint, out)
            if self.push_to_hub is not None:
                self._start_push(out, checkpoint)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Before a save: wait for the running push (the save may rotate its directory away)."""
        if getattr(control, "should_save", False):
            self._join_push()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Wait for the running push, so the last checkpoint is published when training ends."""
        self._join_push()

    def wait_for_push(self) -> PushResult | None:
        """Wait for the running push; return the latest push's result (None if none ran).

        Raises:
            CkptError: the latest push failed (the same error ``ckpt push`` would report).
        """
        self._join_push()
        if self.push_error is not None:
            raise self.push_error
        return self.last_push

    def _join_push(self) -> None:
        if self._push_thread is not None:
            self._push_thread.join()
            self._push_thread = None

    def _start_push(self, directory: str, checkpoint: str) -> None:
        self._join_push()
        repo_id = self.push_to_hub
        assert repo_id is not None

        def run() -> None:
            try:
                self.last_push = push_to_hub(
                    directory,
                    repo_id,
                    private=self.hub_private,
                    revision=self.hub_revision,
                    token=self.hub_token,
                    endpoint=self.hub_endpoint,
                    source=checkpoint,
                    quiet=True,
                    weights_only=True,  # as the consolidation was, and noted
                )
                self.push_error = None
                log.info("pushed %s to %s: %s", directory, repo_id, self.last_push.commit_url)
            except Exception as e:  # kept for wait_for_push; training goes on
                self.push_error = e
                log.error("push of %s to %s failed: %s", directory, repo_id, e)

        self._push_thread = threading.Thread(target=run, name="ckptools-push", daemon=False)
        self._push_thread.start()


def _write_model_files(model: Any, processing_class: Any, directory: str) -> str | None:
    """Write the model's config files and the tokenizer files into ``directory``; return it, or
    None when nothing was written (consolidate then looks beside the checkpoint)."""
    if model is not None:
        from ckptools.training.state import write_model_config

        write_model_config(model, directory)
    if processing_class is not None and hasattr(processing_class, "save_pretrained"):
        processing_class.save_pretrained(directory)
    return directory if os.path.isfile(os.path.join(directory, "config.json")) else None
