"""The test infrastructure itself: ``run_ranks`` and every producer of real checkpoints.

Each producer's checkpoint is loaded back with torch's own ``dcp.load`` (one process, into tensors
preallocated from the reference) and compared bit-exactly with the ground truth the producer
gathered through torch, so the producers can serve as an independent truth for ckptools.
"""

from __future__ import annotations

import itertools
import json
import os
import pickle
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tests.conftest import Produced
from tests.support import producers, zygote
from tests.support.dist import RankFailedError, RanksTimeoutError, run_ranks
from tests.support.reference import (
    assert_checkpoint_matches,
    expected_checkpoints,
    flat_expected,
    load_reference,
    tensor_bytes,
)

distributed = pytest.mark.distributed

# --------------------------------------------------------------------------------------------------
# run_ranks (functions run in spawned ranks must be module level)
# --------------------------------------------------------------------------------------------------


def _sum_of_ranks(rank: int, world_size: int, offset: int, *, scale: int = 1) -> dict[str, int]:
    t = torch.tensor([rank + offset])
    dist.all_reduce(t)
    return {"rank": rank, "sum": int(t.item()) * scale}


def _fail_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom from rank 1")
    dist.barrier()  # rank 0 waits in a collective that never completes, and must be killed


def _sleep_forever(rank: int, world_size: int) -> None:
    time.sleep(3600)


def _killed_by_signal(rank: int, world_size: int) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


