"""transformers' distributed safetensors, written by transformers itself on real gloo ranks.

A small Llama built from a config is loaded tensor-parallel (transformers' own ``tp_plan`` for
Llama: colwise/rowwise projections, vocab-sharded embedding and head, replicated norms) at world
sizes 2 and 3 (vocabulary 97 and MLP width 91: torch's uneven split at 3 ranks), and FSDP2-sharded
by transformers (``fsdp_size=2``), changed in place so its state is not the file it was loaded
from, and saved with
``save_pretrained(..., distributed_checkpoint=True)``: one ``shard-0000r-...safetensors`` per rank
holding slices placed by ``DCP_SHARDING_INFO``.

ckptools recognises the directory, consolidates it bit-exactly into the live model's gathered
state dict (config copied beside, transformers loads the result), verifies and diffs it, names a
deleted rank file, refuses a header that does not place every element, and ``ckpt shard`` makes
a DCP that an FSDP2 job loads bit-exactly at world sizes 2 and 3.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import ckptools
from ckptools.cli.main import cli
from ckptools.errors import CorruptCheckpointError, IncompleteCheckpointError
from ckptools.producers import detect, read_manifest
from tests.support.dist import run_ranks
from tests.support.reference import assert_bitwise_equal

pytestmark = pytest.mark.distributed

_SEED = 1234
_REFERENCE = "reference.pt"


def _config(world_size: int) -> Any:
    from transformers import LlamaConfig

    # at 3 ranks 97 rows split 33/33/31 and 91 split 31/31/29 (torch's Shard: ceil(n/W) each)
    uneven = world_size == 3
    return LlamaConfig(
        vocab_size=97 if uneven else 96,
        hidden_size=48,
        intermediate_size=91 if uneven else 90,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=8,
    )


def _tp_save(rank: int, world_size: int, src: str, out: str, mode: str) -> None:
    """Every rank: load ``src`` tensor-parallel (``mode`` "tp") or FSDP2-sharded ("fsdp"),
    change every parameter in place (so the state saved is the live model's, not ``src``'s),
    gather the reference on rank 0, save distributed."""
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    model = AutoModelForCausalLM.from_pretrained(
        src,
        distributed_config=DistributedConfig(**{f"{mode}_size": world_size}),
        dtype=torch.float32,
    )
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.mul_(1.0 + (i + 1) / 64).add_(0.25)
    placements = {
        k: [(type(pl).__name__, getattr(pl, "dim", None)) for pl in v.placements]
        for k, v in model.state_dict().items()
        if isinstance(v, DTensor)
    }
    full = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }
    model.save_pretrained(out, distributed_checkpoint=True)
    if rank == 0:
        torch.save(
            {"state": full, "placements": placements, "world_size": world_size, "mode": mode},
            os.path.join(out, "..", _REFERENCE),
        )


@pytest.fixture(
    scope="module", params=[("tp", 2), ("tp", 3), ("fsdp", 2)], ids=["tp2", "tp3", "fsdp2"]
)
def tp_saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``<tmp>/out``: what transformers wrote; ``<tmp>/reference.pt``: the live model gathered."""
    from transformers import LlamaForCausalLM

    mode, world_size = request.param
    base = tmp_path_factory.mktemp(f"{mode}{world_size}")
    torch.manual_seed(_SEED)
    LlamaForCausalLM(_config(world_size)).save_pretrained(base / "src")
    run_ranks(_tp_save, world_size, str(base / "src"), str(base / "out"), mode, timeout=240.0)
    return base / "out"


