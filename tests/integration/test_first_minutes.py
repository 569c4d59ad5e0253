"""The first ten minutes with ``ckpt`` on real producers' directories: the common wrong turns
(pointing one level too high, a dry run over an existing OUT, a run directory to list) get a
right result or one line that shows the way."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from click.testing import CliRunner

from ckptools.cli.main import cli
from tests.conftest import Produced


def _ckpt(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_the_directory_above_a_checkpoint_names_it_in_one_line(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    src = produced("fsdp2", world_size=2)
    run = tmp_path / "run"
    shutil.copytree(src.path, run / "ckpt")
    (run / "notes.txt").write_text("lr 3e-4\n")
    code, _, err = _ckpt("inspect", str(run))
    assert code == 1
    assert err.splitlines() == [
        f"error: {run} is no checkpoint itself, but {run / 'ckpt'} holds a dcp checkpoint: "
        "point at it (--debug lists why each layout refused the directory)"
    ]
    # the full list of each layout's reason is still there with --debug
    result = CliRunner().invoke(cli, ["inspect", str(run), "--debug"])
    assert "  dcp: " in result.stderr and "  safetensors: " in result.stderr
    # and the way it names works
    assert _ckpt("inspect", str(run / "ckpt"))[0] == 0


def test_a_dry_run_over_an_existing_out_plans_and_says_so(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    src = produced("fsdp2", world_size=2)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    said = f"{out}: already exists; pass --overwrite to replace it (without --dry-run"
    for verb in (["consolidate"], ["reshard", "--world-size", "3"]):
        code, stdout, err = _ckpt(*verb, str(src.path), str(out), "--dry-run")
        assert code == 0, err
        assert said in stdout
        assert "would write" in stdout  # the plan is shown
        assert [p.name for p in out.iterdir()] == ["mine.txt"]
        # a real run still refuses it
        code, _, err = _ckpt(*verb, str(src.path), str(out))
        assert code == 2 and "pass --overwrite" in err
    # with --overwrite the dry run has nothing to say about OUT
    code, stdout, _ = _ckpt("consolidate", str(src.path), str(out), "--dry-run", "--overwrite")
    assert code == 0 and "already exists" not in stdout


def _sizes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def test_list_shows_the_saves_of_a_trainer_output_dir(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    run = tmp_path / "output_dir"
    shutil.copytree(produced("trainer_full").path, run)
    (saved,) = run.glob("checkpoint-*")
    # a later save the job was killed in: its trainer_state.json, no weights yet
    crashed = run / "checkpoint-900"
    crashed.mkdir()
    shutil.copy(saved / "trainer_state.json", crashed)
    code, stdout, err = _ckpt("list", str(run), "--json")
    assert code == 0, err
    listed = [
        (c["name"], c["step"], c["producer"], c["complete"], c["latest"], c["size_bytes"])
        for c in json.loads(stdout)["checkpoints"]
    ]
    step = int(saved.name.split("-")[1])
    assert listed == [
        (saved.name, step, "trainer", True, True, _sizes(saved)),
        ("checkpoint-900", 900, "trainer", False, False, _sizes(crashed)),
    ]
    code, stdout, _ = _ckpt("list", str(run))
    lines = stdout.splitlines()
    assert lines[0] == f"{run} (trainer)"
    assert any(ln.startswith(f"{saved.name} ") and "complete (latest)" in ln for ln in lines)
    assert any(ln.startswith("checkpoint-900 ") and "INCOMPLETE" in ln for ln in lines)
    # what list calls latest is what reading the run directory reads
    code, stdout, _ = _ckpt("inspect", str(run), "--json")
    assert any(f"using {saved.name}" in n for n in json.loads(stdout)["notes"])


def test_consolidate_and_reshard_summaries_have_one_shape(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    src = produced("fsdp2", world_size=2)
    code, out, err = _ckpt("consolidate", str(src.path), str(tmp_path / "hf"), "--weights-only")
    assert code == 0, err
    consolidated = out.splitlines()
    code, out, err = _ckpt("reshard", str(src.path), str(tmp_path / "dcp"), "--world-size", "1")
    assert code == 0, err
    resharded = out.splitlines()
    size = r"[\d.]+ (?:B|KiB|MiB|GiB)"
    shape = re.compile(rf"^  \d+ tensors?, {size} in \d+\.\d\d s(?: \({size}/s\))?")
    for lines in (consolidated, resharded):
        assert " -> " in lines[0]
        assert shape.match(lines[-1]), lines[-1]
        assert "0.00 GB/s" not in lines[-1]
    assert "1 rank file" in "\n".join(resharded) and "1 rank files" not in "\n".join(resharded)


def test_list_shows_the_steps_of_a_torchtitan_checkpoint_folder(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    saved = produced("torchtitan").path  # .../checkpoint/step-N
    run = tmp_path / "checkpoint"
    shutil.copytree(saved.parent, run)
    # a later save cut off before its .metadata (DCP's commit) was written
    cut = run / "step-99"
    shutil.copytree(saved, cut)
    (cut / ".metadata").unlink()
    code, stdout, err = _ckpt("list", str(run), "--json")
    assert code == 0, err
    listed = [
        (c["name"], c["producer"], c["complete"], c["latest"])
        for c in json.loads(stdout)["checkpoints"]
    ]
    assert listed == [
        (saved.name, "torchtitan", True, True),
        ("step-99", "torchtitan", False, False),
    ]


def test_lightnings_checkpoints_folder_is_a_run_of_its_sharded_saves(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    """Lightning's ``FSDPStrategy`` saves its sharded checkpoint as a folder named like a file,
    ``lightning_logs/version_0/checkpoints/epoch=0-step=2.ckpt/``: the ``checkpoints/`` above
    it is no torch.save directory (which read that folder as its one ``.ckpt`` file and failed
    on it, "file is missing"), but ModelCheckpoint's run of saves, read as the newest whole
    one (numbers compared as numbers; an incomplete newer one passed over)."""
    checkpoints = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    for name in ("epoch=0-step=2.ckpt", "epoch=4-step=10.ckpt", "epoch=5-step=12.ckpt"):
        shutil.copytree(produced("lightning").path, checkpoints / name)
    (checkpoints / "epoch=5-step=12.ckpt" / "meta.pt").unlink()  # a save cut short
    code, stdout, err = _ckpt("inspect", str(checkpoints), "--json")
    assert code == 0, err
    report = json.loads(stdout)
    assert report["layout"] == "lightning"
    assert any("using epoch=4-step=10.ckpt" in n for n in report["notes"]), report["notes"]
    hf = tmp_path / "hf"
    code, _, err = _ckpt("consolidate", str(checkpoints), str(hf), "--weights-only")
    assert code == 0, err
    assert (hf / "model.safetensors").is_file()


def test_list_of_lightnings_checkpoints_folder_is_no_nemo_run(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    """NeMo 2 names its saves as Lightning's ModelCheckpoint does (``...-step=N...``) but never
    with ``.ckpt`` (NeMo's ``ckpt_to_dir`` drops it): Lightning's own sharded checkpoint folder
    ``epoch=0-step=2.ckpt/`` was listed as an INCOMPLETE nemo2 save, "no weights/"; it is a
    Lightning save of the run."""
    checkpoints = tmp_path / "checkpoints"
    saved = checkpoints / "epoch=0-step=2.ckpt"
    shutil.copytree(produced("lightning").path, saved)
    code, stdout, err = _ckpt("list", str(checkpoints), "--json")
    assert code == 0, err
    (listed,) = json.loads(stdout)["checkpoints"]
    assert (listed["name"], listed["producer"], listed["step"]) == (saved.name, "lightning", 2)
    assert listed["complete"] is True and listed["latest"] is True


def test_list_of_one_save_names_it_and_its_run(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    """``ckpt list`` pointed at one save rather than its run directory: a Trainer's
    ``checkpoint-N`` was answered with the parts inside it (``ckpt inspect
    checkpoint-2/optimizer_0``, the optimizer alone), a ``dcp.save`` directory with "no saves";
    both now say it is one checkpoint, to inspect, and name the run that lists it."""
    run = tmp_path / "output_dir"
    for n in (2, 10):
        shutil.copytree(produced("trainer").path, run / f"checkpoint-{n}")
    save = run / "checkpoint-2"
    code, stdout, err = _ckpt("list", str(save))
    assert code == 0, err
    assert stdout.splitlines() == [
        f"{save}: one trainer checkpoint, not a run of saves: `ckpt inspect {save}`; "
        f"`ckpt list {run}` lists its run"
    ]
    code, stdout, _ = _ckpt("list", str(save), "--json")
    assert json.loads(stdout)["checkpoint_itself"] == {"layout": "trainer", "run": str(run)}
    plain = produced("fsdp2", world_size=2).path
    code, stdout, _ = _ckpt("list", str(plain))
    assert code == 0
    assert stdout.splitlines() == [
        f"{plain}: one dcp checkpoint, not a run of saves: `ckpt inspect {plain}`"
    ]


def test_prune_at_the_wrong_level_is_refused_not_deleted_nothing(tmp_path: Path) -> None:
    """``ckpt prune`` pointed at one save of a CheckpointManager root, or at the directory
    above the root, reported "deleted 0 checkpoint(s)" and exit 0, as though the policy held;
    it now names the way in one line (exit 2), and the root itself still prunes."""
    import torch

    import ckptools

    root = tmp_path / "exp" / "checkpoints"
    model = torch.nn.Linear(3, 2)
    mgr = ckptools.CheckpointManager(str(root))
    for step in (1, 2, 3):
        mgr.save(step, model)
    mgr.close()
    one = root / "step-2"
    cases = {
        one: f"{one}: holds no CheckpointManager save (step-N/), nothing pruned; it is one dcp "
        "checkpoint, not a CheckpointManager root (the directory holding its step-N saves)",
        root.parent: f"{root.parent}: holds no CheckpointManager save (step-N/), nothing "
        f"pruned; saves lie one level down ({root}): point at the root holding them",
    }
    for where, said in cases.items():
        code, _, err = _ckpt("prune", str(where), "--keep-last", "1")
        assert (code, err.splitlines()) == (2, [f"error: {said}"])
        code, stdout, _ = _ckpt("prune", str(where), "--keep-last", "1", "--json")
        assert json.loads(stdout) == {"error": said, "exit_code": 2}
    assert sorted(p.name for p in root.iterdir()) == ["step-1", "step-2", "step-3"]
    code, stdout, err = _ckpt("prune", str(root), "--keep-last", "1")
    assert code == 0, err
    assert sorted(p.name for p in root.iterdir()) == ["step-3"]
    # an empty directory is a root before its first save: nothing to prune, no error
    (tmp_path / "fresh").mkdir()
    assert _ckpt("prune", str(tmp_path / "fresh"), "--keep-last", "1")[0] == 0
