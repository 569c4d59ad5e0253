"""``CheckpointManager``: periodic crash-safe saves, retention, resume and async saves.

Roles and order (every rank calls every public method, in the same order; the steps are
:class:`ckptools.engine.collective.Ranks`' ``from_root``/``from_all``, so an error on one
rank reaches every rank instead of leaving them waiting):

``save``
    1. every rank waits for the previous async save (and raises its error, if any);
    2. rank 0 cleans stale ``.tmp-*`` directories, creates ``.tmp-step-<step>-<id>/``, writes
       ``config.json`` for ``transformers`` models; the name (or the error) reaches every rank;
    3. every rank writes its shards with ``dcp.save`` (or stages them and ``dcp.async_save``);
    4. an all-gather (the barrier); rank 0 writes the checksum manifest, then the commit marker
       last, renames to ``step-<step>/``, applies retention; a broadcast tells every rank whether
       it worked.

For async saves step 4 runs on a background thread per rank, over a gloo group of the manager's
own, so training collectives on the default group never interleave with the save's.

``latest()``, ``steps()`` read the directory (markers only) and need no collective.

``root`` may be an fsspec URL (``s3://bucket/run``): saves then write straight into
``step-<step>/`` through torch's ``FsspecWriter`` and commit by the marker alone (see
:mod:`ckptools.training.store`); before committing, rank 0 checks that every file the DCP
metadata names is there in full (:func:`ckptools.training.state.check_saved`), so a remote
writer that lost data never yields a checkpoint that looks complete.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from ckptools import _compat
from ckptools.engine import collective
from ckptools.engine.collective import Ranks
from ckptools.errors import CkptError, UsageError
from ckptools.io import space, storage
from ckptools.outputs import protocol
from ckptools.training import store
from ckptools.training.retention import RetentionPolicy
from ckptools.training.state import (
    EXTRA_KEY,
    NO_DIST_WARNING,
    check_saved,
    checkpoint_id,
    load,
    no_dist_warning_silenced,
    state_to_save,
    storage_writer,
    write_model_config,
)

__all__ = ["AsyncSaveError", "CheckpointManager"]

log = logging.getLogger(__name__)


class AsyncSaveError(CkptError, RuntimeError):
    """A previous asynchronous save failed; raised by the next ``save``/``wait``/``close``.

    Attributes:
        step: the step whose save failed.
    """

    def __init__(self, message: str, *, step: int, path: str | None = None) -> None:
        super().__init__(message, path=path)
        self.step = step


def _write_checksums(directory: str) -> None:
    """Write the checksum manifest (``ckptools.verify.checksums``, issue 5) into a checkpoint about
    to be
    committed. Rank 0 calls it, after every rank has written and before the marker, so the marker
    records the manifest's size too. It reads every byte once (checking the CRCs torch stored), so
    a checkpoint damaged while being written is never committed.
    """
    try:
        from ckptools.verify.checksums import write_checksums
    except ImportError:  # pragma: no cover - the checksum module is part of the package
        log.warning(
            "ckptools.verify.checksums is unavailable; committing %s without checksums", directory
        )
        return
    write_checksums(directory, quiet=True)


class _PreStaged(AsyncStager):
    """An ``AsyncStager`` for ``dcp.async_save`` whose input is already staged by the manager
    (into its reused buffer), so torch does not copy it a second time."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _signature(tree: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Structure, shapes and dtypes of every tensor of a state dict (the staging cache key)."""
    if isinstance(tree, Mapping):
        out: list[tuple[Any, ...]] = [(*path, "{}", tuple(sorted(map(str, tree))))]
        for k in sorted(tree, key=str):
            out.extend(_signature(tree[k], (*path, k)))
        return out
    if isinstance(tree, (list, tuple)):
        out = [(*path, "[]", len(tree))]
        for i, v in enumerate(tree):
            out.extend(_signature(v, (*path, i)))
        return out
    if isinstance(tree, torch.Tensor):
        local = tree.to_local() if hasattr(tree, "to_local") else tree
        return [(*path, type(tree).__name__, tuple(tree.shape), tuple(local.shape), tree.dtype)]
    if type(tree).__name__ == "ShardedTensor":
        shards = tuple(tuple(s.tensor.shape) for s in tree.local_shards())
        return [(*path, "ShardedTensor", tuple(tree.size()), shards, tree.dtype)]
    return [(*path, "object")]


