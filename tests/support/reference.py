"""Turn a producer's reference file into what each DCP directory holds, load that back with torch's
own ``dcp.load`` (one process) and compare bit-exactly.

Example:
    >>> ref = load_reference("/tmp/ck.reference.pt")  # doctest: +SKIP
    >>> assert_checkpoint_matches("/tmp/ck", ref)  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import io
import os
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict

__all__ = [
    "Unloaded",
    "assert_bitwise_equal",
    "assert_checkpoint_matches",
    "expected_checkpoints",
    "flat_expected",
    "load_reference",
    "load_with_dcp",
    "tensor_bytes",
]


class Unloaded:
    """Placeholder for a non-tensor value ``dcp.load`` is expected to replace."""

    def __repr__(self) -> str:
        return "<not loaded>"


def load_reference(ref_path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a producer's reference (plain containers, tensors, bytes: safe with weights_only)."""
    ref: dict[str, Any] = torch.load(os.fspath(ref_path), weights_only=True)
    return ref


def _place(root: dict[str, Any], key_path: tuple[str, ...], value: dict[str, Any]) -> None:
    node = root
    for key in key_path:
        node = node.setdefault(key, {})
    overlap = set(node) & set(value)
    if overlap:
        raise ValueError(f"reference parts collide at {key_path}: {sorted(overlap)[:5]}")
    node.update(copy.deepcopy(value))


def expected_checkpoints(ref: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The nested state dict each DCP directory of the checkpoint holds, keyed by subdirectory
    (``"."`` for the checkpoint root), built from the reference's ``layout``."""
    out: dict[str, dict[str, Any]] = {}
    for part in ("model", "optim", "extra"):
        where = ref["layout"].get(part)
        if where is None:
            continue
        subdir, key_path = where
        _place(out.setdefault(subdir, {}), tuple(key_path), ref[part])
    return out


def flat_expected(ref: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per subdirectory, the expected values keyed by DCP's flattened FQN (``.metadata`` keys)."""
    return {sub: flatten_state_dict(sd)[0] for sub, sd in expected_checkpoints(ref).items()}


def _load_target(expected: dict[str, Any]) -> dict[str, Any]:
    flat, mappings = flatten_state_dict(expected)
    target: dict[str, Any] = {}
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            target[key] = torch.empty_like(value)
        else:
            target[key] = Unloaded()
    return unflatten_state_dict(target, mappings)


def load_with_dcp(root: str | os.PathLike[str], ref: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Load every DCP directory of the checkpoint at ``root`` with ``dcp.load`` (this process only,
    ``no_dist=True``) into tensors preallocated from the reference.

    Fails if the checkpoint's ``.metadata`` keys differ from the reference's (``dcp.load`` itself
    ignores checkpoint keys the target lacks).
    """
    loaded: dict[str, dict[str, Any]] = {}
    for subdir, expected in expected_checkpoints(ref).items():
        path = os.path.normpath(os.path.join(os.fspath(root), subdir))
        stored = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
        wanted = set(flatten_state_dict(expected)[0])
        if stored != wanted:
            raise AssertionError(
                f"{path}: keys differ; only in checkpoint: {sorted(stored - wanted)[:10]}, "
                f"only in reference: {sorted(wanted - stored)[:10]}"
            )
        target = _load_target(expected)
        with warnings.catch_warnings():
            # no_dist=True is the intent; torch still warns that it is assuming it.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(target, checkpoint_id=path, no_dist=True)
        loaded[subdir] = target
    return loaded


def assert_checkpoint_matches(root: str | os.PathLike[str], ref: dict[str, Any]) -> None:
    """Load the checkpoint at ``root`` with ``dcp.load`` and compare every stored item, keyed by its
    DCP FQN, with the reference, bit-exactly."""
    loaded = load_with_dcp(root, ref)
    expected = flat_expected(ref)
    for subdir, flat in expected.items():
        got = flatten_state_dict(loaded[subdir])[0]
        assert_bitwise_equal(got, flat, "" if subdir == "." else f"[{subdir}]")


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's element bytes in logical (row-major) order, as uint8."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bitwise_equal(actual: Any, expected: Any, path: str = "") -> None:
    """Recursively compare; tensors must match in dtype, shape and every byte (NaN payloads, -0.0,
    float8 and bfloat16 included); ``io.BytesIO`` compares by content with ``bytes``."""
    where = path or "<root>"
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), (
            f"{where}: expected a tensor, got {type(actual).__name__}"
        )
        assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, (
            f"{where}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        )
        assert torch.equal(tensor_bytes(actual), tensor_bytes(expected)), (
            f"{where}: tensor bytes differ"
        )
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), f"{where}: expected a dict, got {type(actual).__name__}"
        assert set(actual) == set(expected), (
            f"{where}: keys differ: extra {sorted(set(actual) - set(expected))[:5]}, "
            f"missing {sorted(set(expected) - set(actual))[:5]}"
        )
        for k in expected:
            assert_bitwise_equal(actual[k], expected[k], f"{path}.{k}" if path else str(k))
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)), (
            f"{where}: expected a sequence, got {type(actual).__name__}"
        )
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_bitwise_equal(a, e, f"{path}.{i}")
    elif isinstance(expected, bytes) and isinstance(actual, io.BytesIO):
        assert actual.getvalue() == expected, f"{where}: BytesIO content differs"
    else:
        assert not isinstance(actual, Unloaded), f"{where}: dcp.load did not fill this value"
        assert type(actual) is type(expected), (
            f"{where}: type {type(actual).__name__} != {type(expected).__name__}"
        )
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"
