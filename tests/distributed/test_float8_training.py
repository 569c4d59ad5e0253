"""torchao float8 training checkpoints (``convert_to_float8_training`` with FSDP2 float8
all-gather): DCP items that pickle ``WeightWithDynamicFloat8CastTensor`` are read as the plain
weight each wraps, bit-exactly, without importing torchao. consolidate, reshard (plain items a
plain FSDP2 job ``dcp.load``s with torchao unimportable, the AdamW moments included), verify,
diff (identical to a plain save of the same weights) and inspect ("float8 training wrapper");
any other torchao tensor is still refused by name. The checkpoints are torchao's own
(tests/support/float8_producers.py), the truth its own ``weight._tensor``."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

import ckptools
from ckptools.cli.main import cli
from ckptools.errors import UnsafeCheckpointError
from tests.support import float8_producers
from tests.support.dist import run_ranks
from tests.support.reference import assert_bitwise_equal

pytestmark = pytest.mark.distributed

_SOURCES = [Path(float8_producers.__file__)]


@pytest.fixture(scope="module")
def single(cached_output: Callable[..., Path]) -> Path:
    """``float8/`` (one process's ``dcp.save`` of the wrapped bf16 model), ``plain/``,
    ``truth.pt``."""
    return cached_output("float8-one-process", _SOURCES, float8_producers.one_process)


@pytest.fixture(scope="module")
def ranks(cached_output: Callable[..., Path]) -> Path:
    """``ckpt/`` (the 2-rank FSDP2 float8 job with AdamW) and ``truth.pt``."""
    return cached_output("float8-fsdp2-2", _SOURCES, float8_producers.produce_fsdp2)


def _truth(root: Path) -> dict[str, torch.Tensor]:
    truth: dict[str, torch.Tensor] = torch.load(root / "truth.pt", weights_only=True)
    return truth


def test_consolidate_is_the_wrapped_weight_bit_exact(single: Path, tmp_path: Path) -> None:
    ckptools.consolidate(
        str(single / "float8"), str(tmp_path / "hf"), weights_only=True, quiet=True
    )
    out = load_file(str(tmp_path / "hf" / "model.safetensors"))
    truth = _truth(single)
    assert truth["0.weight"].dtype == torch.bfloat16
    assert_bitwise_equal(out, truth)


def test_consolidate_of_the_fsdp2_job_is_its_weights_and_moments(
    ranks: Path, tmp_path: Path
) -> None:
    ckptools.consolidate(
        str(ranks / "ckpt"), str(tmp_path / "hf"), weights_only=True, key="model", quiet=True
    )
    out = load_file(str(tmp_path / "hf" / "model.safetensors"))
    truth = _truth(ranks)
    assert_bitwise_equal(
        out, {k[len("model.") :]: v for k, v in truth.items() if k[:6] == "model."}
    )


def test_diff_calls_it_identical_to_a_plain_save_and_verify_passes(single: Path) -> None:
    report = ckptools.diff(str(single / "float8"), str(single / "plain"))
    assert report.identical, [t.describe() for t in report.differences]
    assert {t.status for t in report.tensors} == {"equal"}
    assert len(report.tensors) == 3
    assert ckptools.verify(str(single / "float8"), quiet=True).ok


def test_verify_reads_every_item_of_the_fsdp2_job(ranks: Path) -> None:
    report = ckptools.verify(str(ranks / "ckpt"), quiet=True)
    assert report.ok, report.to_dict()


def test_inspect_names_the_wrapped_tensors(ranks: Path) -> None:
    text = CliRunner().invoke(cli, ["inspect", str(ranks / "ckpt")])
    assert text.exit_code == 0, text.output
    assert (
        "float8 training wrapper: 2 tensor(s) stored as torchao WeightWithDynamicFloat8CastTensor"
        in text.output
    )
    as_json = CliRunner().invoke(cli, ["inspect", str(ranks / "ckpt"), "--json"])
    facts = json.loads(as_json.output)["float8_training"]
    cls = "torchao.float8.fsdp_utils.WeightWithDynamicFloat8CastTensor"
    assert facts == {
        "label": "float8 training wrapper",
        "tensors": {"model.0.weight": cls, "model.2.weight": cls},
        "classes": {cls: 2},
    }
    shown = {t["fqn"]: t["dtype"] for t in json.loads(as_json.output)["tensors"]}
    assert shown["model.0.weight"] == "float32"


def test_inspect_of_a_plain_save_says_nothing_of_float8(single: Path) -> None:
    as_json = CliRunner().invoke(cli, ["inspect", str(single / "plain"), "--json"])
    assert json.loads(as_json.output)["float8_training"] is None


_LOAD_WITHOUT_TORCHAO = """
import sys
sys.modules["torchao"] = None  # importing torchao now fails, as where it is not installed
import torch, torch.distributed.checkpoint as dcp
from tests.support.float8_producers import plain_model
model = plain_model(torch.bfloat16)
state = model.state_dict()
dcp.load(state, checkpoint_id=sys.argv[1], no_dist=True)
model.load_state_dict(state)
torch.save(model.state_dict(), sys.argv[2])
"""


def _load_without_torchao(path: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _LOAD_WITHOUT_TORCHAO, str(path), str(out)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[2],
        timeout=120,
    )


def test_reshard_writes_plain_items_a_model_without_torchao_loads(
    single: Path, tmp_path: Path
) -> None:
    # torch's own dcp.load of the float8 save needs torchao
    refused = _load_without_torchao(single / "float8", tmp_path / "x.pt")
    assert refused.returncode != 0 and "torchao" in refused.stderr
    ckptools.reshard(str(single / "float8"), str(tmp_path / "r"), world_size=3, quiet=True)
    loaded = _load_without_torchao(tmp_path / "r", tmp_path / "loaded.pt")
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert_bitwise_equal(torch.load(tmp_path / "loaded.pt", weights_only=True), _truth(single))
    assert b"torchao" not in b"".join(p.read_bytes() for p in (tmp_path / "r").glob("*.distcp"))


def test_reshard_of_the_fsdp2_job_resumes_in_a_plain_fsdp2_job(ranks: Path, tmp_path: Path) -> None:
    """2 float8 ranks -> 3: a plain FSDP2 job at world size 2 (torchao unimportable) loads the
    weights and the AdamW moments, bit for bit the float8 job's."""
    out = tmp_path / "r3"
    ckptools.reshard(str(ranks / "ckpt"), str(out), world_size=3, quiet=True)
    assert ckptools.verify(str(out), quiet=True).ok
    run_ranks(float8_producers.load_plain_fsdp2, 2, str(out), str(tmp_path / "held.pt"))
    held = torch.load(tmp_path / "held.pt", weights_only=True)
    truth = _truth(ranks)
    assert set(held) == set(truth)
    assert_bitwise_equal(held, truth)


def test_other_torchao_tensors_are_still_refused_by_name(tmp_path: Path) -> None:
    """A real torchao ``Float8Tensor`` (``Float8WeightOnlyConfig``) in a DCP item holds float8
    data and a scale, not a plain weight: refused, naming the class."""
    import torch.distributed.checkpoint as dcp
    from torchao.quantization import Float8WeightOnlyConfig, quantize_

    model = torch.nn.Sequential(torch.nn.Linear(32, 16)).to(torch.bfloat16)
    quantize_(model, Float8WeightOnlyConfig())
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "q"), no_dist=True)
    with pytest.raises(UnsafeCheckpointError, match=r"torchao\.quantization\.Float8Tensor"):
        ckptools.consolidate(str(tmp_path / "q"), str(tmp_path / "o"), weights_only=True)
    assert not (tmp_path / "o").exists()