class CheckpointManager:
    """Saves ``root/step-<step>/`` checkpoints atomically, keeps what the retention policy
    promises, and restores the newest complete one.

    Collective: construct it, and call ``save``, ``restore``, ``wait`` and ``close``, on every
    rank in the same order. ``latest`` and ``steps`` read the directory only (any rank).

    Args:
        root: directory holding ``step-<step>/`` checkpoints (created by rank 0).
        keep_last: keep the newest N complete checkpoints (None: no such rule).
        keep_every: also keep every checkpoint whose step is a multiple of K.
        keep_best: also keep the N best by ``metric`` (needs ``metric``).
        metric: metric name passed to ``save(metrics=...)``.
        mode: ``"min"`` or ``"max"``: which ``metric`` values are best.
        async_save: write with ``dcp.async_save``; ``save`` returns once the state is staged in
            a CPU buffer that is reused by later saves of the same shapes.
        checksums: write a checksum manifest into each checkpoint before its marker.
        process_group: the group whose ranks save together (default: the default group).
        storage_options: fsspec options for a URL ``root`` (credentials, endpoint...), a
            mapping or its JSON text, in force until :meth:`close` (background saves too);
            see :func:`ckptools.io.storage.storage_options`.

    Example:
        >>> import torch, ckptools
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.AdamW(model.parameters())
        >>> mgr = ckptools.CheckpointManager("/tmp/ckptools-doc/run", keep_last=2)
        >>> for step in (10, 20, 30):
        ...     _ = mgr.save(step, model, opt, extra={"step": step}, metrics={"loss": 1.0 / step})
        >>> mgr.steps()
        [20, 30]
        >>> mgr.restore(model, opt)[0]
        30
        >>> mgr.close()
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        keep_last: int | None = 3,
        keep_every: int | None = None,
        keep_best: int | None = None,
        metric: str | None = None,
        mode: Literal["min", "max"] = "min",
        async_save: bool = False,
        checksums: bool = True,
        *,
        process_group: dist.ProcessGroup | None = None,
        storage_options: storage.StorageOptions | None = None,
    ) -> None:
        self.root = os.fspath(root)
        self._storage_scope = storage.push_storage_options(storage_options)
        self.policy = RetentionPolicy(
            keep_last=keep_last,
            keep_every=keep_every,
            keep_best=keep_best,
            metric=metric,
            mode=mode,
        )
        self.async_save = async_save
        self.checksums = checksums
        self._pg = process_group
        self._distributed = dist.is_available() and dist.is_initialized()
        # Who does what, and errors reaching every rank, is collective.py's protocol.
        self._ranks = collective.of_group(process_group)
        self._closed = False
        self._pending: Future[None] | None = None
        self._pending_step: int | None = None
        self._async_pg: dist.ProcessGroup | None = None
        self._async_ranks = self._ranks
        self._executor: ThreadPoolExecutor | None = None
        self._staged: dict[str, Any] | None = None
        self._staged_signature: list[tuple[Any, ...]] | None = None
        self._lock = threading.Lock()
        self._ranks.from_root(lambda: store.check_root(self.root), "checking the root")
        if self._ranks.is_root:
            storage.makedirs(self.root)
            for name in store.clean_stale(self.root):
                log.info("cleaned up %s left by an earlier run", name)
        if async_save:
            if self._distributed:
                # Its own gloo group: the background commit's barriers and DCP's collectives must
                # never interleave with training collectives on the default group.
                ranks = dist.get_process_group_ranks(process_group) if process_group else None
                self._async_pg = dist.new_group(ranks=ranks, backend="gloo")
                self._async_ranks = collective.of_group(self._async_pg)
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptools-save")
            if not self._distributed:
                # Single-process async saves run dcp.save on torch's upload thread, where a
                # catch_warnings block cannot reach; its "assuming a single process" warning is
                # exactly our intent, so it is silenced for that message only.
                warnings.filterwarnings("ignore", message=NO_DIST_WARNING, category=UserWarning)
        self._ranks.from_all(lambda: None, "starting the CheckpointManager")

    # ---------------------------------------------------------------------------------- queries

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, ascending. Reads markers only; any rank."""
        return [c.step for c in store.list_checkpoints(self.root, include_tmp=False) if c.complete]

    def latest(self) -> str | None:
        """Path of the newest complete checkpoint, or None. Reads markers only; any rank."""
        steps = self.steps()
        return store.step_dir(self.root, steps[-1]) if steps else None

    # ----------------------------------------------------------------------------------- saving

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        extra: Mapping[str, Any] | None = None,
        metrics: Mapping[str, Any] | None = None,
    ) -> str:
        """Save ``root/step-<step>/`` atomically, then apply retention. Collective.

        With ``async_save`` it returns once this rank's state is staged; the write, commit and
        retention finish in the background, and the next call waits for them.

        Args:
            step: the training step (non-negative integer; names the directory).
            model: the (wrapped) model, as for :func:`ckptools.save`.
            optimizer: its optimizer.
            extra: other state, as for :func:`ckptools.save`.
            metrics: numbers recorded in the marker, for ``keep_best`` and ``ckpt list``.

        Returns:
            The final path ``root/step-<step>`` (committed already unless ``async_save``).

        Raises:
            AsyncSaveError: the previous asynchronous save failed.
            UsageError: ``step`` is not a non-negative integer, or the manager is closed.
        """
        if self._closed:
            raise UsageError("this CheckpointManager is closed")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise UsageError(f"step must be a non-negative integer, got {step!r}")
        self.wait()
        output = self._output(step, dict(metrics or {}))
        final = output.out
        state = state_to_save(model, optimizer, extra)
        fill = self._filler(model)
        if self._executor is None:
            with protocol.staged(self._ranks, output, fill) as stage:
                with no_dist_warning_silenced(), space.translated(stage.tmp):  # a full disk
                    dcp_save(
                        state,
                        checkpoint_id=checkpoint_id(stage.tmp),
                        storage_writer=storage_writer(stage.tmp),
                        process_group=self._pg,
                        no_dist=not self._distributed,
                    )
                self._commit(step, output, stage, self._ranks)
            return final
        stage = protocol.begin(self._ranks, output, fill)
        try:
            staged = self._stage(state)
            with no_dist_warning_silenced():
                upload = dcp_async_save(
                    staged,
                    checkpoint_id=checkpoint_id(stage.tmp),
                    storage_writer=storage_writer(stage.tmp),
                    process_group=self._async_pg,
                    async_stager=_PreStaged(),  # type: ignore[arg-type]
                    no_dist=not self._distributed,
                )
        except BaseException as e:  # every rank stages; torch's errors reach every rank
            protocol.abandon(self._ranks, output, stage, e)
            raise
        upload_future: Future[Any] = (
            upload if isinstance(upload, Future) else upload.upload_completion
        )

        def finish() -> None:
            try:
                self._commit(step, output, stage, self._async_ranks, upload_future.result)
            except BaseException as e:
                protocol.abandon(self._async_ranks, output, stage, e)
                raise

        with self._lock:
            self._pending = self._executor.submit(finish)
            self._pending_step = step
        return final

    def _stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """Copy this rank's tensors into the reused CPU buffer (reallocated only when shapes
        change); ``extra`` is deep-copied, since it may hold any picklable value."""
        tensors = {k: v for k, v in state.items() if k != EXTRA_KEY}
        signature = _signature(tensors)
        if self._staged is None or signature != self._staged_signature:
            self._staged = _compat.create_cpu_state_dict(tensors)
            self._staged_signature = signature
        staged = _compat.copy_state_dict(tensors, self._staged)
        staged[EXTRA_KEY] = copy.deepcopy(state[EXTRA_KEY])
        return staged

    def _output(self, step: int, metrics: Mapping[str, Any]) -> protocol.Output:
        """``root/step-<step>/`` through the output protocol: the same step saved again
        replaces its checkpoint, never a directory of other files; staged in
        ``root/.tmp-step-<step>-<id>/`` once what crashed saves left is cleaned; published by
        the marker (written after the checksum manifest, whose size it records), the rename
        and retention."""
        final = store.step_dir(self.root, step)

        def location() -> str:
            store.clean_stale(self.root)
            tmp = store.new_tmp_dir(self.root, step)
            store.create_tmp_dir(tmp)
            return tmp

        def publish(tmp: str) -> None:
            with self._failing_commit(step, tmp):
                world_size = self._ranks.world_size
                store.write_marker(tmp, step=step, world_size=world_size, metrics=metrics)
                store.commit(tmp, final)
                decision = store.prune(self.root, self.policy).decision
                if decision.delete:
                    log.info("retention deleted steps %s", list(decision.delete))

        what = f"checkpoint step {step} in {self.root}"
        return protocol.Output(
            out=final, kind="dcp", overwrite=True, what=what, location=location, publish=publish
        )

    @staticmethod
    def _filler(model: nn.Module) -> Callable[[str], None]:
        """What rank 0 writes into the staging location first: the model's ``config.json``."""

        def fill(tmp: str) -> None:
            written = write_model_config(model, tmp)
            if written:
                log.debug("wrote %s into %s", written, tmp)

        return fill

    @contextmanager
    def _failing_commit(self, step: int, tmp: str) -> Iterator[None]:
        """Rank 0's sealing and committing: any failure one line naming the step and root."""
        try:
            yield
        except Exception as e:
            log.exception("committing step %d failed", step)
            raise CkptError(
                f"committing checkpoint step {step} in {self.root} failed on rank 0: "
                f"{type(e).__name__}: {e}",
                path=tmp,
            ) from e

    def _commit(
        self,
        step: int,
        output: protocol.Output,
        stage: protocol.Stage[None],
        ranks: Ranks,
        written: Callable[[], object] = lambda: None,
    ) -> None:
        """Once ``written`` returns on every rank (the barrier; an asynchronous save's upload),
        rank 0 seals (a remote writer's files checked, the checksum manifest) and publishes;
        every rank learns the outcome."""

        def seal() -> None:
            with self._failing_commit(step, stage.tmp):
                if storage.is_url(stage.tmp):
                    check_saved(stage.tmp)  # a remote writer that lost data is not committed
                if self.checksums:
                    _write_checksums(stage.tmp)

        def wait_written() -> None:
            written()

        ranks.from_all(wait_written, f"writing {output.what}")
        protocol.commit(ranks, output, stage, seal)

    def wait(self) -> None:
        """Wait for the pending asynchronous save, if any. Collective when ``async_save``.

        Raises:
            AsyncSaveError: it failed (on this rank, or its commit failed on rank 0).
        """
        with self._lock:
            pending, step = self._pending, self._pending_step
            self._pending = None
            self._pending_step = None
        if pending is None or step is None:
            return
        try:
            pending.result()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # torch's CheckpointException derives from BaseException
            raise AsyncSaveError(
                f"asynchronous save of step {step} to {self.root} failed: {e}; the previous "
                f"complete checkpoint ({self.latest()}) is untouched",
                step=step,
                path=self.root,
            ) from e

    def close(self) -> None:
        """Wait for the pending save, then release the background thread and group. Collective.

        Raises:
            AsyncSaveError: the last asynchronous save failed.
        """
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            storage.pop_storage_options(self._storage_scope)
            self._storage_scope = None
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            self._staged = None
            if self._async_pg is not None:
                dist.destroy_process_group(self._async_pg)
                self._async_pg = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------------------------- restoring

    def restore(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        extra: Mapping[str, Any] | None = None,
    ) -> tuple[int, dict[str, Any]] | None:
        """Load the newest complete checkpoint into ``model``/``optimizer``. Collective.

        Rank 0 picks the checkpoint and broadcasts its step, so every rank loads the same one even
        if another process prunes meanwhile.

        Args:
            model: the freshly built (wrapped, sharded) model; any world size.
            optimizer: the optimizer to restore.
            extra: ``Stateful`` objects to restore in place, as for :func:`ckptools.load`.

        Returns:
            ``(step, extra)`` of the checkpoint loaded, or None when there is none.
        """
        self.wait()

        def newest() -> int | None:
            steps = self.steps()
            return steps[-1] if steps else None

        step = self._ranks.from_root(newest, f"finding the newest checkpoint in {self.root}")
        if step is None:
            return None
        loaded = load(
            store.step_dir(self.root, step), model, optimizer, extra=extra, process_group=self._pg
        )
        return step, loaded
