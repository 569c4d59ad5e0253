"""verl's per-rank FSDP checkpoints (fixtures written by verl 0.9.1's own
``FSDPCheckpointManager``, see ``fixtures/verl/generate.py``): read, consolidated bit-exactly,
verified and diffed; damaged copies refused by name."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from ckptools.cli.main import cli
from ckptools.core.manifest import OPTIMIZER_UNREADABLE
from ckptools.errors import (
    CheckpointNotFoundError,
    CkptError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    OutsideCheckpointError,
    UnsafeCheckpointError,
    UnsupportedCheckpointError,
)
from ckptools.producers import read_manifest
from tests.support.reference import assert_bitwise_equal, load_reference

VERL = Path(__file__).resolve().parents[2] / "fixtures" / "verl"
FSDP2 = ["fsdp2_ws2", "fsdp2_ws3", "fsdp2_hsdp_ws4"]
FSDP1 = ["fsdp1_ws2", "fsdp1_ws3_tied", "fsdp1_ws2_orig_params", "fsdp1_ws3_tied_orig_params"]
#: FSDP1 as verl's FSDP engine wraps it, given a device_mesh: DTensors in the model files (the
#: cases above: ShardedTensors), FlatParameter shards in the optimizer's (HYBRID_SHARD on
#: verl's 2 x 2 ("ddp", "fsdp") mesh: shards over 2 ranks, saved once per replica group)
FSDP1_MESH = ["fsdp1_mesh_ws2", "fsdp1_mesh_ws3_tied", "fsdp1_mesh_hsdp_ws4"]


def _ckpt(*args: str) -> Any:
    return CliRunner().invoke(cli, list(args))


def _copy(name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(VERL / name, dst)
    return dst


@pytest.mark.parametrize("name", FSDP2)
def test_manifest_names_every_tensor_at_its_global_shape(name: str) -> None:
    ref = load_reference(VERL / f"{name}.reference.pt")
    manifest = read_manifest(str(VERL / name))
    world = int(name[-1])
    assert (manifest.format, manifest.layout, manifest.world_size) == ("verl", "verl_fsdp2", world)
    for fqn, tensor in ref["model"].items():
        entry = manifest.tensors[fqn]
        assert (entry.dtype, entry.shape) == ("float32", tuple(tensor.shape)), fqn
        # one chunk per rank that holds rows; their rows tile dim 0
        rows = sorted((c.offsets[0], c.sizes[0]) for c in entry.chunks)
        assert sum(n for _, n in rows) == tensor.shape[0], fqn
    assert "huggingface/config.json" in manifest.aux_files


def test_uneven_split_offsets_are_torchs() -> None:
    """127 rows over 3 ranks: torch.chunk gives 43, 43, 41 (not 42, 42, 43)."""
    entry = read_manifest(str(VERL / "fsdp2_ws3")).tensors["model.embed_tokens.weight"]
    assert sorted((c.offsets, c.sizes, c.rank) for c in entry.chunks) == [
        ((0, 0), (43, 32), 0),
        ((43, 0), (43, 32), 1),
        ((86, 0), (41, 32), 2),
    ]


@pytest.mark.parametrize("name", [*FSDP2, *FSDP1, *FSDP1_MESH])
def test_consolidate_is_bit_exact(name: str, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    # the config comes from verl's huggingface/ without --config
    result = _ckpt("consolidate", str(VERL / name), str(out), "-q")
    assert result.exit_code == 0, result.output
    got: dict[str, torch.Tensor] = {}
    for f in out.glob("*.safetensors"):
        got.update(load_file(str(f)))
    ref = load_reference(VERL / f"{name}.reference.pt")["model"]
    config = json.loads((out / "config.json").read_text())
    if config["tie_word_embeddings"]:
        # save_pretrained's own format: the tied head is not written; from_pretrained ties it
        assert torch.equal(ref.pop("lm_head.weight"), ref["model.embed_tokens.weight"])
    assert_bitwise_equal(got, ref)
    assert config["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.parametrize("name", [*FSDP2, *FSDP1, *FSDP1_MESH])
def test_verify_and_diff(name: str) -> None:
    result = _ckpt("verify", str(VERL / name))
    assert result.exit_code == 0, result.output
    same = _ckpt("diff", str(VERL / name), str(VERL / name))
    assert same.exit_code == 0, same.output
    other = "fsdp2_ws3" if name != "fsdp2_ws3" else "fsdp2_ws2"
    assert _ckpt("diff", str(VERL / name), str(VERL / other)).exit_code == 3  # other batches


def test_a_missing_rank_file_is_named(tmp_path: Path) -> None:
    ckpt = _copy("fsdp2_ws3", tmp_path)
    (ckpt / "model_world_size_3_rank_1.pt").unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"model_world_size_3_rank_1\.pt: rank 1"):
        read_manifest(str(ckpt))
    result = _ckpt("consolidate", str(ckpt), str(tmp_path / "out"))
    assert result.exit_code == 1 and "model_world_size_3_rank_1.pt" in result.output
    assert "Traceback" not in result.output


def test_a_missing_optimizer_file_is_named(tmp_path: Path) -> None:
    ckpt = _copy("fsdp2_ws2", tmp_path)
    (ckpt / "optim_world_size_2_rank_0.pt").unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"optim_world_size_2_rank_0\.pt"):
        read_manifest(str(ckpt))


def test_world_size_disagreeing_with_the_config_is_refused(tmp_path: Path) -> None:
    ckpt = _copy("fsdp2_ws2", tmp_path)
    (ckpt / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 3}))
    with pytest.raises(CorruptCheckpointError, match="world size 2 rank 0, but fsdp_config"):
        read_manifest(str(ckpt))


def test_a_rank_file_copied_over_another_is_named(tmp_path: Path) -> None:
    ckpt = _copy("fsdp2_ws3", tmp_path)
    shutil.copy(ckpt / "model_world_size_3_rank_0.pt", ckpt / "model_world_size_3_rank_1.pt")
    result = _ckpt("consolidate", str(ckpt), str(tmp_path / "out"))
    assert result.exit_code == 1, result.output
    assert "model_world_size_3_rank_1.pt: 'model.embed_tokens.weight': saved by rank 0" in (
        result.output
    )


def test_a_huge_world_size_is_named_not_walked(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 10**15}))
    shutil.copy(VERL / "fsdp2_ws2" / "model_world_size_2_rank_0.pt",
                ckpt / f"model_world_size_{10**15}_rank_0.pt")  # fmt: skip
    with pytest.raises(CheckpointNotFoundError, match=r"rank 1's model file is missing"):
        read_manifest(str(ckpt))


def test_fsdp1_model_reads_from_its_sharded_tensors() -> None:
    manifest = read_manifest(str(VERL / "fsdp1_ws2"))
    assert (manifest.layout, manifest.world_size) == ("verl_fsdp1", 2)
    entry = manifest.tensors["model.embed_tokens.weight"]
    assert sorted((c.offsets, c.sizes, c.rank) for c in entry.chunks) == [
        ((0, 0), (64, 32), 0),
        ((64, 0), (63, 32), 1),
    ]


def test_fsdp1_given_a_mesh_reads_from_its_dtensors() -> None:
    """Issue 25, item 5: FSDP1 given verl's device_mesh saves DTensors, not ShardedTensors; the
    optimizer's FlatParameter shards were refused as "over 0 parameters / 0 elements"."""
    manifest = read_manifest(str(VERL / "fsdp1_mesh_ws3_tied"))
    assert (manifest.layout, manifest.world_size) == ("verl_fsdp1", 3)
    assert OPTIMIZER_UNREADABLE not in manifest.details, manifest.notes
    assert not [n for n in manifest.notes if "optimizer not read" in n]
    entry = manifest.tensors["model.embed_tokens.weight"]
    assert sorted((c.offsets, c.sizes, c.rank) for c in entry.chunks) == [
        ((0, 0), (43, 32), 0),
        ((43, 0), (43, 32), 1),
        ((86, 0), (41, 32), 2),
    ]
    # the same FlatParameter cut as without a mesh (see the test below)
    moment = manifest.tensors["optimizer.state.model.layers.0.self_attn.o_proj.weight.exp_avg"]
    assert sorted((c.offsets, c.sizes, c.rank) for c in moment.chunks) == [
        ((0, 0), (16, 32), 0),
        ((16, 0), (1, 22), 0),
        ((16, 22), (1, 10), 1),
        ((17, 0), (15, 32), 1),
    ]
    data = json.loads(_ckpt("inspect", str(VERL / "fsdp1_mesh_ws3_tied"), "--json").output)
    assert data["mesh"]["shape"] == [3]
    assert data["mesh"]["placements"] == {"(Shard(0))": len(manifest.details["placements"])}


