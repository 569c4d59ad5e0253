"""DCP saved without global metadata (``dcp.save(..., use_collectives=False)``), written by torch
itself on real ranks: FSDP2 model + AdamW at world sizes 2 and 3 (uneven and empty shards).

ckptools merges the ranks' ``__r.metadata`` into one manifest that agrees with what torch wrote
in each file; consolidate equals the live model gathered by torch, bit for bit; reshard writes a
DCP with one global ``.metadata`` that torch's ``dcp.load`` and a real FSDP2 job load bit-exactly;
a deleted rank is named, never read as half a model; copies of a replicated entry that differ
are refused, naming both files.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)

import ckptools
from ckptools.cli.main import cli
from ckptools.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnknownFormatError,
)
from ckptools.formats.torch_archive import read_archive, record_data_offset
from ckptools.io.storage import open_reader
from tests.conftest import Produced
from tests.support.checks import assert_reads_match_reference
from tests.support.dist import run_ranks
from tests.support.producers import DEFAULT_CONFIG, TinyLlama, _make_optimizer, flip_bit
from tests.support.reference import (
    assert_bitwise_equal,
    expected_checkpoints,
    load_reference,
    load_with_dcp,
    tensor_bytes,
)

pytestmark = pytest.mark.distributed
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _ckpt(args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(cli, args)
    return result.exit_code, result.output


def _copy(p: Produced, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(p.path, dst)
    return dst


@pytest.fixture(params=[2, 3], ids=["ws2", "ws3"])
def rank_local(request: pytest.FixtureRequest, produced: Callable[..., Produced]) -> Produced:
    # extra=True: replicated plain values and io.BytesIO written by every rank
    return produced("fsdp2_rank_local", world_size=request.param, extra=True)


def test_torch_writes_rank_local_metadata_only(rank_local: Produced) -> None:
    """The producer's files are what this layout is about: no global .metadata, one
    __r.metadata per rank; and the merged manifest lists exactly every rank's own chunks and
    byte locations as torch reads them from each rank's file."""
    names = sorted(p.name for p in rank_local.path.iterdir())
    ws = sum(1 for n in names if n.endswith(".metadata"))
    assert ".metadata" not in names
    assert names == sorted(
        [f"__{r}.metadata" for r in range(ws)] + [f"__{r}_0.distcp" for r in range(ws)]
    )
    manifest = ckptools.read_manifest(str(rank_local.path))
    assert (manifest.format, manifest.layout, manifest.world_size) == ("dcp", "dcp_rank_local", ws)
    assert manifest.markers == tuple(f"__{r}.metadata" for r in range(ws))
    theirs: dict[str, list[tuple[Any, ...]]] = {}
    first_object: dict[str, tuple[str, int, int]] = {}
    reader = dcp.FileSystemReader(str(rank_local.path))
    for r in range(ws):
        md = reader.read_metadata(rank=r)
        for index, info in md.storage_data.items():
            where = (info.relative_path, info.offset, info.length)
            if isinstance(md.state_dict_metadata[index.fqn], BytesStorageMetadata):
                first_object.setdefault(index.fqn, where)
            else:
                item = md.state_dict_metadata[index.fqn]
                chunk = item.chunks[index.index]
                box = (tuple(chunk.offsets), tuple(chunk.sizes))
                theirs.setdefault(index.fqn, []).append((*box, *where))
                t = manifest.tensors[index.fqn]
                assert (t.dtype, t.shape) == (
                    str(item.properties.dtype).removeprefix("torch."),
                    tuple(item.size),
                ), index.fqn
    ours = {
        fqn: sorted((c.offsets, c.sizes, c.file, c.offset, c.length) for c in t.chunks)
        for fqn, t in manifest.tensors.items()
    }
    assert ours == {fqn: sorted(v) for fqn, v in theirs.items()}
    # a replicated object is kept once, from the lowest rank
    assert {f: (o.file, o.offset, o.length) for f, o in manifest.objects.items()} == first_object
    assert {o.file for o in manifest.objects.values()} == {"__0_0.distcp"}
    # every tensor and object read by ckptools equals what torch gathered from the live model
    assert assert_reads_match_reference(rank_local.path, rank_local.ref_path) > 0


