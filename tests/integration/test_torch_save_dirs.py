"""torch.save checkpoints of one process: the Trainer's and Lightning's, and what a directory of
torch.save files may hold.

The Trainer run and the Lightning run are real (transformers' ``Trainer`` and
``lightning.Trainer.save_checkpoint`` on CPU); the consolidated model equals the model's own
state dict bit for bit and no input byte changes.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import ckptools
from ckptools.errors import CorruptCheckpointError, UnknownFormatError, UnsupportedCheckpointError
from tests.conftest import Produced
from tests.support.producers import iter_files
from tests.support.reference import tensor_bytes


def _hashes(root: Path) -> dict[str, str]:
    return {rel: hashlib.sha256((root / rel).read_bytes()).hexdigest() for rel in iter_files(root)}


def _output(out: Path) -> dict[str, torch.Tensor]:
    got: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(f))
    return got


def _assert_equal(got: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(reference)
    for fqn, expected in reference.items():
        assert got[fqn].dtype == expected.dtype and got[fqn].shape == expected.shape, fqn
        assert torch.equal(tensor_bytes(got[fqn]), tensor_bytes(expected)), fqn


def test_trainer_checkpoint_model_safetensors_and_optimizer_pt(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
    p = produced("trainer_full")
    checkpoint = p.path / "checkpoint-2"
    before = _hashes(p.path)
    report = ckptools.inspect(str(checkpoint)).to_dict()
    assert report["layout"] == "trainer" and report["step"] == 2
    roles = {s["file"]: s["role"] for s in report["sources"]}
    assert roles == {"model.safetensors": "model", "optimizer.pt": "optimizer"}
    [opt] = report["optimizers"]
    # the Trainer's two groups: weight decay for matrices, none for norms and biases
    assert opt["keyed"] == "integer" and opt["param_groups"] == 2
    assert opt["params"] == report["model_part"]["tensors"]
    for src in (checkpoint, p.path):  # the checkpoint, or the output_dir holding it
        out = tmp_path / f"hf-{src.name}"
        ckptools.consolidate(str(src), str(out), quiet=True)
        _assert_equal(_output(out), p.reference()["model"])
    assert ckptools.verify(str(checkpoint)).ok
    assert _hashes(p.path) == before


def test_lightning_ckpt(produced: Callable[..., Produced], tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    p = produced("lightning_ckpt")
    before = _hashes(p.path)
    report = ckptools.inspect(str(p.path)).to_dict()  # the directory holding last.ckpt
    assert report["layout"] == "lightning" and report["step"] == 2
    assert report["model_part"]["prefix"] == "state_dict."
    [opt] = report["optimizers"]
    assert opt["key"] == "optimizer_states.0" and opt["keyed"] == "integer"
    # the LightningModule keeps the model in its ``model`` attribute: that container is the model
    out = tmp_path / "hf"
    ckptools.consolidate(str(p.path / "last.ckpt"), str(out), select="state_dict.model", quiet=True)
    _assert_equal(_output(out), p.reference()["model"])
    assert _hashes(p.path) == before


def _save(path: Path, value: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(value, path)
    return path


def test_net_container_and_bare_directory(tmp_path: Path) -> None:
    sd = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2)}
    _save(tmp_path / "ckpt" / "model.pth", {"net": sd, "opt": {"state": {}, "param_groups": []}})
    report = ckptools.inspect(str(tmp_path / "ckpt")).to_dict()
    assert report["model_part"]["prefix"] == "net."
    assert report["optimizers"][0]["keyed"] == "empty"
    out = tmp_path / "hf"
    ckptools.consolidate(str(tmp_path / "ckpt"), str(out), quiet=True, weights_only=True)
    _assert_equal(_output(out), sd)


@pytest.mark.parametrize(
    "saved",
    [[1, 2], 7, [{"lr": 0.1}], (torch.ones(2), torch.zeros(3))],
    ids=["list", "int", "list-of-dicts", "tuple-of-tensors"],
)
def test_a_file_whose_top_object_is_not_a_dict_is_inspected(tmp_path: Path, saved: Any) -> None:
    # torch.save takes any object; a fuzzed file cut short by a STOP found that one without keys
    # (the whole file one value, at the empty key path) failed inspect with an IndexError
    path = _save(tmp_path / "x.pt", saved)
    report = ckptools.inspect(str(path)).to_dict()
    assert report["optimizers"] == []
    tensors = saved if isinstance(saved, tuple) else ()
    assert len(report["tensors"]) == len(tensors)


def test_directory_with_several_torch_save_files_is_refused_naming_them(tmp_path: Path) -> None:
    for name in ("a.pt", "b.ckpt"):
        _save(tmp_path / "ckpt" / name, {"w": torch.ones(2)})
    with pytest.raises(UnknownFormatError) as info:
        ckptools.read_manifest(str(tmp_path / "ckpt"))
    assert "several torch.save files (a.pt, b.ckpt); point at one" in str(info.value)


def test_hf_directory_with_safetensors_and_bin_stays_safetensors(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    sd = {"w": torch.ones(2, 2)}
    (tmp_path / "hf").mkdir()
    save_file(sd, tmp_path / "hf" / "model.safetensors")
    _save(tmp_path / "hf" / "pytorch_model.bin", {"w": torch.zeros(2, 2)})
    assert ckptools.read_manifest(str(tmp_path / "hf")).format == "safetensors"


def test_model_file_that_is_a_sparse_tensor_is_refused_by_name(tmp_path: Path) -> None:
    path = _save(tmp_path / "sparse.pt", {"model": {"emb": torch.eye(3).to_sparse()}})
    with pytest.raises(UnsupportedCheckpointError, match=r"'model\.emb' is a sparse_coo"):
        ckptools.consolidate(str(path), str(tmp_path / "out"), quiet=True)
    assert not (tmp_path / "out").exists()


def test_tensor_reaching_past_its_record_is_one_error_and_one_verify_finding(
    tmp_path: Path,
) -> None:
    import zipfile

    good = _save(tmp_path / "good.pt", {"model": {"w": torch.arange(64.0)[16:]}})
    bad = tmp_path / "bad.pt"
    # the same archive with the storage record cut to 32 of its 64 floats: the view at offset
    # 16 (48 elements) now reaches past it
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(bad, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            dst.writestr(info.filename, data[:128] if info.filename.endswith("data/0") else data)
    with pytest.raises(CorruptCheckpointError) as info:
        ckptools.read_manifest(str(bad))
    message = str(info.value)
    assert (
        "'model.w'" in message and "reaches past its storage record data/0 (128 bytes)" in message
    )
    report = ckptools.verify(str(bad))
    assert not report.ok and len(report.findings) == 1
    assert "reaches past its storage record" in report.findings[0].message


def test_links_out_of_the_directory_are_never_followed(tmp_path: Path) -> None:
    from ckptools.errors import OutsideCheckpointError

    secret = tmp_path / "secret.json"
    secret.write_text('{"global_step": 99}')
    ckpt = tmp_path / "checkpoint-5"
    _save(ckpt / "pytorch_model.bin", {"w": torch.ones(2)})
    (ckpt / "trainer_state.json").symlink_to(secret)
    report = ckptools.inspect(str(ckpt)).to_dict()
    assert report["layout"] == "trainer" and report["step"] is None  # not read from outside
    _save(tmp_path / "elsewhere.pt", {"state": {}, "param_groups": []})
    (ckpt / "optimizer.pt").symlink_to(tmp_path / "elsewhere.pt")
    with pytest.raises(OutsideCheckpointError):
        ckptools.read_manifest(str(ckpt))


def test_trainer_optimizer_groups_are_placed_by_the_trainers_rule(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    """The Trainer's optimizer.pt has two unnamed groups (weight decay, then none); reshard
    places them by the Trainer's own rule, sizes and shapes checked: every AdamW moment equals
    the live optimizer's, read back with torch's DCP reader."""
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    p = produced("trainer_full")
    out = tmp_path / "dcp"
    ckptools.reshard(str(p.path / "checkpoint-2"), str(out), world_size=2, quiet=True)
    with pytest.warns(UserWarning):  # torch: no process group, loading in one process
        got = _load_state_dict_from_keys(storage_reader=FileSystemReader(str(out)))
    ref = p.reference()["optim"]
    decay, no_decay = ref["param_groups"]
    assert decay and no_decay and all("norm" in n for n in no_decay)  # two real groups
    assert got["optim"]["state"].keys() == ref["state"].keys()
    for fqn, moments in ref["state"].items():
        for name, want in moments.items():
            assert torch.equal(got["optim"]["state"][fqn][name], want), (fqn, name)
    groups = got["optim"]["param_groups"]  # read without a template: keyed "0", "1"
    assert sorted(groups["1"]["params"]) == sorted(no_decay)
    assert groups["1"]["weight_decay"] == 0.0 and groups["0"]["weight_decay"] == 0.01


def _accelerate_save_state(model: torch.nn.Module, out: Path) -> dict[str, dict[str, Any]]:
    """``Accelerator(cpu=True).save_state(out)`` after one AdamW step of ``model`` (accelerate
    without FSDP: ``model.safetensors`` + ``optimizer.bin`` keyed by integer ids, one group);
    returns each parameter's optimizer state by FQN, as the live optimizer holds it."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    names = [n for n, _ in model.named_parameters()]
    try:
        acc = Accelerator(cpu=True)
        prepared, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        inputs = torch.arange(12).reshape(2, 6) % 37
        loss = prepared(input_ids=inputs, labels=inputs).loss if hasattr(
            prepared, "config") else prepared(torch.randn(2, 8)).square().sum()  # fmt: skip
        loss.backward()
        opt.step()
        acc.save_state(str(out))
        state = opt.state_dict()["state"]
    finally:
        AcceleratorState._reset_state(True)
    return {n: {k: v.clone() for k, v in state[i].items()} for i, n in enumerate(names)}


