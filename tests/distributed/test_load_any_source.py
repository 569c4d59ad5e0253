"""``ckptools.load`` of sources ``save`` did not write, into a real FSDP2 job on gloo ranks.

Each source is written by its producer (verl 0.9.1's checked-in fixtures, torch's own
``dcp.save(use_collectives=False)`` and ``torch.save`` in the test); the job loads it with
``ckptools.load`` and must hold, bit for bit, the producer's gathered model and AdamW state
(``exp_avg``, ``exp_avg_sq``, ``step``), and after one more training step the same state as
the reference job, which resumes the same source through ``ckpt reshard`` + torch's
``dcp.load`` + ``set_state_dict``. A deleted rank file is named.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.utils._pytree import tree_map

import ckptools
from ckptools.errors import CkptError, UsageError
from tests.conftest import Produced
from tests.support.dist import run_ranks
from tests.support.producers import DEFAULT_CONFIG, TinyLlama, _make_optimizer, _train
from tests.support.reference import assert_bitwise_equal, load_reference

pytestmark = pytest.mark.distributed
VERL = Path(__file__).resolve().parents[2] / "fixtures" / "verl"
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _verl_job(world_size: int, config: str) -> tuple[torch.nn.Module, Any, Callable[[], None]]:
    """An FSDP2 job as verl wraps it (each decoder layer, then the root), from the
    checkpoint's own huggingface/config.json, and its training step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**json.loads(Path(config).read_text()))
    model = LlamaForCausalLM(cfg).float()  # type: ignore[no-untyped-call]
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(7))

    def step() -> None:
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad()

    return model, opt, step


def _tiny_job(world_size: int, config: str) -> tuple[torch.nn.Module, Any, Callable[[], None]]:
    """An FSDP2 job of the producers' TinyLlama (blocks, then the root) and its step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = TinyLlama(DEFAULT_CONFIG)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks():  # type: ignore[operator]
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt, _sched = _make_optimizer(model)
    return model, opt, lambda: _train(model, DEFAULT_CONFIG, opt, steps=1)


def _zero_job(world_size: int, config: str) -> tuple[torch.nn.Module, Any, Callable[[], None]]:
    """An FSDP2 job of the DeepSpeed producers' model (tied head, a frozen layer) and its
    AdamW over the trainable parameters, as the producer built it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests.support.deepspeed_producers import _model

    model = _model()
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    tokens = torch.randint(0, 37, (3, 5), generator=torch.Generator().manual_seed(7))

    def step() -> None:
        model(tokens).square().mean().backward()
        opt.step()
        opt.zero_grad()

    return model, opt, step


def _trainer_job(world_size: int, config: str) -> tuple[torch.nn.Module, Any, Callable[[], None]]:
    """An FSDP2 job of the Trainer producer's Llama with the Trainer's two AdamW groups (its
    own ``get_decay_parameter_names``: weight decay 0.01, then none)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import Trainer

    from tests.support.producers import _hf_llama

    model = _hf_llama()
    decay = set(Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": 0.01},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=5e-5)
    tokens = torch.arange(12).reshape(2, 6) % 37

    def step() -> None:
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad()

    return model, opt, step


_JOBS = {"verl": _verl_job, "tiny": _tiny_job, "zero": _zero_job, "trainer": _trainer_job}


def _gather(model: torch.nn.Module, opt: Any) -> dict[str, Any]:
    """The full state, copied: torch returns the live ``step`` tensors, which a step bumps."""
    full = {
        "model": get_model_state_dict(model, options=_FULL),
        "optim": get_optimizer_state_dict(model, opt, options=_FULL),
    }
    copied: dict[str, Any] = tree_map(
        lambda x: x.clone() if isinstance(x, torch.Tensor) else x, full
    )
    return copied


def _job(rank: int, world_size: int, kind: str, config: str, src: str, via: str, out: str) -> None:
    """Every rank: build the job, resume from ``src`` (``via`` ckptools.load, or torch's
    dcp.load of a DCP ckpt reshard wrote), gather, take one step, gather again."""
    model, opt, step = _JOBS[kind](world_size, config)
    if via == "load":
        ckptools.load(src, model, opt)
    else:
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp_load({"model": model_sd, "optim": optim_sd}, checkpoint_id=src)
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    before = _gather(model, opt)
    step()
    after = _gather(model, opt)
    if rank == 0:
        torch.save({"before": before, "after": after}, out)


def _run(kind: str, config: str, src: Path, world_size: int, tmp_path: Path) -> dict[str, Any]:
    """The job through ckptools.load, and the reference job through reshard + dcp.load: both
    states after one more step must agree bit for bit; returns the first's before/after."""
    got, ref = tmp_path / "load.pt", tmp_path / "ref.pt"
    resharded = tmp_path / "resharded"
    ckptools.reshard(str(src), str(resharded), world_size=world_size, quiet=True)
    for via, where, out in (("load", src, got), ("dcp", resharded, ref)):
        run_ranks(_job, world_size, kind, config, str(where), via, str(out), timeout=600)
    loaded: dict[str, Any] = torch.load(got, weights_only=True)
    reference: dict[str, Any] = torch.load(ref, weights_only=True)
    assert_bitwise_equal(loaded["before"], reference["before"], "before")
    assert_bitwise_equal(loaded["after"], reference["after"], "after")
    return loaded


