"""``ckpt consolidate`` against independent truths: the full state dict each torch producer
gathered itself, ``safetensors`` reading the output, and ``transformers`` loading it and giving the
same logits.
"""

from __future__ import annotations

import errno
import glob
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

import ckptools
from ckptools.cli.main import cli
from ckptools.engine import chunk_copier
from ckptools.errors import CkptError, UnsafeCheckpointError, UsageError
from tests.conftest import Produced
from tests.support.reference import tensor_bytes


def _flatten(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for k, v in items:
        key = f"{prefix}{k}"
        if isinstance(v, torch.Tensor):
            out[key] = v
        elif isinstance(v, (dict, list, tuple)):
            out.update(_flatten(v, key + "."))
    return out


def _read_dir(out: str) -> dict[str, torch.Tensor]:
    index = os.path.join(out, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    got: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(os.path.join(out, name), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            for k in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
                assert k not in got, f"{k} written twice"
                got[k] = f.get_tensor(k)
    return got


def _assert_bit_exact(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    for k, e in expected.items():
        a = got[k]
        assert a.dtype == e.dtype, f"{k}: {a.dtype} != {e.dtype}"
        assert a.shape == e.shape, f"{k}: {tuple(a.shape)} != {tuple(e.shape)}"
        assert torch.equal(tensor_bytes(a), tensor_bytes(e)), f"{k}: bytes differ"


def _no_leftovers(out: str) -> None:
    assert not os.path.exists(out)
    assert glob.glob(out + ".tmp-*") == []


# --------------------------------------------------------------------------------------------------
# Bit-exact against the producers' own gathered state dicts
# --------------------------------------------------------------------------------------------------


def test_single_process_every_dtype_and_shape_kind(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    p = produced("single")
    out = str(tmp_path / "hf")
    result = ckptools.consolidate(str(p.path), out, quiet=True, weights_only=True)
    expected = _flatten(p.reference()["model"])
    got = _read_dir(out)
    _assert_bit_exact(got, expected)
    # the kinds that are easy to get wrong are really there
    for k in ("dtypes.bfloat16", "dtypes.float8_e4m3fn", "dtypes.bool", "transposed", "strided"):
        assert k in got
    assert got["scalar_f32"].shape == () and got["empty_0x3"].shape == (0, 3)
    assert result.to_dict()["skipped_objects"] > 0


@pytest.mark.parametrize(("workers", "budget"), [(1, 64), (3, 4096)])
def test_tiny_blocks_and_threads_stay_bit_exact(
    produced: Callable[..., Produced],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    workers: int,
    budget: int,
) -> None:
    # Without kernel copies (another filesystem) every chunk goes through the block buffers; a
    # budget of a few bytes splits every run across blocks and reuses the buffers.
    def refuse(*args: Any) -> int:
        raise OSError(errno.EXDEV, "cross-device (simulated)")

    monkeypatch.setattr(os, "copy_file_range", refuse)
    p = produced("fsdp2", world_size=3, optimizer=False)
    out = str(tmp_path / "hf")
    ckptools.consolidate(
        str(p.path), out, quiet=True, workers=workers, memory_budget=budget, weights_only=True
    )
    _assert_bit_exact(_read_dir(out), p.reference()["model"])


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp2_uneven_and_empty_shards(
    produced: Callable[..., Produced], tmp_path: Path, world_size: int
) -> None:
    p = produced("fsdp2", world_size=world_size)
    out = str(tmp_path / "hf")
    ckptools.consolidate(str(p.path), out, quiet=True, weights_only=True)
    ref = p.reference()
    got = _read_dir(out)
    _assert_bit_exact(got, ref["model"])
    # the model's own FQNs: no "model." container prefix doubled, no optimizer state
    assert not any(k.startswith(("model.model.", "optim")) for k in got)


@pytest.mark.distributed
def test_fsdp2_nested_app_and_optimizer_select(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    p = produced("fsdp2", world_size=2, nested_app=True)
    ref = p.reference()
    out = str(tmp_path / "hf")
    ckptools.consolidate(str(p.path), out, quiet=True, weights_only=True)
    _assert_bit_exact(_read_dir(out), ref["model"])
    opt_out = str(tmp_path / "optim")
    ckptools.consolidate(str(p.path), opt_out, select="app.optim", quiet=True, weights_only=True)
    _assert_bit_exact(_read_dir(opt_out), _flatten(ref["optim"]))


@pytest.mark.distributed
@pytest.mark.parametrize("budget", [None, 512])
def test_tp_fsdp_dim1_sharded(
    produced: Callable[..., Produced], tmp_path: Path, budget: int | None
) -> None:
    """Chunks sharded on dim 1 are assembled into whole rows, a block of rows at a time (512
    bytes of buffers: blocks of one or two rows, so every chunk is read in several parts and
    its CRC-32 combined from them)."""
    p = produced("tp_fsdp", optimizer=False)
    manifest = ckptools.read_manifest(str(p.path))
    assert any(
        any(o != 0 for o in c.offsets[1:]) for t in manifest.tensors.values() for c in t.chunks
    ), "expected chunks sharded on dim 1 (RowwiseParallel)"
    out = str(tmp_path / "hf")
    ckptools.consolidate(
        str(p.path), out, quiet=True, workers=2, memory_budget=budget, weights_only=True
    )
    _assert_bit_exact(_read_dir(out), p.reference()["model"])


def test_torch_save_file(produced: Callable[..., Produced], tmp_path: Path) -> None:
    p = produced("torch_save")
    out = str(tmp_path / "hf")
    ckptools.consolidate(str(p.path), out, quiet=True, weights_only=True)
    _assert_bit_exact(_read_dir(out), p.reference()["model"])


def test_dtype_cast_floating_only(produced: Callable[..., Produced], tmp_path: Path) -> None:
    p = produced("single")
    out = str(tmp_path / "hf")
    result = ckptools.consolidate(str(p.path), out, dtype="bfloat16", quiet=True, weights_only=True)
    expected = {
        k: v.to(torch.bfloat16) if v.is_floating_point() else v
        for k, v in _flatten(p.reference()["model"]).items()
    }
    _assert_bit_exact(_read_dir(out), expected)
    assert result.cast_tensors > 0 and any("cast" in n for n in result.notes)


# --------------------------------------------------------------------------------------------------
# transformers loads the output
# --------------------------------------------------------------------------------------------------


def _llama_checkpoint(root: Path, *, tied: bool, hidden: int = 32) -> tuple[str, Any]:
    import torch.distributed.checkpoint as dcp
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=101,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(config).eval()
    ckpt = root / "run" / "step-10"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt), no_dist=True)
    config.save_pretrained(str(root / "run"))  # config.json in the checkpoint's parent
    return str(ckpt), model


@pytest.mark.parametrize("tied", [False, True])
def test_llama_loads_with_transformers_and_gives_identical_logits(
    tmp_path: Path, tied: bool
) -> None:
    from transformers import AutoModelForCausalLM

    ckpt, model = _llama_checkpoint(tmp_path, tied=tied)
    out = str(tmp_path / "hf")
    result = ckptools.consolidate(ckpt, out, quiet=True)
    assert "config.json" in result.config_files
    names = set(_read_dir(out))
    if tied:
        assert "lm_head.weight" not in names
        assert result.dropped == (("lm_head.weight", "model.embed_tokens.weight"),)
    else:
        assert "lm_head.weight" in names and result.dropped == ()
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.tensor([[1, 5, 9, 100, 3, 42]])
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)
    for k, v in model.state_dict().items():
        assert torch.equal(tensor_bytes(loaded.state_dict()[k]), tensor_bytes(v)), k


def test_tied_without_config_keeps_both_and_reports_the_pair(tmp_path: Path) -> None:
    ckpt, _ = _llama_checkpoint(tmp_path, tied=True)
    os.remove(tmp_path / "run" / "config.json")
    out = str(tmp_path / "hf")
    result = ckptools.consolidate(ckpt, out, quiet=True, weights_only=True)
    got = _read_dir(out)
    assert torch.equal(got["lm_head.weight"], got["model.embed_tokens.weight"])
    assert result.tied == (("lm_head.weight", "model.embed_tokens.weight"),)
    assert result.config_files == ()


def test_sharded_output_index_and_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    ckpt, model = _llama_checkpoint(tmp_path, tied=False, hidden=128)
    out = str(tmp_path / "hf")
    ckptools.consolidate(ckpt, out, max_shard_size="300KB", quiet=True)
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    sd = model.state_dict()
    assert set(index["weight_map"]) == set(sd)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sd.values())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and files == sorted(
        n for n in os.listdir(out) if n.endswith(".safetensors")
    )
    for name in files:
        with safe_open(os.path.join(out, name), "pt") as fh:
            keys = list(fh.keys())
            assert all(index["weight_map"][k] == name for k in keys)
            size = sum(fh.get_tensor(k).numel() * fh.get_tensor(k).element_size() for k in keys)
            assert size <= 300_000 or len(keys) == 1
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)


# --------------------------------------------------------------------------------------------------
# Atomicity, refusal, dry run, CLI
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("exc", [OSError("disk full (simulated)"), KeyboardInterrupt()])
@pytest.mark.parametrize("workers", [1, 2])
def test_interrupted_run_leaves_nothing(
    produced: Callable[..., Produced],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    exc: BaseException,
    workers: int,
) -> None:
    p = produced("single")
    original = chunk_copier.ChunkCopier.copy_chunk
    calls = {"n": 0}

    def failing(self: Any, *args: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 5:
            raise exc
        original(self, *args)

    monkeypatch.setattr(chunk_copier.ChunkCopier, "copy_chunk", failing)
    out = str(tmp_path / "hf")
    with pytest.raises(type(exc)):
        ckptools.consolidate(str(p.path), out, quiet=True, workers=workers, weights_only=True)
    _no_leftovers(out)
    assert os.listdir(tmp_path) == []


def test_existing_out_refused_then_overwritten(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    p = produced("single")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(UsageError, match="already exists"):
        ckptools.consolidate(str(p.path), str(out), quiet=True, weights_only=True)
    # --overwrite replaces an earlier output, never a directory holding the user's files
    with pytest.raises(UsageError, match=r"would delete keep\.txt, which ckptools did not write"):
        ckptools.consolidate(str(p.path), str(out), quiet=True, overwrite=True, weights_only=True)
    assert (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    ckptools.consolidate(
        str(p.path), str(out), quiet=True, overwrite=True, weights_only=True
    )  # empty: replaced
    ckptools.consolidate(
        str(p.path), str(out), quiet=True, overwrite=True, weights_only=True
    )  # its own output
    assert sorted(os.listdir(out)) == ["model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_dry_run_writes_nothing(produced: Callable[..., Produced], tmp_path: Path) -> None:
    p = produced("single")
    out = str(tmp_path / "hf")
    result = ckptools.consolidate(str(p.path), out, dry_run=True, max_shard_size="1KB")
    d = result.to_dict()
    assert d["dry_run"] and d["bytes_written"] == 0 and len(d["files"]) >= 2
    assert sum(len(f["tensors"]) for f in d["plan"]) == d["tensors"]
    assert os.listdir(tmp_path) == []


def test_damaged_checkpoint_fails_cleanly(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    import shutil

    p = produced("fsdp2", world_size=2, optimizer=False)
    src = tmp_path / "ckpt"
    shutil.copytree(p.path, src)
    rank_file = sorted(src.glob("__1_*.distcp"))[0]
    with open(rank_file, "r+b") as f:
        f.truncate(os.path.getsize(rank_file) // 2)
    out = str(tmp_path / "hf")
    with pytest.raises(CkptError):
        ckptools.consolidate(str(src), out, quiet=True)
    _no_leftovers(out)


def test_cli_json_and_text(produced: Callable[..., Produced], tmp_path: Path) -> None:
    p = produced("single")
    out = str(tmp_path / "hf")
    runner = CliRunner()
    r = runner.invoke(
        cli,
        ["consolidate", str(p.path), out, "--json", "--max-shard-size", "1KB", "--weights-only"],
    )
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["out"] == out and data["index"] == "model.safetensors.index.json"
    assert data["bytes_written"] == sum(
        os.path.getsize(os.path.join(out, f["name"])) for f in data["files"]
    )
    r = runner.invoke(cli, ["consolidate", str(p.path), out, "--weights-only"])
    assert r.exit_code == 2 and "already exists" in r.output
    r = runner.invoke(
        cli, ["consolidate", str(p.path), str(tmp_path / "x"), "--dry-run", "--weights-only"]
    )
    assert r.exit_code == 0 and "would write: model.safetensors" in r.output
    assert not os.path.exists(tmp_path / "x")
    r = runner.invoke(
        cli,
        [
            "consolidate",
            str(p.path),
            str(tmp_path / "y"),
            "--max-shard-size",
            "5XB",
            "--weights-only",
        ],
    )
    assert r.exit_code == 2 and "not a size" in r.output


@pytest.mark.distributed
@pytest.mark.parametrize(
    "name", ["fsdp1", "hsdp", "accelerate", "trainer", "lightning", "torchtitan", "hf_sharded"]
)
def test_every_layout_consolidates_bit_exactly(
    produced: Callable[..., Produced], tmp_path: Path, name: str
) -> None:
    p = produced(name)
    out = str(tmp_path / "hf")
    ckptools.consolidate(str(p.path), out, quiet=True, weights_only=True)
    _assert_bit_exact(_read_dir(out), p.reference()["model"])


@pytest.mark.parametrize("how", ["exec", "os.system"])
def test_malicious_checkpoints_never_run_code(tmp_path: Path, how: str) -> None:
    from tests.support.producers import malicious_metadata, malicious_object

    sentinel = malicious_metadata(str(tmp_path / "meta"), how=how)  # type: ignore[arg-type]
    out = str(tmp_path / "hf-meta")
    with pytest.raises(UnsafeCheckpointError):
        ckptools.consolidate(str(tmp_path / "meta"), out, quiet=True, weights_only=True)
    assert not os.path.exists(sentinel)
    _no_leftovers(out)
    # An object entry is not exported (safetensors holds tensors), so it is never even decoded.
    sentinel = malicious_object(str(tmp_path / "obj"), how=how)  # type: ignore[arg-type]
    out = str(tmp_path / "hf-obj")
    result = ckptools.consolidate(str(tmp_path / "obj"), out, quiet=True, weights_only=True)
    assert not os.path.exists(sentinel)
    assert result.skipped_objects == 2
    assert torch.equal(_read_dir(out)["w"], torch.arange(6, dtype=torch.float32).reshape(2, 3))


def test_byte_path_never_imports_torch(produced: Callable[..., Produced], tmp_path: Path) -> None:
    # The hint in the issue: moving bytes needs no tensors, so a plain DCP save never loads torch.
    import subprocess
    import sys

    p = produced("fsdp2", world_size=2, optimizer=False)
    code = (
        "import sys, ckptools\n"
        f"ckptools.consolidate({str(p.path)!r}, {str(tmp_path / 'hf')!r}, quiet=True,"
        " weights_only=True)\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "NO-TORCH"
    _assert_bit_exact(_read_dir(str(tmp_path / "hf")), p.reference()["model"])


def _consolidate_on_rank(rank: int, world_size: int, src: str, out: str, **kw: Any) -> Any:
    return ckptools.consolidate(src, out, quiet=True, **kw, weights_only=True).to_dict()


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_write_their_shares_and_rank0_commits(
    produced: Callable[..., Produced], tmp_path: Path, world_size: int
) -> None:
    from tests.support.dist import run_ranks

    p = produced("fsdp2", world_size=4, optimizer=False)
    out = str(tmp_path / "hf")
    results = run_ranks(
        _consolidate_on_rank, world_size, str(p.path), out, max_shard_size="20KB", timeout=120
    )
    assert all("written by" in " ".join(r["notes"]) for r in results)
    _assert_bit_exact(_read_dir(out), p.reference()["model"])
    assert sorted(os.listdir(tmp_path)) == ["hf"]


def _failing_on_rank1(rank: int, world_size: int, src: str, out: str) -> str:
    if rank == 1:
        from ckptools.engine import chunk_copier

        def boom(*args: Any) -> None:
            raise OSError("disk full (simulated on rank 1)")

        chunk_copier.ChunkCopier.copy_chunk = boom  # type: ignore[method-assign]
    try:
        ckptools.consolidate(src, out, quiet=True, weights_only=True)
    except (OSError, CkptError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.distributed
def test_a_failing_rank_leaves_nothing(produced: Callable[..., Produced], tmp_path: Path) -> None:
    from tests.support.dist import run_ranks

    p = produced("fsdp2", world_size=4, optimizer=False)
    out = str(tmp_path / "hf")
    results = run_ranks(_failing_on_rank1, 2, str(p.path), out, timeout=120)
    assert "another rank" in results[0] and "simulated on rank 1" in results[1]
    _no_leftovers(out)


def test_consolidate_help_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from ckptools.cli.main import cli\n"
        "try:\n"
        "    cli.main(args=['consolidate', '--help'], prog_name='ckpt')\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "--max-shard-size" in out.stdout
    assert out.stdout.strip().endswith("NO-TORCH")