def _resharded_optimizer(src: Path, out: Path, **kwargs: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckptools.reshard(str(src), str(out), world_size=2, quiet=True, **kwargs)
    dcp_to_torch_save(str(out), str(out) + ".pt")
    full = torch.load(str(out) + ".pt", weights_only=False)
    state: dict[str, Any] = full["optim"]["state"]
    return state


def test_accelerate_optimizer_beside_a_sorted_safetensors_model_is_never_placed_by_its_order(
    tmp_path: Path,
) -> None:
    """model.safetensors keeps its tensors sorted by name ('10.weight' before '2.weight', all
    [8, 8]): placing the integer ids by that order would put layer 10's moments on layer 2 with
    every shape agreeing. Refused, naming why; --param-order places them."""
    pytest.importorskip("accelerate")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8, bias=False) for _ in range(12)])
    live = _accelerate_save_state(model, tmp_path / "state")
    with pytest.raises(UnsupportedCheckpointError, match="sorted by name, not in the model's"):
        ckptools.reshard(str(tmp_path / "state"), str(tmp_path / "no"), world_size=2, quiet=True)
    assert not (tmp_path / "no").exists()
    got = _resharded_optimizer(tmp_path / "state", tmp_path / "dcp", param_order=list(live))
    assert got.keys() == live.keys()
    for fqn, want in live.items():
        for name, value in want.items():
            assert torch.equal(got[fqn][name], value), (fqn, name)