def test_inspect_and_verify_explain_the_layout(rank_local: Produced) -> None:
    ws = len(list(rank_local.path.glob("__*.metadata")))
    code, out = _ckpt(["inspect", str(rank_local.path), "--json"])
    assert code == 0, out
    report = json.loads(out)
    assert (report["layout"], report["world_size"]) == ("dcp_rank_local", ws)
    code, forced = _ckpt(["inspect", str(rank_local.path), "--format", "dcp_rank_local", "--json"])
    assert code == 0 and json.loads(forced)["layout"] == "dcp_rank_local", forced
    assert any("use_collectives=False" in n for n in report["notes"])
    code, out = _ckpt(["verify", str(rank_local.path), "--json"])
    assert code == 0, out
    v = json.loads(out)
    assert v["ok"] and v["layout"] == "dcp_rank_local" and v["bytes_read"] > 0
    # forcing the plain DCP layout says why it is not one, instead of "never committed"
    with pytest.raises(UnknownFormatError, match=r"__<rank>\.metadata"):
        ckptools.read_manifest(str(rank_local.path), format="dcp")


def test_consolidate_equals_the_gathered_model(rank_local: Produced, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out = tmp_path / "hf"
    ckptools.consolidate(str(rank_local.path), str(out), quiet=True, weights_only=True)
    ref = load_reference(rank_local.ref_path)
    full = load_file(out / "model.safetensors")
    assert set(full) == set(ref["model"])
    for k, expected in ref["model"].items():
        assert full[k].dtype == expected.dtype and full[k].shape == expected.shape, k
        assert torch.equal(tensor_bytes(full[k]), tensor_bytes(expected)), k


def _fsdp2_model(world_size: int) -> tuple[torch.nn.Module, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = TinyLlama(DEFAULT_CONFIG)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks():  # type: ignore[operator]
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt, _sched = _make_optimizer(model)
    return model, opt


def _resume_and_gather(rank: int, world_size: int, ckpt: str, out: str) -> None:
    """Every rank: dcp.load the resharded checkpoint into a fresh FSDP2 model + optimizer,
    set_state_dict, gather full state dicts (rank 0 saves them)."""
    model, opt = _fsdp2_model(world_size)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    full_model = get_model_state_dict(model, options=_FULL)
    full_optim = get_optimizer_state_dict(model, opt, options=_FULL)
    if rank == 0:
        torch.save({"model": full_model, "optim": full_optim}, out)


@pytest.mark.parametrize(("src_ws", "dst_ws"), [(2, 3), (3, 2), (3, 3)])
def test_reshard_writes_a_global_metadata_that_fsdp2_resumes(
    produced: Callable[..., Produced], tmp_path: Path, src_ws: int, dst_ws: int
) -> None:
    p = produced("fsdp2_rank_local", world_size=src_ws, extra=True)
    out = tmp_path / "resharded"
    code, text = _ckpt(["reshard", str(p.path), str(out), "--world-size", str(dst_ws), "-q"])
    assert code == 0, text
    assert (out / ".metadata").is_file()
    assert sorted(x.name for x in out.iterdir()) == sorted(
        [".metadata"] + [f"__{r}_0.distcp" for r in range(dst_ws)]
    )
    ref = load_reference(p.ref_path)
    # every entry, replicated ones written once, through torch's own single-process dcp.load
    assert_bitwise_equal(load_with_dcp(out, ref), expected_checkpoints(ref))
    gathered = tmp_path / "gathered.pt"
    run_ranks(_resume_and_gather, dst_ws, str(out), str(gathered), timeout=180)
    full = torch.load(gathered, weights_only=True)
    assert_bitwise_equal(full["model"], ref["model"], "model")
    assert_bitwise_equal(full["optim"], ref["optim"], "optim")
    code, text = _ckpt(["diff", str(p.path), str(out)])
    assert code == 0, text


@pytest.mark.parametrize(
    ("ws", "delete", "error", "named"),
    [
        # the last rank deleted whole: only the rows it held tell of it
        (2, ["__1.metadata", "__1_0.distcp"], IncompleteCheckpointError, "__1.metadata"),
        (2, ["__1.metadata"], IncompleteCheckpointError, "__1.metadata"),
        (2, ["__1_0.distcp"], CheckpointNotFoundError, "__1_0.distcp"),
        # a middle rank deleted whole: the names around it tell
        (3, ["__1.metadata", "__1_0.distcp"], IncompleteCheckpointError, "__1.metadata"),
    ],
)
def test_a_deleted_rank_is_named(
    produced: Callable[..., Produced],
    tmp_path: Path,
    ws: int,
    delete: list[str],
    error: type[Exception],
    named: str,
) -> None:
    src = _copy(produced("fsdp2_rank_local", world_size=ws, extra=True), tmp_path)
    for name in delete:
        (src / name).unlink()
    with pytest.raises(error, match=r"rank 1\b") as e:
        ckptools.consolidate(str(src), str(tmp_path / "hf"), quiet=True)
    assert named in str(e.value)
    assert not (tmp_path / "hf").exists()
    with pytest.raises(error, match=re.escape(named)):
        ckptools.reshard(str(src), str(tmp_path / "re"), world_size=2, quiet=True)
    report = ckptools.verify(str(src), quick=True)
    assert not report.ok
    assert any(f.file == named for f in report.findings), [f.message for f in report.findings]
    if "__1.metadata" in delete:  # the rows no rank holds, from the one tiling check
        assert any(f.kind == "tiling" for f in report.findings)


def test_a_hostile_rank_number_costs_nothing(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    """Hostile: a name that claims a trillion ranks is answered at once, by name and count."""
    src = _copy(produced("fsdp2_rank_local", world_size=2), tmp_path)
    (src / "__999999999999.metadata").write_bytes(b"")
    started = time.perf_counter()
    with pytest.raises(IncompleteCheckpointError, match=r"__2\.metadata: missing: rank 2 of "
                       r"1000000000000 .*\(999999999997 rank\(s\) missing\)"):  # fmt: skip
        ckptools.read_manifest(str(src))
    report = ckptools.verify(str(src), quick=True)
    assert not report.ok
    assert time.perf_counter() - started < 10


def test_verify_checks_every_copy_of_a_replicated_entry(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    """Each rank's copy of a replicated ``step`` is kept as a replica, so a flipped bit in
    rank 1's copy (which no conversion reads) is still found by its CRC."""
    src = _copy(produced("fsdp2_rank_local", world_size=2, extra=True), tmp_path)
    manifest = ckptools.read_manifest(str(src))
    fqn = "optim.state.model.norm.weight.step"
    copy = next(c for c in manifest.tensors[fqn].chunks if c.rank == 1)
    with open_reader(str(src)) as reader:
        archive = read_archive(reader, copy.file, copy.offset, copy.length)
        at = record_data_offset(reader, archive, archive.record("data/0"))
    flip_bit(src / copy.file, at, 3)
    report = ckptools.verify(str(src))
    assert [(f.kind, f.fqn, f.rank) for f in report.findings] == [("crc", fqn, 1)]


def _diverging_saves(rank: int, world_size: int, out_tensor: str, out_object: str) -> None:
    """Every rank saves, without collectives, entries that should be replicated but are not:
    a plain tensor, then a plain value, that differ per rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    w = distribute_tensor(torch.arange(12.0).reshape(6, 2), mesh, [Shard(0)])
    dcp.save({"w": w, "bias": torch.full((3,), float(rank))}, checkpoint_id=out_tensor,
             use_collectives=False)  # fmt: skip
    dcp.save({"w": w, "seed": 100 + rank}, checkpoint_id=out_object, use_collectives=False)


def test_replicated_copies_that_differ_are_refused(tmp_path: Path) -> None:
    a, b = tmp_path / "tensor", tmp_path / "object"
    run_ranks(_diverging_saves, 2, str(a), str(b), timeout=120)
    for path, fqn in ((a, "bias"), (b, "seed")):
        with pytest.raises(CorruptCheckpointError) as e:
            ckptools.read_manifest(str(path))
        message = str(e.value)
        assert repr(fqn) in message and "__0_0.distcp" in message and "__1_0.distcp" in message
        assert "\n" not in message
        report = ckptools.verify(str(path), quick=True)
        assert not report.ok and "__1_0.distcp" in report.findings[0].message


def test_ranks_that_disagree_on_a_shape_are_refused(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    """Hostile: rank 1's metadata gives a tensor another global shape (rewritten here)."""
    src = _copy(produced("fsdp2_rank_local", world_size=2), tmp_path)
    path = src / "__1.metadata"
    md = pickle.loads(path.read_bytes())  # the producer's own file
    fqn = "model.model.norm.weight"
    md.state_dict_metadata[fqn].size = torch.Size([11])
    path.write_bytes(pickle.dumps(md))
    with pytest.raises(CorruptCheckpointError, match=r"__0\.metadata and .*__1\.metadata") as e:
        ckptools.read_manifest(str(src))
    assert "[10] in one" in str(e.value) and "[11] in the other" in str(e.value)