def _reference(out: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = torch.load(out.parent / _REFERENCE, weights_only=True)
    return loaded


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _ckpt(args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(cli, args)
    return result.exit_code, result.output


def test_transformers_writes_rank_slices(tp_saved: Path) -> None:
    """The producer's files are what this layout is for; the manifest places each rank's slices
    where its DCP_SHARDING_INFO says, at the live model's global shapes."""
    ref = _reference(tp_saved)
    world = ref["world_size"]
    names = sorted(p.name for p in tp_saved.glob("*.safetensors"))
    assert names == [f"shard-{r + 1:05d}-model-00001-of-00001.safetensors" for r in range(world)]
    placements = {p for ps in ref["placements"].values() for p in ps}
    # TP: colwise and rowwise slices, replicated norms; FSDP2: every parameter's rows
    assert placements == ({("Shard", 0), ("Shard", 1)} if ref["mode"] == "tp" else {("Shard", 0)})
    assert detect(str(tp_saved)).name == "transformers_distributed"
    m = read_manifest(str(tp_saved))
    assert m.world_size == world and m.layout == "transformers_distributed"
    assert set(m.tensors) == set(ref["state"])
    for fqn, t in m.tensors.items():
        assert t.shape == tuple(ref["state"][fqn].shape), fqn
        assert t.dtype == "float32"
        expect = world if fqn in ref["placements"] else 1  # replicated: written once
        assert len(t.chunks) == expect, fqn
    # what the header itself says, read independently of ckptools
    for rank, name in enumerate(names):
        raw = (tp_saved / name).read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        info = json.loads(json.loads(raw[8 : 8 + n])["__metadata__"]["DCP_SHARDING_INFO"])
        held = [(f, c.offsets) for f, t in m.tensors.items() for c in t.chunks if c.rank == rank]
        assert sorted(held) == sorted((f, tuple(v["saved_offsets"])) for f, v in info.items())
    if world == 3:  # the uneven split
        sizes = [c.sizes[0] for c in m.tensors["model.embed_tokens.weight"].chunks]
        assert sorted(sizes) == [31, 33, 33]


def test_consolidate_equals_live_model(tp_saved: Path, tmp_path: Path) -> None:
    """Bit-exact against the gathered live model; config beside; transformers loads it."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    code, text = _ckpt(["consolidate", str(tp_saved), str(out), "-q"])
    assert code == 0, text
    assert (out / "config.json").is_file() and (out / "generation_config.json").is_file()
    ref = _reference(tp_saved)["state"]
    assert_bitwise_equal(load_file(out / "model.safetensors"), ref)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert_bitwise_equal({k: v.detach() for k, v in model.state_dict().items()}, ref)


def test_inspect_verify_diff(tp_saved: Path, tmp_path: Path) -> None:
    code, text = _ckpt(["inspect", str(tp_saved), "--json"])
    assert code == 0, text
    info = json.loads(text)
    assert info["layout"] == "transformers_distributed"
    assert info["world_size"] == len(list(tp_saved.glob("shard-*")))
    code, text = _ckpt(["verify", str(tp_saved)])
    assert code == 0, text
    hf = tmp_path / "hf"
    ckptools.consolidate(str(tp_saved), str(hf), quiet=True)
    code, text = _ckpt(["diff", str(tp_saved), str(hf)])
    assert code == 0 and "identical" in text, text
    # a changed element is seen through the slices
    damaged = _copy(tp_saved, tmp_path)
    last = sorted(damaged.glob("shard-*"))[-1]
    raw = bytearray(last.read_bytes())
    raw[-1] ^= 0x40
    last.write_bytes(bytes(raw))
    code, text = _ckpt(["diff", str(damaged), str(hf)])
    assert code == 3, text


def test_deleted_rank_file_is_named(tp_saved: Path, tmp_path: Path) -> None:
    """Rank 1's file deleted: named by every verb, never read as a smaller model."""
    ckpt = _copy(tp_saved, tmp_path)
    gone = ckpt / "shard-00002-model-00001-of-00001.safetensors"
    gone.unlink()
    with pytest.raises(IncompleteCheckpointError) as e:
        read_manifest(str(ckpt))
    assert str(gone) in str(e.value) and e.value.rank == 1
    for args in (["consolidate", str(ckpt), str(tmp_path / "o"), "-q"], ["inspect", str(ckpt)]):
        code, text = _ckpt(args)
        assert code == 1 and gone.name in text, text
        assert not (tmp_path / "o").exists()
    code, text = _ckpt(["verify", str(ckpt)])
    assert code == 3 and gone.name in text, text


def _rewrite_sharding_info(path: Path, edit: Any) -> None:
    """Rewrite the file's DCP_SHARDING_INFO through ``edit`` (same tensors, same data)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    info = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
    edit(info)
    header["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(info)
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n :])


def test_header_that_misplaces_a_slice_is_refused(tp_saved: Path, tmp_path: Path) -> None:
    """A slice moved (a hole where it was) or a tensor without offsets: refused, saying what."""
    ckpt = _copy(tp_saved, tmp_path)
    first = ckpt / "shard-00001-model-00001-of-00001.safetensors"

    def move(info: dict[str, Any]) -> None:
        info["model.embed_tokens.weight"]["saved_offsets"] = [1, 0]  # overlaps rank 1, hole at 0

    _rewrite_sharding_info(first, move)
    with pytest.raises(CorruptCheckpointError, match=r"model\.embed_tokens\.weight") as e:
        read_manifest(str(ckpt))
    assert "do not place every element" in str(e.value)
    code, text = _ckpt(["consolidate", str(ckpt), str(tmp_path / "o"), "-q"])
    assert code == 1 and "model.embed_tokens.weight" in text, text

    def drop(info: dict[str, Any]) -> None:
        info.pop("lm_head.weight")

    again = _copy(tp_saved, tmp_path / "b")
    _rewrite_sharding_info(again / first.name, drop)
    with pytest.raises(CorruptCheckpointError, match=r"no offsets for tensor 'lm_head\.weight'"):
        read_manifest(str(again))


def _fsdp2_load(rank: int, world_size: int, dcp_dir: str, config_dir: str) -> dict[str, Any]:
    """An FSDP2 job: the model from its config, every layer sharded, ``dcp.load`` of ``model``;
    returns the gathered state dict on rank 0."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(rank + 99)  # every rank starts from other values: only the load agrees
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=dcp_dir)
    set_model_state_dict(model, state["model"])
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in full.items()} if rank == 0 else {}