@pytest.fixture(params=["fork-server", "zygote"])
def ranks_from(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Where run_ranks forks the ranks from: the fork server, or (for a run whose environment
    changes what the preloaded libraries read when imported, as HF_HUB_CACHE does) a zygote
    that imported them under that environment."""
    from tests.support import dist as dist_support

    if request.param == "zygote":
        monkeypatch.setenv("HF_HUB_DOWNLOAD_TIMEOUT", "11")  # read by huggingface_hub at import
    env = {**os.environ, **dist_support._RANK_ENV}
    assert (dist_support._context(env) is None) == (request.param == "zygote")
    return str(request.param)


@distributed
def test_run_ranks_returns_each_ranks_value(ranks_from: str) -> None:
    results = run_ranks(_sum_of_ranks, 2, 10, scale=2, timeout=60)
    assert results == [{"rank": 0, "sum": 42}, {"rank": 1, "sum": 42}]


def _hub_download_timeout(rank: int, world_size: int) -> int:
    from huggingface_hub import constants

    return int(constants.HF_HUB_DOWNLOAD_TIMEOUT)


@distributed
def test_run_ranks_imports_under_the_runs_environment(ranks_from: str) -> None:
    # huggingface_hub read the variable when imported, before the rank ran: in the fork server
    # under the session's environment, in the zygote under the run's
    from huggingface_hub import constants

    expected = 11 if ranks_from == "zygote" else constants.DEFAULT_DOWNLOAD_TIMEOUT
    assert run_ranks(_hub_download_timeout, 2, timeout=60) == [expected, expected]


@distributed
def test_run_ranks_reraises_the_failing_ranks_traceback(ranks_from: str) -> None:
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run_ranks(_fail_on_rank_1, 2, timeout=60)
    assert info.value.rank == 1
    assert "ValueError: boom from rank 1" in info.value.rank_traceback
    assert "_fail_on_rank_1" in info.value.rank_traceback
    assert "rank 1 failed" in str(info.value) and "boom from rank 1" in str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert time.monotonic() - start < 30  # rank 0 was killed, not waited for


@distributed
def test_run_ranks_reports_a_rank_killed_by_a_signal(ranks_from: str) -> None:
    with pytest.raises(RankFailedError) as info:
        run_ranks(_killed_by_signal, 2, timeout=60)
    # rank 1 died by the signal; rank 0's barrier may fail first (gloo sees the peer gone), so
    # the report names whichever it saw first, and always rank 1's death
    assert info.value.rank in (0, 1)
    assert f"rank 1 ---\nprocess exited with code {-signal.SIGKILL}" in str(info.value)


@distributed
def test_run_ranks_timeout_kills_every_rank(ranks_from: str) -> None:
    start = time.monotonic()
    with pytest.raises(RanksTimeoutError) as info:
        run_ranks(_sleep_forever, 2, timeout=3)
    elapsed = time.monotonic() - start
    assert 3 <= elapsed < 20
    assert info.value.pending == [0, 1]
    assert "did not finish within 3.0 s" in str(info.value)


def test_run_ranks_rejects_an_unpicklable_function() -> None:
    with pytest.raises(TypeError, match="picklable"):
        run_ranks(lambda rank, world_size: None, 2)


# --------------------------------------------------------------------------------------------------
# Distributed producers: dcp.load gives back exactly the reference
# --------------------------------------------------------------------------------------------------


def _metadata(path: Path | str) -> Any:
    return dcp.FileSystemReader(str(path)).read_metadata()


def _boxes(path: Path | str, fqn: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    md = _metadata(path).state_dict_metadata[fqn]
    return [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]


def _assert_trained(ref: dict[str, Any]) -> None:
    """The optimizer really stepped: step counts are 2 and moments are non-zero."""
    state = ref["optim"]["state"]
    for fqn, s in state.items():
        assert float(s["step"]) == 2.0, fqn
        assert s["exp_avg"].abs().sum() > 0, fqn
        assert s["exp_avg_sq"].shape == ref["model"][fqn].shape, fqn


@distributed
def test_fsdp2_with_optimizer_and_extra_entries(produced: Callable[..., Produced]) -> None:
    p = produced("fsdp2", world_size=3, optimizer=True, extra=True)
    ref = load_reference(p.ref_path)
    assert_checkpoint_matches(p.path, ref)
    _assert_trained(ref)
    keys = set(_metadata(p.path).state_dict_metadata)
    assert {"step", "name", "cfg.lr", "cfg.sched", "rng", "dataloader"} <= keys
    assert "optim.state.model.embed_tokens.weight.exp_avg" in keys
    # 2 rows over 3 ranks: one empty shard, stored as a zero-size chunk at offset == rows.
    assert _boxes(p.path, "model.model.layers.0.self_attn.k_proj.weight") == [
        ((0, 0), (1, 10)),
        ((1, 0), (1, 10)),
        ((2, 0), (0, 10)),
    ]
    assert _boxes(p.path, "model.model.embed_tokens.weight") == [
        ((0, 0), (13, 10)),
        ((13, 0), (13, 10)),
        ((26, 0), (11, 10)),
    ]


@distributed
def test_fsdp2_nested_app_with_tied_weights(produced: Callable[..., Produced]) -> None:
    p = produced("fsdp2", world_size=2, nested_app=True, tied=True)
    ref = load_reference(p.ref_path)
    assert_checkpoint_matches(p.path, ref)
    keys = set(_metadata(p.path).state_dict_metadata)
    assert "app.model.lm_head.weight" in keys and "app.model.model.embed_tokens.weight" in keys
    assert all(k.startswith("app.") for k in keys)
    assert torch.equal(ref["model"]["lm_head.weight"], ref["model"]["model.embed_tokens.weight"])


@distributed
def test_fsdp2_model_only(tmp_path: Path) -> None:
    out, ref_path = tmp_path / "ckpt", tmp_path / "ref.pt"
    described = producers.produce("fsdp2", out, ref_path, optimizer=False)
    ref = load_reference(ref_path)
    assert ref["optim"] is None and ref["layout"]["optim"] is None
    assert_checkpoint_matches(out, ref)
    # Every rank describes its own DTensor shards.
    assert described is not None and len(described) == 2
    assert described[0]["lm_head.weight"] == "DTensor (Shard(dim=0),) local=(19, 10)"
    assert described[1]["lm_head.weight"] == "DTensor (Shard(dim=0),) local=(18, 10)"


@distributed
def test_fsdp1_sharded_state_dict(produced: Callable[..., Produced]) -> None:
    p = produced("fsdp1", world_size=2, optimizer=True)
    ref = load_reference(p.ref_path)
    assert_checkpoint_matches(p.path, ref)
    _assert_trained(ref)
    assert "optim.param_groups.0.lr" in _metadata(p.path).state_dict_metadata


@distributed
@pytest.mark.slow
def test_hsdp_replicas_are_stored_once(produced: Callable[..., Produced]) -> None:
    p = produced("hsdp")
    ref = load_reference(p.ref_path)
    assert_checkpoint_matches(p.path, ref)
    # Sharded over the 2-rank "shard" dim only: two chunks, not four.
    assert _boxes(p.path, "model.model.embed_tokens.weight") == [
        ((0, 0), (19, 10)),
        ((19, 0), (18, 10)),
    ]
    assert len(list(p.path.glob("__*_0.distcp"))) == 4


@distributed
@pytest.mark.slow
def test_tp_fsdp_colwise_strided_and_rowwise_shards(produced: Callable[..., Produced]) -> None:
    p = produced("tp_fsdp")
    ref = load_reference(p.ref_path)
    assert_checkpoint_matches(p.path, ref)
    # ColwiseParallel + FSDP on dp: rows split by tp first (11 | 11), then by dp inside each tp
    # shard (6 + 5), which is what _StridedShard records.
    assert _boxes(p.path, "model.model.layers.0.mlp.gate_proj.weight") == [
        ((0, 0), (6, 10)),
        ((11, 0), (6, 10)),
        ((6, 0), (5, 10)),
        ((17, 0), (5, 10)),
    ]
    # RowwiseParallel: columns split by tp (Shard(1)), rows by dp.
    assert sorted(_boxes(p.path, "model.model.layers.0.self_attn.o_proj.weight")) == [
        ((0, 0), (5, 4)),
        ((0, 4), (5, 4)),
        ((5, 0), (5, 4)),
        ((5, 4), (5, 4)),
    ]


@distributed
@pytest.mark.parametrize("fsdp_version", [2, 1])
def test_accelerate_save_state_layout(produced: Callable[..., Produced], fsdp_version: int) -> None:
    opts = {} if fsdp_version == 2 else {"fsdp_version": 1}
    p = produced("accelerate", **opts)
    ref = load_reference(p.ref_path)
    assert_checkpoint_matches(p.path, ref)
    assert sorted(expected_checkpoints(ref)) == ["optimizer_0", "pytorch_model_fsdp_0"]
    model_keys = set(_metadata(p.path / "pytorch_model_fsdp_0").state_dict_metadata)
    optim_keys = set(_metadata(p.path / "optimizer_0").state_dict_metadata)
    assert "model.lm_head.weight" in model_keys
    assert "optimizer.state.lm_head.weight.exp_avg" in optim_keys
    for name in ("scheduler.bin", "random_states_0.pkl", "random_states_1.pkl"):
        assert (p.path / name).is_file(), name
    states = torch.load(p.path / "random_states_1.pkl", weights_only=False)
    assert set(states) == {"step", "random_state", "numpy_random_seed", "torch_manual_seed"}


@distributed
def test_trainer_checkpoint_layout(produced: Callable[..., Produced]) -> None:
    p = produced("trainer")
    assert_checkpoint_matches(p.path, load_reference(p.ref_path))
    files = {f.name for f in p.path.iterdir()}
    assert files == {
        "pytorch_model_fsdp_0",
        "optimizer_0",
        "scheduler.pt",
        "rng_state_0.pth",
        "rng_state_1.pth",
        "trainer_state.json",
    }
    state = json.loads((p.path / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and len(state["log_history"]) == 2
    rng = torch.load(p.path / "rng_state_0.pth", weights_only=False)
    assert set(rng) == {"python", "numpy", "cpu"}


@distributed
def test_trainer_checkpoint_with_hf_model_files(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out, ref_path = tmp_path / "checkpoint-2", tmp_path / "ref.pt"
    producers.produce("trainer", out, ref_path, hf_model_files=True)
    ref = load_reference(ref_path)
    assert_checkpoint_matches(out, ref)
    full = load_file(out / "model.safetensors")
    assert set(full) == set(ref["model"])
    assert all(torch.equal(tensor_bytes(full[k]), tensor_bytes(ref["model"][k])) for k in full)
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    with open(out / "training_args.bin", "rb") as f:
        assert b"TrainingArguments" in f.read()


@distributed
def test_lightning_sharded_checkpoint(produced: Callable[..., Produced]) -> None:
    p = produced("lightning")
    ref = load_reference(p.ref_path)
    assert_checkpoint_matches(p.path, ref)
    keys = set(_metadata(p.path).state_dict_metadata)
    assert "model.model.lm_head.weight" in keys  # LightningModule.model -> HF-style network
    assert "optimizer_0.state.model.lm_head.weight.exp_avg" in keys
    meta = torch.load(p.path / "meta.pt", weights_only=True)
    assert {"epoch", "global_step", "pytorch-lightning_version", "loops", "lr_schedulers"} <= set(
        meta
    )
    assert "state_dict" not in meta and "optimizer_states" not in meta


@distributed
def test_torchtitan_full_training_state(produced: Callable[..., Produced]) -> None:
    p = produced("torchtitan")
    ref = load_reference(p.ref_path)
    assert_checkpoint_matches(p.path, ref)
    keys = set(_metadata(p.path).state_dict_metadata)
    assert {
        "tok_embeddings.weight",
        "layers.1.feed_forward.w2.weight",
        "output.weight",
        "optimizer.state.tok_embeddings.weight.exp_avg",
        "optimizer.param_groups.tok_embeddings.weight.lr",
        "lr_scheduler.last_epoch",
        "dataloader.dp_rank_0",
        "dataloader.dp_rank_1",
        "dataloader.world_size",
        "train_state.step",
        "train_state.ntokens_seen",
    } <= keys
    assert not any(k.startswith("model.") for k in keys)


@distributed
def test_torchtitan_model_only_export(produced: Callable[..., Produced]) -> None:
    p = produced("torchtitan", model_only=True, export_dtype="bfloat16")
    ref = load_reference(p.ref_path)
    assert_checkpoint_matches(p.path, ref)
    md = _metadata(p.path).state_dict_metadata
    assert set(md) == set(ref["model"])
    assert {m.properties.dtype for m in md.values()} == {torch.bfloat16}


# --------------------------------------------------------------------------------------------------
# Single-process producers
# --------------------------------------------------------------------------------------------------


def test_single_covers_every_dtype_and_odd_tensor(produced: Callable[..., Produced]) -> None:
    p = produced("single")
    ref = load_reference(p.ref_path)
    assert_checkpoint_matches(p.path, ref)
    dtypes = {t.dtype for t in ref["model"]["dtypes"].values()}
    assert dtypes == set(producers.ALL_DTYPES)
    md = _metadata(p.path).state_dict_metadata
    assert md["model.scalar_f32"].size == torch.Size([])
    assert md["model.empty_0x3"].size == torch.Size([0, 3])
    assert md["model.transposed"].size == torch.Size([6, 4])
    assert "model.list_of_tensors.1" in md and "extra.blob" in md and "extra.nested.b.c" in md


def test_comparison_catches_a_flipped_bit(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    """Negative control: one flipped bit in a tensor's bytes fails the check."""
    p = produced("single")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(p.path, ckpt)
    ref = load_reference(p.ref_path)
    expected = flat_expected(ref)["."]["model.dtypes.float32"]
    info = next(
        v for k, v in _metadata(ckpt).storage_data.items() if k.fqn == "model.dtypes.float32"
    )
    blob = (ckpt / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
    at = blob.find(tensor_bytes(expected).numpy().tobytes())
    assert at >= 0
    producers.flip_bit(ckpt / info.relative_path, info.offset + at + 5, bit=3)
    with pytest.raises(AssertionError, match=r"model\.dtypes\.float32: tensor bytes differ"):
        assert_checkpoint_matches(ckpt, ref)


def test_hf_sharded_and_torch_save(produced: Callable[..., Produced]) -> None:
    from safetensors.torch import load_file

    hf = produced("hf_sharded")
    index = json.loads((hf.path / "model.safetensors.index.json").read_text())
    ref = load_reference(hf.ref_path)["model"]
    assert set(index["weight_map"]) == set(ref)
    for shard in sorted(set(index["weight_map"].values())):
        for k, t in load_file(hf.path / shard).items():
            assert torch.equal(tensor_bytes(t), tensor_bytes(ref[k])), k
    ts = produced("torch_save")
    sd = torch.load(ts.path, weights_only=True)
    assert set(sd) == set(ref)  # same trained model, same values
    assert all(torch.equal(sd[k], ref[k]) for k in ref)


@pytest.mark.parametrize("how", ["exec", "os.system"])
def test_malicious_metadata_is_armed_but_not_fired(tmp_path: Path, how: str) -> None:
    sentinel = producers.malicious_metadata(tmp_path / "evil", how=how)  # type: ignore[arg-type]
    assert sentinel.startswith(str(tmp_path))
    assert not os.path.exists(sentinel)
    # Plain pickle (in another process) fires it: proves the hostile fixture is real. The
    # process is forked from the zygote: unpickling imports torch, which it has imported.
    code = f"import pickle; pickle.load(open({str(tmp_path / 'evil' / '.metadata')!r}, 'rb'))"
    _run_elsewhere(code, tmp_path)
    assert os.path.exists(sentinel)


@pytest.mark.parametrize("how", ["exec", "os.system"])
def test_malicious_object_is_armed_but_not_fired(tmp_path: Path, how: str) -> None:
    sentinel = producers.malicious_object(tmp_path / "evil", how=how)  # type: ignore[arg-type]
    assert not os.path.exists(sentinel)
    assert "extra.payload" in _metadata(tmp_path / "evil").state_dict_metadata
    code = (
        "import torch, torch.distributed.checkpoint as dcp\n"
        "sd = {'model': {'w': torch.empty(2, 3)}, 'extra': {'payload': None, 'step': None}}\n"
        f"dcp.load(sd, checkpoint_id={str(tmp_path / 'evil')!r}, no_dist=True)\n"
    )
    _run_elsewhere(code, tmp_path)
    assert os.path.exists(sentinel)


def _run_elsewhere(code: str, cwd: Path) -> None:
    """``python -c code`` in a process of its own (forked from the zygote, which has imported
    torch), which must succeed."""
    done = zygote.run([sys.executable, "-c", code], env=dict(os.environ), cwd=str(cwd), timeout=120)
    assert done.returncode == 0, done.stderr


# --------------------------------------------------------------------------------------------------
# Damage helpers and synthetic metadata
# --------------------------------------------------------------------------------------------------


def test_damage_helpers(produced: Callable[..., Produced], tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(produced("fsdp2", world_size=2, nested_app=True, tied=True).path, ckpt)
    f0 = ckpt / "__0_0.distcp"
    size = f0.stat().st_size
    producers.truncate(f0, -10)
    assert f0.stat().st_size == size - 10
    producers.truncate(f0, 100)
    assert f0.stat().st_size == 100
    before = (ckpt / "__1_0.distcp").read_bytes()
    producers.flip_bit(ckpt / "__1_0.distcp", 7, bit=6)
    after = (ckpt / "__1_0.distcp").read_bytes()
    assert [i for i in range(len(before)) if before[i] != after[i]] == [7]
    assert before[7] ^ after[7] == 1 << 6
    assert [os.path.basename(x) for x in producers.remove_rank_file(ckpt, 1)] == ["__1_0.distcp"]
    with pytest.raises(FileNotFoundError):
        producers.remove_rank_file(ckpt, 1)
    producers.garble_metadata(ckpt)
    with open(ckpt / ".metadata", "rb") as f, pytest.raises(pickle.UnpicklingError):
        pickle.load(f)


@pytest.mark.parametrize("sized_files", [False, True])
def test_big_many_tensors_metadata_is_valid(tmp_path: Path, sized_files: bool) -> None:
    out = producers.big_many_tensors_metadata(
        tmp_path / "big", n_tensors=40, world_size=8, sized_files=sized_files
    )
    md = _metadata(out)
    assert len(md.state_dict_metadata) == 40
    ends: dict[str, int] = {}
    for fqn, item in md.state_dict_metadata.items():
        rows = item.size[0]
        covered = sorted((c.offsets[0], c.sizes[0]) for c in item.chunks)
        assert sum(n for _, n in covered) == rows, fqn  # the chunks tile dim 0
        assert all(a + n <= b for (a, n), (b, _) in itertools.pairwise(covered)), fqn
    for index, info in md.storage_data.items():
        assert index.fqn in md.state_dict_metadata
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    assert sorted(ends) == sorted(f"__{r}_0.distcp" for r in range(8))
    for name, end in ends.items():
        assert os.path.getsize(os.path.join(out, name)) == (end if sized_files else 0)


@pytest.mark.slow
def test_big_many_tensors_metadata_default_size(tmp_path: Path) -> None:
    out = producers.big_many_tensors_metadata(tmp_path / "big")
    md = _metadata(out)
    assert len(md.state_dict_metadata) == 1000
    assert len({info.relative_path for info in md.storage_data.values()}) == 64
