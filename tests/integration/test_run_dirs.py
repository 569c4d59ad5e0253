"""Run directories and their saves, one rule: ``ckpt list RUN`` marks latest the save that
reading ``RUN`` takes (the newest whole one, or the one the producer records), judged whole by
the same check the reader makes, on real producers' directories (a Trainer's checkpoints, a
DeepSpeed run, a CheckpointManager root, ``dcp.save`` per step); and what is no checkpoint at
all (an empty directory, one file of a DeepSpeed save) is one line saying so."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptools.cli.main import cli
from tests.conftest import Produced
from tests.support.deepspeed_producers import case_dir, deepspeed_available, produce_zero

_needs_deepspeed = pytest.mark.skipif(
    not deepspeed_available(), reason="DeepSpeed is not installed (make setup installs it)"
)


def _ckpt(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.stdout, result.stderr


def _listed(root: Path) -> dict[str, dict[str, object]]:
    code, out, err = _ckpt("list", str(root), "--json")
    assert code == 0, err
    return {c["name"]: c for c in json.loads(out)["checkpoints"]}


@pytest.fixture(scope="module")
def zero2_run(cached_output: Callable[..., Path]) -> Path:
    """A ZeRO-2 run DeepSpeed saved at two tags on 2 ranks (``latest`` names global_step2)."""
    from tests.support import deepspeed_producers as ds

    root = cached_output(
        "zero2-two-tags",
        [Path(ds.__file__)],
        lambda d: produce_zero(str(d), 2, [(2, "fp32")], earlier_tag=True),
    )
    return Path(case_dir(str(root), 2, "fp32"))


# --- 3: a ZeRO-1/2 model states file given alone ------------------------------------------------


@_needs_deepspeed
@pytest.mark.parametrize(
    "verb",
    [["inspect"], ["verify"], ["consolidate", "OUT"], ["reshard", "OUT", "--world-size", "1"]],
)
def test_zero2_model_states_file_alone_is_refused_naming_the_directory(
    zero2_run: Path, tmp_path: Path, verb: list[str]
) -> None:
    tag = zero2_run / "global_step2"
    path = tag / "mp_rank_00_model_states.pt"
    args = [verb[0], str(path), *(str(tmp_path / "out") if a == "OUT" else a for a in verb[1:])]
    code, out, err = _ckpt(*args)
    assert code == 2, out + err
    assert err.splitlines() == [
        f"error: {path}: this is one file of the deepspeed checkpoint at {tag}; point at {tag}"
    ]
    assert not (tmp_path / "out").exists()
    # as the other ZeRO files are, and the directory pointed at reads
    other = tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    assert f"point at {tag}" in _ckpt("inspect", str(other))[2]
    assert _ckpt("inspect", str(tag))[0] == 0


@_needs_deepspeed
@pytest.mark.parametrize("verb", [["inspect"], ["consolidate", "OUT"], ["diff", "OTHER"]])
def test_deepspeed_latest_file_is_refused_naming_the_run(
    zero2_run: Path, tmp_path: Path, verb: list[str]
) -> None:
    """``latest`` (the tag record ``save_checkpoint`` writes beside its tags) pointed at names
    the run directory to point at, not "not a checkpoint ckptools recognises"."""
    path = zero2_run / "latest"
    args = [verb[0], str(path)]
    args += [str(tmp_path / "out") if a == "OUT" else str(zero2_run) if a == "OTHER" else a
             for a in verb[1:]]  # fmt: skip
    code, out, err = _ckpt(*args)
    assert code == 2, out + err
    assert err.splitlines() == [
        f"error: {path}: this is one file of the deepspeed checkpoint at {zero2_run}; "
        f"point at {zero2_run}"
    ]
    assert not (tmp_path / "out").exists()


# --- 9: a save missing a rank's file is not latest, and reading takes the one list marks ------


@_needs_deepspeed
def test_deepspeed_save_missing_a_rank_file_is_incomplete_and_reading_takes_the_older(
    zero2_run: Path, tmp_path: Path
) -> None:
    run = tmp_path / "ds"
    shutil.copytree(zero2_run, run)
    (run / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    saves = _listed(run)
    assert saves["global_step2"]["complete"] is False
    assert "rank 1's optimizer file is missing" in str(saves["global_step2"]["reason"])
    assert saves["global_step1"]["complete"] is True and saves["global_step1"]["latest"] is True
    assert saves["global_step1"]["world_size"] == 2
    code, out, err = _ckpt("inspect", str(run), "--json")
    assert code == 0, err
    notes = json.loads(out)["notes"]
    assert any("using global_step1" in n for n in notes), notes
    assert any("names global_step2, which is not whole" in n for n in notes), notes
    # what was read is global_step1: DeepSpeed's own converter of that tag agrees
    hf = tmp_path / "hf"
    code, _, err = _ckpt("consolidate", str(run), str(hf), "-q", "--weights-only")
    assert code == 0, err
    import torch
    from safetensors.torch import load_file

    ours = load_file(str(hf / "model.safetensors"))
    theirs = torch.load(run / "zero_to_fp32-global_step1.pt", weights_only=True)
    for name, want in theirs.items():
        assert torch.equal(ours[name], want), name


def test_trainer_checkpoint_missing_a_distcp_is_incomplete_and_reading_takes_the_older(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    src = produced("trainer").path
    out_dir = tmp_path / "output_dir"
    for n in (1, 2):
        shutil.copytree(src, out_dir / f"checkpoint-{n}")
    (out_dir / "checkpoint-2" / "pytorch_model_fsdp_0" / "__1_0.distcp").unlink()
    saves = _listed(out_dir)
    assert saves["checkpoint-2"]["complete"] is False
    assert "__1_0.distcp missing" in str(saves["checkpoint-2"]["reason"])
    assert saves["checkpoint-1"]["latest"] is True and saves["checkpoint-1"]["world_size"] == 2
    code, out, err = _ckpt("inspect", str(out_dir), "--json")
    assert code == 0, err
    assert any(
        "using checkpoint-1" in n and "ignored: checkpoint-2" in n for n in json.loads(out)["notes"]
    )
    assert _ckpt("verify", str(out_dir))[0] == 0


def test_accelerate_automatic_checkpoint_naming_is_a_run_of_saves(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    # ProjectConfiguration(automatic_checkpoint_naming=True): save_state() writes
    # checkpoints/checkpoint_<i>; the directory was no run, and `ckpt list` of the project
    # suggested checkpoint_0, the oldest
    src = produced("accelerate", world_size=2).path
    runs = tmp_path / "project" / "checkpoints"
    for n in (0, 1, 2):
        shutil.copytree(src, runs / f"checkpoint_{n}")
    (runs / "checkpoint_2" / "optimizer_0" / "__1_0.distcp").unlink()
    saves = _listed(runs)
    assert [saves[f"checkpoint_{n}"]["complete"] for n in (0, 1, 2)] == [True, True, False]
    assert saves["checkpoint_1"]["latest"] is True and saves["checkpoint_1"]["world_size"] == 2
    code, out, err = _ckpt("inspect", str(runs), "--json")
    assert code == 0, err
    assert json.loads(out)["layout"] == "accelerate"
    assert any("using checkpoint_1" in n for n in json.loads(out)["notes"])
    hf = tmp_path / "hf"
    code, out, err = _ckpt("consolidate", str(runs), str(hf), "--weights-only", "-q")
    assert code == 0, err
    ref = produced("accelerate", world_size=2).reference()["model"]
    from safetensors.torch import load_file

    got = load_file(str(hf / "model.safetensors"))
    assert got.keys() == ref.keys() and all(got[k].equal(ref[k]) for k in got)


def test_tag_lists_the_saves_in_numeric_order_and_says_when_there_are_none(
    tmp_path: Path,
) -> None:
    fixture = Path(__file__).resolve().parents[2] / "fixtures" / "verl" / "fsdp2_ws2"
    run = tmp_path / "run"
    for step in (50, 100):
        shutil.copytree(fixture, run / f"global_step_{step}")
    code, _, err = _ckpt("inspect", str(run), "--tag", "global_step_7")
    assert code == 1
    assert "--tag takes one of: global_step_50, global_step_100" in err, err
    (tmp_path / "empty").mkdir()
    code, _, err = _ckpt("inspect", str(tmp_path / "empty"), "--tag", "global_step_7")
    assert code == 1 and "holds no save directory for --tag 'global_step_7'" in err, err


_FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
_NEMO_SAVE = "megatron/nemo/nemo2_tp2/checkpoints/llama--val_loss=4.61-step=9-consumed_samples=10.0"


@pytest.mark.parametrize(
    ("side", "checkpoint", "layout"),
    [
        ("verl/fsdp2_ws2/huggingface", "verl/fsdp2_ws2", "verl"),
        (f"{_NEMO_SAVE}/context", _NEMO_SAVE, "nemo2"),
        (
            "megatron/nemo/bridge_pp2/iter_0000010/tokenizer/tokenizer.json",
            "megatron/nemo/bridge_pp2/iter_0000010",
            "megatron_bridge",
        ),
    ],
)
def test_a_side_folder_of_a_checkpoint_names_the_checkpoint(
    side: str, checkpoint: str, layout: str
) -> None:
    # a producer's side folder (its tokenizer, HF config, NeMo context) got "not a checkpoint
    # ckptools recognises"
    code, _, err = _ckpt("inspect", str(_FIXTURES / side))
    where = _FIXTURES / checkpoint
    assert (code, err) == (
        1,
        f"error: {_FIXTURES / side}: lies inside the {layout} checkpoint at {where}; "
        f"point at {where}\n",
    )


# --- 10: a CheckpointManager root reads as the save list marks latest ---------------------------


def test_manager_root_reads_the_latest_save_in_numeric_order(tmp_path: Path) -> None:
    import torch

    import ckptools

    root = tmp_path / "checkpoints"
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    mgr = ckptools.CheckpointManager(str(root))
    for step in (4, 8, 11, 14):
        with torch.no_grad():
            model.weight.add_(1.0)
        mgr.save(step, model, metrics={"loss": 1.0 / step})
    mgr.close()
    saves = _listed(root)
    assert [n for n, c in saves.items() if c["latest"]] == ["step-14"]
    code, out, err = _ckpt("inspect", str(root), "--json")
    assert code == 0, err
    notes = json.loads(out)["notes"]
    assert any(f"{root}: using step-14, the newest complete of 3" in n for n in notes), notes
    hf = tmp_path / "hf"
    assert _ckpt("consolidate", str(root), str(hf), "-q", "--weights-only")[0] == 0
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(hf / "model.safetensors"))["weight"], model.weight)
    # the text table: every column under a header, the marker's ranks, time and metrics shown
    code, out, _ = _ckpt("list", str(root))
    lines = out.splitlines()
    assert lines[0] == f"{root} (ckptools)"
    assert len(lines[1].split()) == len(lines[2].split()) == 7
    assert "complete (latest)" in lines[-1] and "loss=" in lines[-1]


def test_load_of_a_manager_root_resumes_its_newest_save_with_its_extra(tmp_path: Path) -> None:
    # the root was read through the other-producers path: extra came back as the raw pickled
    # bytes nested under 'extra', and a Stateful given in extra= was never restored
    import torch

    import ckptools

    class Counter:
        def __init__(self, n: int) -> None:
            self.n = n

        def state_dict(self) -> dict[str, int]:
            return {"n": self.n}

        def load_state_dict(self, state: dict[str, int]) -> None:
            self.n = state["n"]

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    root = tmp_path / "checkpoints"
    with ckptools.CheckpointManager(str(root)) as mgr:
        for step in (2, 10):
            mgr.save(step, model, opt, extra={"step": step, "counter": Counter(step)})
    counter = Counter(0)
    fresh = torch.nn.Linear(3, 2)
    got = ckptools.load(str(root), fresh, torch.optim.AdamW(fresh.parameters()),
                        extra={"counter": counter})  # fmt: skip
    assert got == {"step": 10, "counter": {"n": 10}} and counter.n == 10
    assert torch.equal(fresh.weight, model.weight)


def test_plain_dcp_step_run_is_labelled_by_what_reads_it(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    src = produced("fsdp2", world_size=2).path
    run = tmp_path / "checkpoints"
    for n in (4, 11):
        shutil.copytree(src, run / f"step-{n}")
    code, out, _ = _ckpt("list", str(run))
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == f"{run} (dcp)"
    # as many rules as headers; the ranks column filled from the file names
    assert len(lines[1].split()) == len(lines[2].split()) == 5
    assert lines[-1].split()[0] == "step-11" and lines[-1].split()[-1] == "2"
    assert "(latest)" in lines[-1]
    code, out, err = _ckpt("inspect", str(run), "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["layout"] == "dcp"
    assert any("using step-11" in n for n in report["notes"])
    assert _ckpt("inspect", str(run), "--format", "dcp")[0] == 0
    # a real torchtitan run is still torchtitan's
    titan = produced("torchtitan").path.parent
    assert _ckpt("list", str(titan))[1].splitlines()[0] == f"{titan} (torchtitan)"


# --- 16a: an empty directory, and one no layout reads, in one line ---------------------------


@pytest.mark.parametrize("verb", [["inspect"], ["verify"], ["consolidate", "OUT"]])
def test_empty_directory_is_one_line(tmp_path: Path, verb: list[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = _ckpt(verb[0], str(empty), *(str(tmp_path / "out") for _ in verb[1:]))
    assert code == 1
    assert err.splitlines() == [f"error: {empty}: empty directory, no checkpoint here"]


def test_directory_no_layout_reads_is_one_line_reasons_under_debug(tmp_path: Path) -> None:
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("lr 3e-4\n")
    code, _, err = _ckpt("inspect", str(junk))
    assert code == 1
    assert err.splitlines() == [
        f"error: {junk}: not a checkpoint ckptools recognises (--debug lists why each layout "
        "refused it; --format NAME forces one and shows its full error)"
    ]
    result = CliRunner().invoke(cli, ["inspect", str(junk), "--debug"])
    assert "  dcp: " in result.stderr and "  deepspeed: " in result.stderr