def test_fsdp1_hybrid_shard_moments_come_from_the_first_replica_group() -> None:
    """HYBRID_SHARD at 4 ranks: each FlatParameter is cut in 2 (the replica group), not 4."""
    manifest = read_manifest(str(VERL / "fsdp1_mesh_hsdp_ws4"))
    assert (manifest.layout, manifest.world_size) == ("verl_fsdp1", 4)
    assert OPTIMIZER_UNREADABLE not in manifest.details, manifest.notes
    moment = manifest.tensors["optimizer.state.model.embed_tokens.weight.exp_avg"]
    assert sorted((c.offsets, c.sizes, c.rank) for c in moment.chunks) == [
        ((0, 0), (127, 32), 0)
    ]  # the root's FlatParameter (embedding, norm, head: 8160) is 4080 per rank: rank 0's
    assert {c.rank for c in manifest.tensors["model.embed_tokens.weight"].chunks} == {0, 1}


def test_fsdp1_flat_moments_are_placed_where_fsdp_cut_them() -> None:
    """Layer 0's FlatParameter at 3 ranks: 7744 elements padded to 3 x 2582; o_proj (32 x 32)
    is elements 2048..3072 of it, so rank 0's shard ends 534 elements into it, mid-row 16."""
    manifest = read_manifest(str(VERL / "fsdp1_ws3_tied"))
    entry = manifest.tensors["optimizer.state.model.layers.0.self_attn.o_proj.weight.exp_avg"]
    assert sorted((c.offsets, c.sizes, c.rank) for c in entry.chunks) == [
        ((0, 0), (16, 32), 0),
        ((16, 0), (1, 22), 0),
        ((16, 22), (1, 10), 1),
        ((17, 0), (15, 32), 1),
    ]
    # the tied head is flattened once, under the embedding's name, as FSDP keys its state
    assert "optimizer.state.lm_head.weight.exp_avg" not in manifest.tensors
    assert "optimizer.state.model.embed_tokens.weight.exp_avg" in manifest.tensors


