"""``ckptools.save_pretrained`` with real gloo ranks.

Truth: ``ckptools.consolidate`` of a ``ckptools.save`` checkpoint of the same model (every output
file byte-identical), and ``transformers`` loading the directory and giving the same logits as the
model before it was sharded.
"""

from __future__ import annotations

import filecmp
import os
from pathlib import Path
from typing import Any

import pytest

from tests.support.dist import RankFailedError, run_ranks

pytestmark = pytest.mark.distributed

# Small enough that the tiny Llama (~10 KB of float32) lands in several shards.
_SHARD = "2KB"


def _compare_dirs(a: str, b: str) -> list[str]:
    names_a, names_b = sorted(os.listdir(a)), sorted(os.listdir(b))
    if names_a != names_b:
        return [f"files differ: {names_a} vs {names_b}"]
    return [
        f"{n} differs"
        for n in names_a
        if not filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False)
    ]


def _same_as_consolidate(
    rank: int, world_size: int, root: str, kinds: list[str], dtype: str | None
) -> tuple[list[str], dict[str, tuple[int, int]]]:
    """For each wrapping: train a step, ``ckptools.save`` + ``consolidate`` (collective) and
    ``save_pretrained``; rank 0 compares the two directories. Returns rank 0's failures and, per
    kind, ``(bytes this rank wrote, total tensor bytes)``."""
    import torch.distributed as dist

    import ckptools
    from tests.support import training

    failures: list[str] = []
    written: dict[str, tuple[int, int]] = {}
    for kind in kinds:
        base = os.path.join(root, kind)
        model, opt = training.build(kind, world_size)
        training.train_step(model, opt, 0)
        ckptools.save(os.path.join(base, "ck"), model, opt)
        ckptools.consolidate(
            os.path.join(base, "ck"),
            os.path.join(base, "consolidated"),
            max_shard_size=_SHARD,
            dtype=dtype,  # type: ignore[arg-type]
            quiet=True,
            weights_only=True,
        )
        result = ckptools.save_pretrained(
            model,
            os.path.join(base, "pretrained"),
            max_shard_size=_SHARD,
            dtype=dtype,  # type: ignore[arg-type]
        )
        written[kind] = (result.bytes_written, result.total_size)
        dist.barrier()
        if rank == 0:
            if len(result.files) < 3:
                failures.append(f"{kind}: expected several shards, got {result.files}")
            failures += [
                f"{kind}: {d}"
                for d in _compare_dirs(
                    os.path.join(base, "consolidated"), os.path.join(base, "pretrained")
                )
            ]
            if [p for p in os.listdir(base) if ".tmp-" in p]:
                failures.append(f"{kind}: temporary directories left: {os.listdir(base)}")
        dist.barrier()
    return failures, written


def _check(results: list[tuple[list[str], dict[str, tuple[int, int]]]]) -> None:
    assert results[0][0] == []
    for kind, (_, total) in results[0][1].items():
        # Every byte written once, by the rank holding it: no rank wrote the whole model.
        shares = [r[1][kind][0] for r in results]
        assert sum(shares) == total and max(shares) < total, (kind, shares, total)


def test_fsdp2_ddp_at_two_ranks_equal_consolidate(tmp_path: Path) -> None:
    kinds = ["fsdp2", "fsdp2+mp", "ddp"]
    _check(run_ranks(_same_as_consolidate, 2, str(tmp_path), kinds, None, timeout=240.0))


def test_fsdp2_uneven_three_ranks_and_cast_equal_consolidate(tmp_path: Path) -> None:
    # vocab 37 and the 2-row k/v projections over 3 ranks: uneven shards, one empty.
    _check(run_ranks(_same_as_consolidate, 3, str(tmp_path), ["fsdp2"], "bfloat16", timeout=240.0))


def test_fsdp1_equals_consolidate(tmp_path: Path) -> None:
    kinds = ["fsdp1-full", "fsdp1-grad+mp"]
    _check(run_ranks(_same_as_consolidate, 2, str(tmp_path), kinds, None, timeout=240.0))


