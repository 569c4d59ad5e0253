"""DeepSpeed ZeRO 1/2/3 checkpoints, written by real DeepSpeed engines, read without DeepSpeed.

Each world size's checkpoints come from one launch of real ranks (gloo, ``DS_ACCELERATOR=cpu``,
torch's AdamW as client optimizer, fp32 and bf16, stages 1-3; see
:mod:`tests.support.deepspeed_producers`): a tiny model with a tied embedding, a frozen layer, a
buffer and sizes that split partitions mid-row. The truths are DeepSpeed's own: its converter
``zero_to_fp32`` and ``safe_get_full_fp32_param``, both run by the producing ranks.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support import deepspeed_producers
from tests.support.deepspeed_producers import TAG, case_dir, deepspeed_available, produce_zero

PRODUCER_SOURCE = Path(deepspeed_producers.__file__)

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.deepspeed,
    pytest.mark.skipif(
        not deepspeed_available(), reason="DeepSpeed is not installed (make setup installs it)"
    ),
]

STAGES = (1, 2, 3)
DTYPES = ("fp32", "bf16")
#: world size 3 takes a second launch of DeepSpeed (~40 s on a busy 2-core box): slow
CASES = [
    pytest.param(w, s, d, id=f"w{w}-zero{s}-{d}", marks=[pytest.mark.slow] if w == 3 else [])
    for w in (2, 3)
    for s in STAGES
    for d in DTYPES
]


@pytest.fixture(scope="module")
def zero(cached_output: Callable[..., Path]) -> Callable[[int, int, str], str]:
    """``zero(world, stage, dtype)``: the run directory of that checkpoint, made once (and kept
    across sessions while DeepSpeed and its producer are unchanged)."""
    made: dict[int, str] = {}

    def get(world: int, stage: int, dtype: str) -> str:
        if world not in made:
            cases = [(s, d) for s in STAGES for d in DTYPES]
            out = cached_output(
                f"zero-w{world}-" + "-".join(f"{s}{d}" for s, d in cases),
                [PRODUCER_SOURCE],
                lambda d: produce_zero(str(d), world, cases),
            )
            made[world] = str(out)
        return case_dir(made[world], stage, dtype)

    return get


def _zero_to_fp32(path: str) -> dict[str, Any]:
    """What DeepSpeed's own converter made of ``path`` (run by the producing ranks)."""
    import torch

    ref: dict[str, Any] = torch.load(os.path.join(path, "zero_to_fp32.pt"), weights_only=True)
    return ref


def _load_dir(out: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for f in sorted(glob.glob(str(out / "*.safetensors"))):
        tensors.update(load_file(f))
    return tensors


def _module(path: str, stage: int) -> dict[str, Any]:
    import torch

    name = (
        "zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
    )
    sd = torch.load(os.path.join(path, TAG, name), weights_only=False)
    return dict(sd["module"])


def _same_bits(a: Any, b: Any) -> bool:
    import torch

    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
        )
    )


@pytest.mark.parametrize(("world", "stage", "dtype"), CASES)
def test_consolidate_equals_zero_to_fp32_and_live_masters(
    zero: Callable[[int, int, str], str], tmp_path: Path, world: int, stage: int, dtype: str
) -> None:
    import torch

    import ckptools

    path = zero(world, stage, dtype)
    out = tmp_path / "hf"
    result = ckptools.consolidate(path, str(out), quiet=True, weights_only=True)
    ours = _load_dir(out)
    theirs = _zero_to_fp32(path)
    assert theirs, "zero_to_fp32 returned nothing"
    for name, want in theirs.items():
        assert name in ours, f"{name} missing; we wrote {sorted(ours)}"
        # zero_to_fp32 turns buffers into fp32; ckptools keeps their saved dtype (fp32 here)
        assert _same_bits(ours[name], want.contiguous()), name
    live = torch.load(os.path.join(path, "live.pt"), weights_only=True)
    assert set(live) == {"embed.weight", "mid.weight", "mid.bias", "norm.weight", "norm.bias"}
    for name, want in live.items():
        assert _same_bits(ours[name], want), name
    # the tied head is the embedding's masters, as zero_to_fp32 restores it from shared_params
    assert _same_bits(ours["head.weight"], ours["embed.weight"])
    # frozen parameters DeepSpeed did not list (its stage 1) come whole from the saved module
    module = _module(path, stage)
    for name in set(ours) - set(theirs):
        assert name.startswith("frozen."), name
        assert _same_bits(ours[name], module[name]), name
    assert ckptools.verify(path, quiet=True).ok
    # diff reads the ZeRO checkpoint's chunks on its own path: the written model is identical
    assert ckptools.diff(path, str(out)).identical
    assert result.to_dict()["tensors"] == len(ours)