def _check_against(got: dict[str, Any], model: dict[str, Any], optim_state: dict[str, Any]) -> None:
    assert_bitwise_equal(got["before"]["model"], model, "model")
    assert got["before"]["optim"]["state"].keys() == optim_state.keys()
    assert_bitwise_equal(got["before"]["optim"]["state"], optim_state, "optim.state")
    moved = [k for k in model if not torch.equal(got["after"]["model"][k], model[k])]
    assert moved, "one more training step changed nothing"


@pytest.mark.parametrize(
    ("name", "world_size"),
    [
        ("fsdp2_ws2", 2),
        ("fsdp2_ws2", 3),
        ("fsdp1_ws3_tied", 2),
        ("fsdp1_mesh_ws2", 3),
        ("fsdp1_mesh_hsdp_ws4", 2),
        ("fsdp2_hsdp_ws4", 3),
    ],
)
def test_a_verl_run_loads_straight_into_fsdp2(name: str, world_size: int, tmp_path: Path) -> None:
    """FSDP2, HSDP and FSDP1 runs (FSDP1's optimizer: FlatParameter shards placed on their
    parameters; the tied head flattened once; FSDP1 given a device_mesh, as verl runs it:
    DTensors in the model files, HYBRID_SHARD's moments from the first replica group)."""
    src = VERL / name
    got = _run("verl", str(src / "huggingface" / "config.json"), src, world_size, tmp_path)
    ref = load_reference(VERL / f"{name}.reference.pt")
    _check_against(got, ref["model"], ref["optim"]["state"])
    params = [g["optim"]["param_groups"][0]["params"] for g in (got["before"], ref)]
    if name.startswith("fsdp1"):  # FSDP1's own order is FlatParameter by FlatParameter
        params = [sorted(p) for p in params]
    assert params[0] == params[1]


def test_a_rank_local_dcp_loads(produced: Callable[..., Produced], tmp_path: Path) -> None:
    p = produced("fsdp2_rank_local", world_size=2, extra=True)
    got = _run("tiny", "", p.path, 2, tmp_path)
    ref = load_reference(p.ref_path)
    _check_against(got, ref["model"], ref["optim"]["state"])


def test_a_torch_save_training_checkpoint_loads(tmp_path: Path) -> None:
    """A single-process job's ``torch.save({"model", "optimizer", "epoch"})``: integer-keyed
    AdamW state, placed by the model's parameter order."""
    model = TinyLlama(DEFAULT_CONFIG)
    opt, _sched = _make_optimizer(model)
    _train(model, DEFAULT_CONFIG, opt, steps=2)
    src = tmp_path / "train.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 2}, src)
    names = [n for n, _ in model.named_parameters()]
    by_id = opt.state_dict()["state"]
    optim_state = {names[i]: by_id[i] for i in range(len(names))}
    got = _run("tiny", "", src, 2, tmp_path)
    _check_against(got, dict(model.state_dict()), optim_state)
    # and in one process, the other entries come back as extra
    plain = TinyLlama(DEFAULT_CONFIG)
    assert ckptools.load(src, plain, _make_optimizer(plain)[0]) == {"epoch": 2}


def _zero_run(cached_output: Callable[..., Path], stage: int, dtype: str) -> Path:
    """DeepSpeed's ZeRO-``stage`` checkpoint of 2 ranks (made once, kept across runs)."""
    from tests.support import deepspeed_producers as ds

    root = cached_output(
        f"load-zero{stage}-{dtype}",
        [Path(ds.__file__)],
        lambda d: ds.produce_zero(str(d), 2, [(stage, dtype)]),
    )
    return Path(ds.case_dir(str(root), stage, dtype))


@pytest.mark.parametrize(("stage", "dtype"), [(2, "fp32"), (3, "fp32")])
def test_a_deepspeed_checkpoint_loads(
    cached_output: Callable[..., Path], tmp_path: Path, stage: int, dtype: str
) -> None:
    """ZeRO-2 and ZeRO-3 (each parameter cut on its own): model and AdamW state as DeepSpeed's
    live job held them. (A bf16 run's frozen layer has no fp32 master: loading it into an fp32
    job is refused by name, since a resume does not cast.)"""
    from tests.support.deepspeed_producers import deepspeed_available

    if not deepspeed_available():
        pytest.skip("DeepSpeed is not installed (make setup installs it)")
    path = _zero_run(cached_output, stage, dtype)
    got = _run("zero", "", path, 2, tmp_path)
    live = torch.load(path / "live.pt", weights_only=True)
    moments = torch.load(path / "live_optim.pt", weights_only=True)["moments"]
    (step,) = {float(s) for s in torch.load(path / "live_optim.pt", weights_only=True)["steps"]}
    state = got["before"]["optim"]["state"]
    assert state.keys() == live.keys()
    for name, want in live.items():
        assert_bitwise_equal(got["before"]["model"][name], want, name)
        assert_bitwise_equal(
            state[name], {**moments[name], "step": torch.tensor(step)}, f"optim.state.{name}"
        )
    assert_bitwise_equal(got["before"]["model"]["head.weight"], live["embed.weight"], "head")
    assert not torch.equal(got["after"]["model"]["mid.weight"], live["mid.weight"])