def test_accelerate_optimizer_is_placed_by_the_model_its_config_builds(tmp_path: Path) -> None:
    """With the model's config.json beside it, the ids are placed in the order that model's
    named_parameters() gives (built on meta), and each state lands on its own parameter."""
    pytest.importorskip("accelerate")
    from tests.support.producers import _hf_llama

    model = _hf_llama()
    live = _accelerate_save_state(model, tmp_path / "state")
    with pytest.raises(UnsupportedCheckpointError, match=r"no config\.json beside it"):
        ckptools.reshard(str(tmp_path / "state"), str(tmp_path / "no"), world_size=2, quiet=True)
    # the model's config.json as save_pretrained / the Hub give it (naming its architecture),
    # given with --config, then beside the checkpoint
    model.config.architectures = [type(model).__name__]
    (tmp_path / "cfg").mkdir()
    model.config.to_json_file(str(tmp_path / "cfg" / "config.json"))
    given = _resharded_optimizer(tmp_path / "state", tmp_path / "dcp", config=str(tmp_path / "cfg"))
    shutil.copy(tmp_path / "cfg" / "config.json", tmp_path / "state" / "config.json")
    beside = _resharded_optimizer(tmp_path / "state", tmp_path / "dcp2")
    for got in (given, beside):
        assert got.keys() == live.keys()
        for fqn, want in live.items():
            for name, value in want.items():
                assert torch.equal(got[fqn][name], value), (fqn, name)


def test_load_places_the_ids_in_the_jobs_optimizer_order(tmp_path: Path) -> None:
    """ckptools.load into a job places accelerate's integer ids as torch's own
    Optimizer.load_state_dict would: in the job's optimizer's order (its groups as large as
    the source's), needing no config; a job whose groups differ is refused."""
    pytest.importorskip("accelerate")

    def layers() -> torch.nn.Sequential:
        return torch.nn.Sequential(*[torch.nn.Linear(8, 8, bias=False) for _ in range(12)])

    torch.manual_seed(0)
    saved = layers()
    live = _accelerate_save_state(saved, tmp_path / "state")
    torch.manual_seed(1)
    job = layers()
    opt = torch.optim.AdamW(job.parameters(), lr=1e-2)
    ckptools.load(str(tmp_path / "state"), job, opt)
    for fqn, tensor in saved.state_dict().items():
        assert torch.equal(job.state_dict()[fqn], tensor), fqn
    state = opt.state_dict()["state"]
    for i, (fqn, _) in enumerate(job.named_parameters()):
        for name, value in live[fqn].items():
            assert torch.equal(state[i][name], value), (fqn, name)
    params = list(job.parameters())
    split = torch.optim.AdamW([{"params": params[:6]}, {"params": params[6:]}], lr=1e-2)
    with pytest.raises(UnsupportedCheckpointError, match="sorted by name"):
        ckptools.load(str(tmp_path / "state"), job, split)