@pytest.mark.parametrize("stage", STAGES)
def test_bfloat16_export_and_tag_directory(
    zero: Callable[[int, int, str], str], tmp_path: Path, stage: int
) -> None:
    import torch

    import ckptools

    path = _copy(zero(2, stage, "bf16"), tmp_path)
    config = Path(path, "config.json")
    config.write_text('{"model_type": "tiny", "tie_word_embeddings": false}')
    out = tmp_path / "bf16"
    # the tag directory itself is a checkpoint too: how a tag other than ``latest`` is chosen
    result = ckptools.consolidate(os.path.join(path, TAG), str(out), dtype="bfloat16", quiet=True)
    # the model's config is found beside the tag directory (the run directory), and states
    # the dtype written, as save_pretrained's does
    written = json.loads((out / "config.json").read_text())
    assert written == {**json.loads(config.read_text()), "dtype": "bfloat16"}
    assert result.config_files == ("config.json",)
    ours = _load_dir(out)
    for name, want in _zero_to_fp32(path).items():
        want = want.to(torch.bfloat16) if want.is_floating_point() else want
        assert _same_bits(ours[name], want.contiguous()), name


def test_read_without_deepspeed_or_torch(zero: Callable[[int, int, str], str]) -> None:
    """inspect and verify import neither DeepSpeed nor torch (a fresh interpreter)."""
    path = zero(2, 3, "bf16")
    code = (
        "import sys, ckptools\n"
        f"r = ckptools.inspect({path!r}).to_dict()\n"
        f"assert ckptools.verify({path!r}, quiet=True).ok\n"
        "bad = [m for m in ('deepspeed', 'torch') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "print(r['layout'], r['world_size'], r['notes'][0])\n"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("deepspeed 2 DeepSpeed ZeRO-3, tag global_step2, 2 ranks")


def test_inspect_says_what_each_rank_file_holds(zero: Callable[[int, int, str], str]) -> None:
    import ckptools
    from ckptools.producers import read_manifest

    path = zero(2, 2, "fp32")
    report = ckptools.inspect(path).to_dict()
    notes = report["notes"]
    assert notes[0].startswith("DeepSpeed ZeRO-2, tag global_step2, 2 ranks, masters float32")
    for r in range(2):
        assert any(
            n.startswith(f"{TAG}/zero_pp_rank_{r}_mp_rank_00_optim_states.pt") for n in notes
        )
    assert {f["rank"] for f in report["files"]} == {None, 0, 1}
    state = read_manifest(path).details["deepspeed"]
    assert state.stage == 2 and state.tag == TAG
    assert (
        set(state.exp_avg)
        == set(state.group_of)
        == {
            "embed.weight",
            "mid.weight",
            "mid.bias",
            "norm.weight",
            "norm.bias",
        }
    )


def _copy(path: str, tmp_path: Path) -> str:
    dst = tmp_path / "ckpt"
    shutil.copytree(path, dst)
    return str(dst)


def test_missing_and_truncated_rank_files(
    zero: Callable[[int, int, str], str], tmp_path: Path
) -> None:
    import ckptools
    from ckptools.errors import (
        CheckpointNotFoundError,
        CorruptCheckpointError,
        OutsideCheckpointError,
    )

    path = _copy(zero(2, 2, "fp32"), tmp_path)
    rank1 = os.path.join(path, TAG, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    data = Path(rank1).read_bytes()
    Path(rank1).write_bytes(data[: len(data) // 2])
    # named with the directory given (the archive's errors named it relative to the run)
    with pytest.raises(CorruptCheckpointError, match=re.escape(rank1)):
        ckptools.inspect(path)
    assert not ckptools.verify(path, quiet=True).ok
    os.remove(rank1)
    with pytest.raises(CheckpointNotFoundError, match="rank 1's optimizer file is missing"):
        ckptools.inspect(path)
    # ``latest`` naming a directory outside the checkpoint is refused, not followed
    outside = tmp_path / "elsewhere"
    shutil.copytree(os.path.join(path, TAG), outside)
    Path(path, "latest").write_text("../elsewhere")
    with pytest.raises(OutsideCheckpointError, match="latest"):
        ckptools.inspect(path)


@pytest.mark.parametrize(("stage", "dtype"), [(2, "fp32"), (3, "bf16")])
def test_a_damaged_master_partition_stops_consolidate_reshard_and_diff(
    zero: Callable[[int, int, str], str], tmp_path: Path, stage: int, dtype: str
) -> None:
    import ckptools
    from ckptools.errors import CorruptCheckpointError
    from tests.support.producers import flip_bit

    # A parameter's masters are a byte range of one flat partition record, whose zip CRC covers
    # the whole partition: a flipped bit went through consolidate (exit 0) and showed in diff
    # as "1 element differs"; verify alone said the file was damaged.
    clean = zero(2, stage, dtype)
    path = _copy(clean, tmp_path)
    manifest = ckptools.read_manifest(path)
    chunk = next(
        c
        for t in manifest.tensors.values()
        for c in t.chunks
        if c.record is not None and c.length >= 16
    )
    flip_bit(os.path.join(manifest.data_dir(), chunk.file), chunk.offset + chunk.length // 2, 5)
    said = rf"{chunk.file}: bytes .* of the record holding tensor '.*' fail their CRC-32 check"
    for run in (
        lambda: ckptools.consolidate(path, str(tmp_path / "hf"), quiet=True, weights_only=True),
        lambda: ckptools.reshard(path, str(tmp_path / "dcp"), world_size=3, quiet=True),
        lambda: ckptools.diff(path, clean),
    ):
        with pytest.raises(CorruptCheckpointError, match=said):
            run()
    assert not (tmp_path / "hf").exists() and not (tmp_path / "dcp").exists()
    assert not ckptools.verify(path, quiet=True).ok


def test_inconsistent_paddings_and_unsafe_globals(
    zero: Callable[[int, int, str], str], tmp_path: Path
) -> None:
    """Hand-damaged rank files (re-saved with torch): one line naming the file, nothing run."""
    import collections

    import torch

    import ckptools
    from ckptools.errors import CorruptCheckpointError, UnsafeCheckpointError

    path = _copy(zero(2, 1, "fp32"), tmp_path)
    rank0 = os.path.join(path, TAG, "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    sd = torch.load(rank0, weights_only=False)
    sd["optimizer_state_dict"]["group_paddings"] = [5]
    torch.save(sd, rank0)
    with pytest.raises(CorruptCheckpointError, match="paddings are inconsistent"):
        ckptools.inspect(path)
    sd["optimizer_state_dict"]["group_paddings"] = [0]
    # (not collections.Counter: torch's weights_only admits it, and so does ckptools now)
    sd["optimizer_state_dict"]["extra"] = collections.deque([1])
    torch.save(sd, rank0)
    with pytest.raises(UnsafeCheckpointError, match=r"collections\.deque"):
        ckptools.inspect(path)


def test_one_rank_file_is_refused_naming_its_directory(
    zero: Callable[[int, int, str], str], tmp_path: Path
) -> None:
    """ZeRO-3's model file of one rank holds every parameter as a ``[0]`` placeholder: pointed
    at it, each verb names the tag directory in one line; read as a plain ``torch.save`` file
    (``--format``), the conversion is still refused rather than write zero-element tensors."""
    from click.testing import CliRunner

    from ckptools.cli.main import cli

    tag = Path(zero(2, 3, "fp32"), TAG)
    for name in ("zero_pp_rank_0_mp_rank_00_model_states.pt",
                 "zero_pp_rank_1_mp_rank_00_optim_states.pt"):  # fmt: skip
        for verb in (["consolidate"], ["reshard", "--world-size", "2"]):
            out = tmp_path / f"{verb[0]}-{name}"
            r = CliRunner().invoke(cli, [verb[0], str(tag / name), str(out), *verb[1:]])
            assert r.exit_code == 2 and "Traceback" not in r.output, r.output
            [line] = r.output.strip().splitlines()
            assert f"one file of the deepspeed checkpoint at {tag}; point at {tag}" in line
            assert not out.exists()
    model_file = str(tag / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    for verb in (["consolidate"], ["reshard", "--world-size", "2"]):
        out = tmp_path / f"forced-{verb[0]}"
        r = CliRunner().invoke(cli, [verb[0], model_file, str(out), *verb[1:], "--format",
                                     "torch_save"])  # fmt: skip
        assert r.exit_code == 2 and "placeholders, not weights" in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1 and not out.exists()


def test_tag_directory_finds_the_run_config_two_levels_up(
    zero: Callable[[int, int, str], str], tmp_path: Path
) -> None:
    """``engine.save_checkpoint("run/ckpt")`` beside ``run/config.json``: pointed at the tag
    directory ``run/ckpt/global_step2``, consolidate finds the run's config as it does from
    ``run/ckpt``."""
    import json

    import ckptools

    run = tmp_path / "run"
    shutil.copytree(zero(2, 2, "fp32"), run / "ckpt")
    config = json.dumps({"model_type": "tiny", "tie_word_embeddings": False})
    (run / "config.json").write_text(config)
    for src in (run / "ckpt", run / "ckpt" / TAG):
        out = tmp_path / f"out-{src.name}"
        result = ckptools.consolidate(str(src), str(out), quiet=True)
        assert result.config_files == ("config.json",), src
        assert (out / "config.json").read_text() == config


def test_zero3_with_tied_embeddings_is_identical_to_its_consolidation(
    cached_output: Callable[..., Path], tmp_path: Path
) -> None:
    """A transformers Llama with tied embeddings trained under ZeRO-3: consolidate leaves the
    tied ``lm_head.weight`` out (the run's config ties it), and ``diff`` / ``verify
    --against`` call the checkpoint and its consolidation identical, saying why."""
    import ckptools
    from tests.support import deepspeed_producers as ds

    root = cached_output(
        "zero3-tied-llama",
        [Path(ds.__file__)],
        lambda d: produce_zero(str(d), 2, [(3, "fp32")], model_kind="llama"),
    )
    path = ds.case_dir(str(root), 3, "fp32")
    out = tmp_path / "hf"
    result = ckptools.consolidate(path, str(out), quiet=True)
    assert result.dropped == (("lm_head.weight", "model.embed_tokens.weight"),)
    assert result.config_files == ("config.json",)
    report = ckptools.diff(path, str(out))
    assert report.identical, [t.describe() for t in report.differences]
    [head] = [t for t in report.tensors if t.name == "lm_head.weight"]
    assert (head.status, head.tied_to, head.tied_in) == ("equal", "model.embed_tokens.weight", "B")
    assert ckptools.verify(path, against=str(out), quiet=True).ok
    ours = _load_dir(out)
    for name, want in _zero_to_fp32(path).items():
        if name != "lm_head.weight":
            assert _same_bits(ours[name], want.contiguous()), name