def test_plain_module_without_process_group(tmp_path: Path) -> None:
    import torch

    import ckptools
    from tests.support import training

    model, opt = training.build("plain", 1)
    training.train_step(model, opt, 0)
    ckptools.save(str(tmp_path / "ck"), model)
    ckptools.consolidate(
        str(tmp_path / "ck"),
        str(tmp_path / "a"),
        max_shard_size=_SHARD,
        quiet=True,
        weights_only=True,
    )
    result = ckptools.save_pretrained(model, tmp_path / "b", max_shard_size=_SHARD)
    assert result.world_size == 1 and len(result.files) > 2
    assert result.bytes_written == result.total_size
    assert _compare_dirs(str(tmp_path / "a"), str(tmp_path / "b")) == []
    with pytest.raises(ckptools.CkptError, match="already exists"):
        ckptools.save_pretrained(model, tmp_path / "b")
    ckptools.save_pretrained(torch.nn.Linear(2, 2), tmp_path / "b", overwrite=True)
    assert sorted(os.listdir(tmp_path / "b")) == ["model.safetensors"]


def _llama_config(tied: bool) -> Any:
    from transformers import LlamaConfig

    from tests.support.producers import hf_config_dict

    cfg = {k: v for k, v in hf_config_dict().items() if k not in ("architectures", "torch_dtype")}
    cfg["tie_word_embeddings"] = tied
    return LlamaConfig(**cfg, attn_implementation="eager")


def _hf_llama(rank: int, world_size: int, root: str, tied: bool) -> list[str]:
    """FSDP2-sharded ``LlamaForCausalLM``: ``save_pretrained`` equals consolidate of a save (with
    the config written beside it, as the manager does), and loads with the unsharded logits."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    import ckptools
    from ckptools.training.state import write_model_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config(tied)).eval()
    tokens = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(tokens).logits
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    config_dir = os.path.join(root, "config")
    if rank == 0:
        os.makedirs(config_dir)
        write_model_config(model, config_dir)
    ckptools.save(os.path.join(root, "ck"), model)
    ckptools.consolidate(
        os.path.join(root, "ck"),
        os.path.join(root, "consolidated"),
        max_shard_size=_SHARD,
        config=config_dir,
        quiet=True,
    )
    result = ckptools.save_pretrained(
        model, os.path.join(root, "pretrained"), max_shard_size=_SHARD
    )
    dist.barrier()
    failures: list[str] = []
    if rank == 0:
        out = os.path.join(root, "pretrained")
        failures += _compare_dirs(os.path.join(root, "consolidated"), out)
        if "config.json" not in result.config_files:
            failures.append(f"config not written: {result.config_files}")
        if tied != any(d[0] == "lm_head.weight" for d in result.dropped):
            failures.append(f"tied={tied} but dropped {result.dropped}")
        loaded = LlamaForCausalLM.from_pretrained(
            out, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        with torch.no_grad():
            got = loaded(tokens).logits
        if not torch.equal(got, expected):
            failures.append(f"logits differ by {(got - expected).abs().max().item()}")
    dist.barrier()
    return failures


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_transformers_llama_loads_with_identical_logits(tmp_path: Path, tied: bool) -> None:
    results = run_ranks(_hf_llama, 2, str(tmp_path), tied, timeout=240.0)
    assert results[0] == []


def _fail_on_rank_1(rank: int, world_size: int, root: str) -> str:
    import ckptools
    from ckptools.training import pretrained
    from tests.support import training

    model, _ = training.build("fsdp2", world_size)
    if rank == 1:

        def broken(*args: Any, **kwargs: Any) -> int:
            raise OSError(28, "No space left on device (injected)")

        pretrained._write_share = broken  # type: ignore[assignment]
    try:
        ckptools.save_pretrained(model, os.path.join(root, "out"), max_shard_size=_SHARD)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_failure_on_one_rank_leaves_nothing(tmp_path: Path) -> None:
    try:
        results = run_ranks(_fail_on_rank_1, 2, str(tmp_path), timeout=120.0)
    except RankFailedError as e:  # pragma: no cover - reported with the rank's traceback
        raise AssertionError(e.rank_traceback) from e
    assert "failed on another rank" in results[0]
    assert "No space left" in results[1]
    assert os.listdir(tmp_path) == []