@pytest.mark.parametrize("name", FSDP1)
def test_one_ranks_optimizer_file_is_named_by_inspect(name: str) -> None:
    # issue 25, item 17: the file a user opens first, alone; reshard explained it, inspect did not
    world_size = name.split("_ws")[1][0]
    file = VERL / name / f"optim_world_size_{world_size}_rank_0.pt"
    # without --format the file is refused, naming its directory (tests/integration/test_one_file)
    assert _ckpt("inspect", str(file)).exit_code == 2
    result = _ckpt("inspect", str(file), "--json", "--format", "torch_save")
    assert result.exit_code == 0, result.output
    notes = json.loads(result.output)["notes"]
    [note] = [n for n in notes if "FSDP1 flat-parameter shard" in n]
    state = torch.load(file, weights_only=True)["state"]
    per_state = sum(s["exp_avg"].numel() for s in state.values())
    assert f"holds {len(state)} flat entries / {per_state:,} elements per state" in note
    assert "no model beside it" in note and "actor/" in note
    text = _ckpt("inspect", str(file), "--format", "torch_save").output
    assert "  note: the optimizer state at the top level holds" in text
    # the directory that holds every rank's files reads it: nothing to say there
    whole = json.loads(_ckpt("inspect", str(VERL / name), "--json").output)
    assert not [n for n in whole["notes"] if "FSDP1" in n]


