"""``verify_roundtrip``: the smoke test to run before a long training job.

Save the training state with DCP, load it back into state whose every byte differs, and compare
bit-exactly; rank 0 also runs :func:`ckptools.verify` on the written files. The ranks talk through
the protocol of :mod:`ckptools.engine.collective` (an all-gather of every rank's mismatches,
then rank 0's findings, or its error, broadcast), so every rank returns the same report.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ckptools.engine import collective
from ckptools.verify.report import Finding
from ckptools.verify.verifier import verify

#: Put in place of every non-tensor value before loading, so a value DCP failed to load is seen.
_NOT_LOADED = "<ckptools: not loaded>"


@dataclass(frozen=True)
class RoundtripReport:
    """The result of :func:`verify_roundtrip` (the same on every rank).

    Attributes:
        mismatches: ``"rank R: key: what"`` for every value that came back different, from all
            ranks.
        findings: what :func:`verify` found in the written files (run by rank 0).
        tensors: tensors compared on this rank (local shards of DTensors).
    """

    path: str
    rank: int
    world_size: int
    tensors: int
    values: int
    mismatches: tuple[str, ...]
    findings: tuple[Finding, ...]
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.findings

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "ok": self.ok,
            "rank": self.rank,
            "world_size": self.world_size,
            "tensors": self.tensors,
            "values": self.values,
            "mismatches": list(self.mismatches),
            "findings": [f.to_dict() for f in self.findings],
            "seconds": round(self.seconds, 4),
        }


def _local(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _fresh_state(value: Any) -> Any:
    """The same tree, each tensor replaced by one whose every byte differs from the original and
    each non-tensor leaf (as DCP flattens them) by a sentinel: whatever the load does not
    overwrite is then seen as a mismatch."""
    import torch

    if isinstance(value, torch.Tensor):
        fresh = torch.empty_like(value)
        src, dst = _local(value), _local(fresh)
        if src.numel():
            if src.dtype == torch.bool:
                dst.copy_(~src)
            else:
                raw = src.detach().contiguous().reshape(-1).view(torch.uint8) ^ 0xFF
                dst.copy_(raw.view(src.dtype).reshape(src.shape))
        return fresh
    if isinstance(value, dict):
        return {k: _fresh_state(v) for k, v in value.items()}
    if isinstance(value, list) and not _is_dcp_leaf(value):
        return [_fresh_state(v) for v in value]
    return _NOT_LOADED


def _is_dcp_leaf(value: list[Any]) -> bool:
    # DCP flattens a list only when it holds tensors or mappings (at any depth).
    import torch

    for v in value:
        if isinstance(v, torch.Tensor | dict):
            return False
        if isinstance(v, list) and not _is_dcp_leaf(v):
            return False
    return True


def _compare_state(original: Any, loaded: Any, key: str, out: list[str], counts: list[int]) -> None:
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(original, torch.Tensor):
        counts[0] += 1
        if not isinstance(loaded, torch.Tensor):
            out.append(f"{key}: loaded a {type(loaded).__name__}, saved a tensor")
            return
        if isinstance(original, DTensor) and (
            not isinstance(loaded, DTensor)
            or loaded.placements != original.placements
            or loaded.shape != original.shape
        ):
            out.append(f"{key}: loaded tensor is not sharded as the saved one")
            return
        a, b = _local(original).detach(), _local(loaded).detach()
        if a.dtype != b.dtype or a.shape != b.shape:
            out.append(f"{key}: saved {a.dtype} {list(a.shape)}, loaded {b.dtype} {list(b.shape)}")
            return
        if a.numel():
            ba = a.contiguous().reshape(-1).view(torch.uint8).view(a.numel(), -1)
            bb = b.contiguous().reshape(-1).view(torch.uint8).view(b.numel(), -1)
            if not torch.equal(ba, bb):
                differ = int((ba != bb).any(dim=1).sum())
                out.append(f"{key}: {differ} of {a.numel()} element(s) differ after reload")
        return
    if isinstance(original, dict):
        if not isinstance(loaded, dict):
            out.append(f"{key}: loaded a {type(loaded).__name__}, saved a dict")
            return
        for k, v in original.items():
            sub = f"{key}.{k}" if key else str(k)
            if k not in loaded:
                out.append(f"{sub}: missing after reload")
            else:
                _compare_state(v, loaded[k], sub, out, counts)
        return
    if (
        isinstance(original, list)
        and isinstance(loaded, list)
        and len(original) == len(loaded)
        and not _is_dcp_leaf(original)
    ):
        for i, (v, w) in enumerate(zip(original, loaded, strict=True)):
            _compare_state(v, w, f"{key}.{i}", out, counts)
        return
    counts[1] += 1
    if isinstance(loaded, str) and loaded == _NOT_LOADED:
        out.append(f"{key}: not loaded")
    elif loaded != original:
        out.append(f"{key}: saved {original!r}, loaded {loaded!r}")


def verify_roundtrip(
    model: Any,
    optimizer: Any | None,
    path: str,
    *,
    check_files: bool = True,
    process_group: Any | None = None,
) -> RoundtripReport:
    """Save the training state with DCP, load it back into fresh state, and compare bit-exactly.

    The smoke test to run before a long job: ``get_state_dict(model, optimizer)`` is saved with
    ``torch.distributed.checkpoint.save`` to ``path``, loaded with ``dcp.load`` into a copy of
    the state whose every tensor byte (and every non-tensor value) differs from the original,
    and every tensor (each rank's local shard of a DTensor, with its placements) and value is
    compared. With ``check_files`` rank 0 also runs :func:`verify` on the written checkpoint.
    The model and optimizer are not modified.

    Collective: every rank of ``process_group`` (default: the world) calls it with the same
    ``path`` (a directory all ranks share), in the same order relative to other collectives.
    Without an initialized process group it runs in one process. Each rank gets the same report.

    Args:
        model: the (FSDP2/FSDP1/DDP/plain) module.
        optimizer: its optimizer, or None to check the model state only.
        path: the directory to write the checkpoint into (its files are overwritten).
        check_files: also verify the written files (rank 0 reads them).
        process_group: the group to save and load with.

    Returns:
        A :class:`RoundtripReport`; ``report.ok`` is True when everything came back bit-exactly.

    Example:
        >>> report = ckptools.verify_roundtrip(model, optim, "/tmp/roundtrip")  # doctest: +SKIP
        >>> assert report.ok, report.mismatches
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    t0 = time.perf_counter()
    ranks = collective.of_group(process_group)
    model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [])
    state: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        state["optim"] = optim_sd
    dcp_save(state, checkpoint_id=path, process_group=process_group)
    fresh = _fresh_state(state)
    dcp_load(fresh, checkpoint_id=path, process_group=process_group)
    mismatches: list[str] = []
    counts = [0, 0]
    _compare_state(state, fresh, "", mismatches, counts)
    mine = [f"rank {ranks.rank}: {m}" for m in mismatches]
    everyone = ranks.from_all(lambda: mine, "verify_roundtrip")

    def check() -> tuple[Finding, ...]:
        return verify(path, quiet=True).findings if check_files else ()

    findings = ranks.from_root(check, "verify_roundtrip (verify of the written files)")
    return RoundtripReport(
        path=path,
        rank=ranks.rank,
        world_size=ranks.world_size,
        tensors=counts[0],
        values=counts[1],
        mismatches=tuple(m for part in everyone for m in part),
        findings=findings,
        seconds=time.perf_counter() - t0,
    )
