"""``CkptoolsCallback`` against a real Trainer ``checkpoint-N/`` (written as transformers 5.23 +
accelerate write it, by ``tests/support/producers.trainer_fsdp``): the consolidated model equals the
reference state dict torch gathered itself, bit for bit, and loads with ``from_pretrained``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.dist import run_ranks
from tests.support.producers import hf_config_dict, produce

# Each test imports CkptoolsCallback itself: its module imports transformers' Trainer utilities
# (and through them peft), which cost every pytest-xdist worker 2 s of CPU when collecting.

_STEP = 2


def _llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = {k: v for k, v in hf_config_dict().items() if k not in ("architectures", "torch_dtype")}
    return LlamaForCausalLM(LlamaConfig(**cfg))


def _state(step: int) -> Any:
    from transformers import TrainerControl, TrainerState

    return TrainerState(global_step=step), TrainerControl()


def _args(output_dir: str) -> Any:
    from tests.support.producers import _training_args_pickle

    # TrainingArguments' __post_init__ needs accelerate, which the test environment lacks.
    return _training_args_pickle(output_dir)


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("trainer-run")
    produce("trainer", str(root / f"checkpoint-{_STEP}"), str(root / "reference.pt"))
    reference: dict[str, Any] = torch.load(root / "reference.pt", weights_only=True)
    return root, reference["model"]


def _load_dir(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(str(path / name)))
    return out


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def test_on_save_consolidates_a_sharded_trainer_checkpoint(
    trainer_run: tuple[Path, dict[str, Any]],
) -> None:
    from transformers import LlamaForCausalLM

    root, reference = trainer_run
    from ckptools.integrations.transformers import CkptoolsCallback

    callback = CkptoolsCallback("hf-test", max_shard_size="2KB")
    state, control = _state(_STEP)
    model = _llama()
    callback.on_save(_args(str(root)), state, control, model=model, processing_class=None)

    out = root / f"checkpoint-{_STEP}" / "hf-test"
    assert callback.last_result is not None and len(callback.last_result.plan.files) > 2
    names = sorted(os.listdir(out))
    assert "config.json" in names and "model.safetensors.index.json" in names
    written = _load_dir(out)
    assert sorted(written) == sorted(reference)
    assert [k for k in reference if not _equal(written[k], reference[k])] == []

    loaded = LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    state_dict = loaded.state_dict()
    assert [k for k in reference if not _equal(state_dict[k], reference[k])] == []


def test_on_save_ignores_a_checkpoint_that_is_not_sharded(tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint-5"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(b"")
    from ckptools.integrations.transformers import CkptoolsCallback

    callback = CkptoolsCallback()
    state, control = _state(5)
    assert callback.on_save(_args(str(tmp_path)), state, control, model=_llama()) is None
    assert callback.last_result is None
    assert sorted(os.listdir(checkpoint)) == ["model.safetensors"]


def _on_save_on_every_rank(rank: int, world_size: int, root: str) -> tuple[int, int]:
    from ckptools.integrations.transformers import CkptoolsCallback

    callback = CkptoolsCallback("{step}-hf", max_shard_size="2KB", dtype="bfloat16")
    state, control = _state(_STEP)
    callback.on_save(_args(root), state, control, model=_llama())
    assert callback.last_result is not None
    return callback.last_result.bytes_written, callback.last_result.cast_tensors


@pytest.mark.distributed
def test_on_save_is_collective_under_a_process_group(
    trainer_run: tuple[Path, dict[str, Any]],
) -> None:
    root, reference = trainer_run
    results = run_ranks(_on_save_on_every_rank, 2, str(root), timeout=120.0)
    assert results[0] == results[1] and results[0][1] == len(reference)
    written = _load_dir(root / f"checkpoint-{_STEP}" / f"{_STEP}-hf")
    assert all(written[k].dtype == torch.bfloat16 for k in reference)
    assert [k for k in reference if not _equal(written[k], reference[k].to(torch.bfloat16))] == []


def test_real_trainer_without_fsdp_leaves_checkpoints_alone(tmp_path: Path) -> None:
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainingArguments

    class Tokens(Dataset[dict[str, torch.Tensor]]):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = torch.arange(i, i + 6) % 37
            return {"input_ids": ids, "labels": ids}

    from ckptools.integrations.transformers import CkptoolsCallback

    callback = CkptoolsCallback()
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=1,
        save_steps=1,
        per_device_train_batch_size=2,
        use_cpu=True,
        report_to=[],
    )
    Trainer(model=_llama(), args=args, train_dataset=Tokens(), callbacks=[callback]).train()
    assert os.path.isdir(tmp_path / "checkpoint-1")
    assert not os.path.exists(tmp_path / "checkpoint-1" / "hf")
    assert callback.last_result is None