def test_a_trainer_checkpoint_loads_with_its_two_optimizer_groups(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    """``optimizer.pt`` of a real Trainer run: integer ids in two unnamed groups, placed by
    the Trainer's own rule on the model of its config.json (sizes and shapes checked)."""
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
    p = produced("trainer_full")
    got = _run("trainer", "", p.path / "checkpoint-2", 2, tmp_path)
    ref = p.reference()
    assert_bitwise_equal(got["before"]["model"], ref["model"], "model")
    assert got["before"]["optim"]["state"].keys() == ref["optim"]["state"].keys()
    assert_bitwise_equal(got["before"]["optim"]["state"], ref["optim"]["state"], "optim.state")
    # the groups' settings are the run's own: its linear schedule ends at lr 0
    groups = got["before"]["optim"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0]
    assert [g["lr"] for g in groups] == [0.0, 0.0]


@pytest.mark.parametrize(("name", "inner"), [("accelerate", ""), ("trainer", "checkpoint-2")])
def test_an_accelerate_or_trainer_save_loads_with_its_optimizer(
    produced: Callable[..., Produced], tmp_path: Path, name: str, inner: str
) -> None:
    """``Accelerator.save_state`` (and the Trainer through it) keeps the optimizer as
    ``dcp.save({"optimizer": ...})`` beside ``{"model": ...}``: the same FQN-keyed state
    ckptools.save keeps under "optim", which load said the save did not hold."""
    p = produced(name, world_size=2)
    src = p.path / inner if inner and (p.path / inner).is_dir() else p.path
    got = tmp_path / "load.pt"
    run_ranks(_job, 3, "tiny", "", str(src), "load", str(got), timeout=600)
    loaded: dict[str, Any] = torch.load(got, weights_only=True)
    _check_against(loaded, p.reference()["model"], p.reference()["optim"]["state"])


def test_a_torchtitan_save_is_named_with_the_way_to_its_model(
    produced: Callable[..., Produced],
) -> None:
    # torchtitan keeps its model at the top level: "holds no 'model' entry (top-level keys:
    # <25 names>); it was not written by ckptools.save" named neither what it is nor a way on
    from ckptools.errors import IncompleteCheckpointError

    step = produced("torchtitan", world_size=2).path  # its step-N/
    model = TinyLlama(DEFAULT_CONFIG)
    said = r"holds no 'model' entry \(top-level keys: .*\.\.\. \(25 in all\)\); it is a torchtitan"
    with pytest.raises(IncompleteCheckpointError, match=said + r".*`ckpt consolidate` reads"):
        ckptools.load(str(step), model)


def test_a_deleted_verl_rank_file_is_named(tmp_path: Path) -> None:
    src = tmp_path / "verl"
    shutil.copytree(VERL / "fsdp2_ws2", src)
    (src / "model_world_size_2_rank_1.pt").unlink()
    model = TinyLlama(DEFAULT_CONFIG)
    with pytest.raises(CkptError, match=r"model_world_size_2_rank_1\.pt"):
        ckptools.load(src, model, _make_optimizer(model)[0])


def test_another_model_is_refused_naming_the_fqn(tmp_path: Path) -> None:
    src = tmp_path / "train.pt"
    model = TinyLlama(DEFAULT_CONFIG)
    torch.save({"model": model.state_dict()}, src)
    other = torch.nn.Linear(3, 2)
    with pytest.raises(UsageError, match=r"train\.pt.*'model\.weight'"):
        ckptools.load(src, other)
    with pytest.raises(CkptError, match="holds no optimizer state"):
        ckptools.load(src, model, _make_optimizer(model)[0])


def test_a_bf16_deepspeed_run_into_an_fp32_job_is_refused_by_name(
    cached_output: Callable[..., Path],
) -> None:
    """A bf16 ZeRO run keeps fp32 masters of its trainable parameters only: the frozen layer
    exists in bf16 alone, and a resume into an fp32 model must refuse it rather than cast."""
    from tests.support.deepspeed_producers import _model, deepspeed_available

    if not deepspeed_available():
        pytest.skip("DeepSpeed is not installed (make setup installs it)")
    path = _zero_run(cached_output, 3, "bf16")
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        UsageError,
        match=r"'model\.frozen\.(weight|bias)' is bfloat16, the job's is "
        r"float32; a resume does not cast",
    ) as err:
        ckptools.load(path, model)
    assert str(err.value).startswith(str(path))  # the file that holds it is named
    # refused before anything was placed: the model is as it was
    assert_bitwise_equal(dict(model.state_dict()), before, "model")