@pytest.mark.parametrize("target", [2, 3])
def test_shard_loads_in_fsdp2_job(tp_saved: Path, tmp_path: Path, target: int) -> None:
    """``ckpt shard`` writes a DCP whose ``model.`` entries an FSDP2 job loads bit-exactly."""
    out = tmp_path / "dcp"
    code, text = _ckpt(["shard", str(tp_saved), str(out), "--world-size", str(target), "-q"])
    assert code == 0, text
    assert (out / ".metadata").is_file()
    (loaded, *_) = run_ranks(_fsdp2_load, target, str(out), str(tp_saved), timeout=240.0)
    assert_bitwise_equal(loaded, _reference(tp_saved)["state"])


def _fsdp2_ckptools_load(rank: int, world_size: int, src: str) -> dict[str, Any]:
    """An FSDP2 job loading transformers' rank slices straight with ``ckptools.load`` (no
    optimizer: the checkpoint holds the model only); the gathered state on rank 0, and what a
    load with an optimizer said."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(rank + 99)  # every rank starts from other values: only the load agrees
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters())
    try:
        ckptools.load(src, model, opt)
        refused = ""
    except IncompleteCheckpointError as e:
        refused = str(e)
    ckptools.load(src, model, optimizer=None)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if rank:
        return {}
    return {"state": {k: v.detach().clone() for k, v in full.items()}, "refused": refused}


@pytest.mark.parametrize("target", [2, 3])
def test_ckptools_load_reads_the_slices_into_fsdp2(tp_saved: Path, target: int) -> None:
    """``ckptools.load`` of the distributed checkpoint into an FSDP2 job at another world
    size: bit-exact; asked for an optimizer it names the file and says it holds none."""
    (got, *_) = run_ranks(_fsdp2_ckptools_load, target, str(tp_saved), timeout=240.0)
    assert_bitwise_equal(got["state"], _reference(tp_saved)["state"])
    assert str(tp_saved) in got["refused"] and "holds no optimizer state" in got["refused"]