@pytest.mark.parametrize("name", [*FSDP1, *FSDP1_MESH])
def test_fsdp1_optimizer_reshards_bit_exactly(name: str, tmp_path: Path) -> None:
    """Every AdamW moment and step equals what torch's FSDP.optim_state_dict gathered from the
    live job (read back with torch's own DCP reader; the FSDP2 resume is tests/distributed)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    out = tmp_path / "dcp"
    result = _ckpt("reshard", str(VERL / name), str(out), "--world-size", "3", "-q")
    assert result.exit_code == 0, result.output
    with pytest.warns(UserWarning):  # torch: no process group, loading in one process
        got = _load_state_dict_from_keys(storage_reader=FileSystemReader(str(out)))
    ref = load_reference(VERL / f"{name}.reference.pt")
    assert got["optim"]["state"].keys() == ref["optim"]["state"].keys()
    assert_bitwise_equal(got["optim"]["state"], ref["optim"]["state"])
    assert_bitwise_equal(got["model"], ref["model"])


def test_fsdp1_slices_that_do_not_add_up_are_refused_and_the_model_still_reads(
    tmp_path: Path,
) -> None:
    """use_orig_params=True: a rank's optimizer file copied over another's (the same world
    size and names) gives slices that do not add up to the parameters: reshard refuses the
    optimizer by name, consolidate still writes the model."""
    ckpt = _copy("fsdp1_ws2_orig_params", tmp_path)
    shutil.copy(ckpt / "optim_world_size_2_rank_0.pt", ckpt / "optim_world_size_2_rank_1.pt")
    result = _ckpt("reshard", str(ckpt), str(tmp_path / "o"), "--world-size", "2")
    assert result.exit_code == 1, result.output
    assert "slices of" in result.output and "--drop-optimizer" in result.output
    assert not (tmp_path / "o").exists()
    assert _ckpt("consolidate", str(ckpt), str(tmp_path / "hf"), "-q").exit_code == 0


def test_only_the_sharded_tensor_getattr_is_admitted(tmp_path: Path) -> None:
    ckpt = _copy("fsdp1_ws2", tmp_path)
    # same length: the BINUNICODE length prefix stays right
    _rewrite_pickle(
        ckpt / "model_world_size_2_rank_0.pt", b"ProcessGroupState", b"__init_subclass__"
    )
    with pytest.raises(UnsafeCheckpointError, match="refusing getattr"):
        read_manifest(str(ckpt))


def _rewrite_pickle(path: Path, old: bytes, new: bytes) -> None:
    with zipfile.ZipFile(path) as z:
        items = [(i, z.read(i.filename)) for i in z.infolist()]
    path.unlink()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for info, data in items:
            if info.filename.endswith("data.pkl"):
                assert old in data
                data = data.replace(old, new)
            z.writestr(info, data)


def test_a_global_outside_the_allowlist_is_refused(tmp_path: Path) -> None:
    ckpt = _copy("fsdp2_ws2", tmp_path)
    _rewrite_pickle(ckpt / "model_world_size_2_rank_1.pt", b"torch.distributed.tensor\nDTensor\n",
                    b"os\nsystem\n")  # fmt: skip
    with pytest.raises(UnsafeCheckpointError, match=r"'os\.system'"):
        read_manifest(str(ckpt))


def test_a_partial_placement_is_refused_by_name(tmp_path: Path) -> None:
    ckpt = _copy("fsdp2_ws2", tmp_path)
    _rewrite_pickle(
        ckpt / "model_world_size_2_rank_0.pt",
        b"placement_types\nShard\n",
        b"placement_types\nPartial\n",
    )
    with pytest.raises(UnsupportedCheckpointError, match="placed Partial"):
        read_manifest(str(ckpt))


def test_huggingface_dir_linked_outside_is_refused(tmp_path: Path) -> None:
    ckpt = _copy("fsdp2_ws2", tmp_path)
    elsewhere = tmp_path / "elsewhere"
    shutil.move(str(ckpt / "huggingface"), elsewhere)
    (ckpt / "huggingface").symlink_to(elsewhere, target_is_directory=True)
    result = _ckpt("consolidate", str(ckpt), str(tmp_path / "hf"), "-q")
    assert result.exit_code != 0
    assert "huggingface" in result.output and "outside" in result.output, result.output
    assert not (tmp_path / "hf").exists()


def test_inspect_names_the_mesh_and_what_each_rank_holds() -> None:
    src = str(VERL / "fsdp2_hsdp_ws4")
    data = json.loads(_ckpt("inspect", src, "--json").output)
    assert data["mesh"] == {"shape": [2, 2], "placements": {"(Replicate, Shard(0))": 63}}
    assert set(data["totals"]["chunks_per_rank"]) == {"0", "1"}  # 2 and 3 are replicas
    text = _ckpt("inspect", src).output
    assert "mesh: 2 x 2; placements: (Replicate, Shard(0)) 63 tensors" in text
    assert "by rank: 0: 139.0 KiB (84 chunks)" in text
    assert "ranks 2, 3: no tensor bytes read" in text


def test_consolidate_leaves_the_optimizer_files_unread(tmp_path: Path) -> None:
    """Exporting the model, consolidate parses no optimizer pickle (one per rank: at hundreds
    of ranks, most of the metadata), even a damaged one, and says so; --select optimizer
    still reads them."""
    ckpt = _copy("fsdp2_ws3", tmp_path)
    for rank in range(3):
        (ckpt / f"optim_world_size_3_rank_{rank}.pt").write_bytes(b"not a pickle")
    result = _ckpt("consolidate", str(ckpt), str(tmp_path / "hf"), "--json", "-q")
    assert result.exit_code == 0, result.output
    assert any("3 optimizer file(s) not read" in n for n in json.loads(result.output)["notes"])
    again = _ckpt("consolidate", str(ckpt), str(tmp_path / "opt"), "--select", "optimizer")
    assert again.exit_code == 1 and "optim_world_size_3_rank_0.pt" in again.output


def _run_dir(tmp_path: Path, latest: int | None) -> Path:
    """A verl trainer's ``default_local_dir``: ``global_step_1/actor`` (world size 3),
    ``global_step_2/{actor,critic}`` (FSDP2 policy, FSDP1 value model), ``global_step_3/actor``
    cut off before rank 0 wrote fsdp_config.json, and ``latest_checkpointed_iteration.txt``."""
    run = tmp_path / "run"
    for step, role, name in [(1, "actor", "fsdp2_ws3"), (2, "actor", "fsdp2_ws2"),
                             (2, "critic", "fsdp1_ws2"), (3, "actor", "fsdp2_ws2")]:  # fmt: skip
        shutil.copytree(VERL / name, run / f"global_step_{step}" / role)
    (run / "global_step_3" / "actor" / "fsdp_config.json").unlink()
    (run / "global_step_3" / "actor" / "huggingface").rename(run / "global_step_3" / "hf")
    if latest is not None:
        (run / "latest_checkpointed_iteration.txt").write_text(str(latest))
    return run


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


@pytest.mark.parametrize(
    ("latest", "expected"),
    [(2, "fsdp2_ws2"), (1, "fsdp2_ws3"), (None, "fsdp2_ws2"), (3, "fsdp2_ws2")],
)
def test_a_run_directory_reads_as_its_last_saved_actor(
    tmp_path: Path, latest: int | None, expected: str
) -> None:
    """verl's trainer layout: the step latest_checkpointed_iteration.txt records (else the
    newest complete; never the cut-off global_step_3), its actor/ (the critic/ beside it named),
    consolidated exactly as that actor/ directory is, its huggingface/ config included."""
    run = _run_dir(tmp_path, latest)
    result = _ckpt("consolidate", str(run), str(tmp_path / "hf"), "--json", "-q")
    assert result.exit_code == 0, result.output
    direct = _ckpt("consolidate", str(VERL / expected), str(tmp_path / "direct"), "-q")
    assert direct.exit_code == 0, direct.output
    assert _files(tmp_path / "hf") == _files(tmp_path / "direct")
    assert "config.json" in _files(tmp_path / "hf")
    notes = json.loads(result.output)["notes"]
    step = "global_step_1" if expected == "fsdp2_ws3" else "global_step_2"
    why = "the last save latest_checkpointed_iteration.txt records" if latest in (1, 2) else (
        "the newest complete")  # fmt: skip
    [note] = [n for n in notes if f"using {step}, {why}" in n]
    assert "global_step_3" in note.partition("ignored: ")[2], note
    assert any("reading actor/ (critic/ beside it" in n for n in notes) == (step != "global_step_1")


def test_a_global_step_directory_reads_as_its_actor(tmp_path: Path) -> None:
    run = _run_dir(tmp_path, None)
    manifest = read_manifest(str(run / "global_step_2"))
    assert (manifest.layout, manifest.world_size) == ("verl_fsdp2", 2)
    assert manifest.root == str(run / "global_step_2" / "actor")
    critic = read_manifest(str(run / "global_step_2" / "critic"))
    assert critic.layout == "verl_fsdp1"
    verify = _ckpt("verify", str(run / "global_step_2"), "-q")
    assert verify.exit_code == 0, verify.output


def test_a_run_with_no_complete_step_is_refused_naming_them(tmp_path: Path) -> None:
    run = _run_dir(tmp_path, 3)
    shutil.rmtree(run / "global_step_1")
    shutil.rmtree(run / "global_step_2")
    with pytest.raises(IncompleteCheckpointError, match=r"none of global_step_3 is complete"):
        read_manifest(str(run))


def test_an_actor_linked_outside_the_run_is_not_followed(tmp_path: Path) -> None:
    run = _run_dir(tmp_path, 2)
    outside = tmp_path / "outside"
    shutil.move(str(run / "global_step_2" / "actor"), outside)
    (run / "global_step_2" / "actor").symlink_to(outside, target_is_directory=True)
    # the critic is the only role inside global_step_2: read, never the linked actor
    manifest = read_manifest(str(run / "global_step_2"))
    assert manifest.layout == "verl_fsdp1"
    assert manifest.root == str(run / "global_step_2" / "critic")
    shutil.rmtree(run / "global_step_2" / "critic")
    with pytest.raises(CkptError):
        read_manifest(str(run / "global_step_2"))


def test_a_step_linked_outside_the_run_is_not_followed(tmp_path: Path) -> None:
    """A newer global_step_N that is a link out of the run directory is never looked into:
    the newest step inside is read, the link named; a run of links only is refused."""
    run = _run_dir(tmp_path, None)
    shutil.copytree(VERL / "fsdp2_ws3", tmp_path / "elsewhere" / "actor")
    (run / "global_step_9").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    manifest = read_manifest(str(run))
    assert manifest.root == str(run / "global_step_2" / "actor")
    assert any("links leading elsewhere, not followed: global_step_9" in n for n in manifest.notes)
    for step in (1, 2, 3):
        shutil.rmtree(run / f"global_step_{step}")
    with pytest.raises(OutsideCheckpointError, match="global_step_9"):
        read_manifest(str(run))


@pytest.mark.parametrize(("latest", "picked"), [(1, "global_step_1"), (None, "global_step_2")])
def test_list_shows_the_run_directorys_saves(
    tmp_path: Path, latest: int | None, picked: str
) -> None:
    """``ckpt list`` on verl's run directory: every global_step_N, the cut-off one incomplete,
    latest the one latest_checkpointed_iteration.txt records (else the newest complete)."""
    run = _run_dir(tmp_path, latest)
    result = _ckpt("list", str(run), "--json")
    assert result.exit_code == 0, result.output
    listed = [
        (c["name"], c["step"], c["producer"], c["complete"], c["latest"])
        for c in json.loads(result.output)["checkpoints"]
    ]
    assert listed == [
        ("global_step_1", 1, "verl", True, picked == "global_step_1"),
        ("global_step_2", 2, "verl", True, picked == "global_step_2"),
        ("global_step_3", 3, "verl", False, False),
    ]


@pytest.mark.parametrize("lost", ["actor/model_world_size_2_rank_1.pt",
                                  "critic/optim_world_size_2_rank_0.pt"])  # fmt: skip
def test_a_step_missing_a_rank_file_is_incomplete_and_reading_takes_the_older(
    tmp_path: Path, lost: str
) -> None:
    """A save cut off before every rank wrote its file (the recorded global_step_2 here) is
    not whole: ``ckpt list`` says so and reading the run takes the newest whole save, as for
    DeepSpeed's and the Trainer's runs, instead of calling it complete and then refusing."""
    run = _run_dir(tmp_path, 2)
    (run / "global_step_2" / lost).unlink()
    listed = {
        c["name"]: c for c in json.loads(_ckpt("list", str(run), "--json").output)["checkpoints"]
    }
    assert listed["global_step_2"]["complete"] is False
    assert lost.rpartition("/")[2] in listed["global_step_2"]["reason"]
    assert listed["global_step_1"]["latest"] is True
    result = _ckpt("consolidate", str(run), str(tmp_path / "hf"), "--json", "-q")
    assert result.exit_code == 0, result.output
    notes = json.loads(result.output)["notes"]
    assert any("using global_step_1" in n and "global_step_2" in n for n in notes), notes
    direct = _ckpt("consolidate", str(VERL / "fsdp2_ws3"), str(tmp_path / "direct"), "-q")
    assert direct.exit_code == 0, direct.output
    assert _files(tmp_path / "hf") == _files(tmp_path / "direct")
