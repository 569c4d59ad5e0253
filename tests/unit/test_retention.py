"""Retention policy (pure) and the torch-free store behind CheckpointManager, ckpt list/prune."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptools.cli.main import cli
from ckptools.errors import UsageError
from ckptools.training import store
from ckptools.training.retention import RetentionPolicy, plan_retention

# ------------------------------------------------------------------------------ policy properties

steps_st = st.lists(st.integers(0, 500), min_size=0, max_size=30, unique=True)
metric_st = st.one_of(
    st.none(), st.floats(allow_nan=True, allow_infinity=True, width=32), st.integers(-5, 5)
)
rule_st = st.one_of(st.none(), st.integers(1, 6))


@st.composite
def cases(draw: st.DrawFn) -> tuple[dict[int, dict[str, object]], RetentionPolicy]:
    steps = draw(steps_st)
    ckpts: dict[int, dict[str, object]] = {}
    for s in steps:
        value = draw(metric_st)
        ckpts[s] = {} if value is None else {"loss": value}
    keep_best = draw(rule_st)
    policy = RetentionPolicy(
        keep_last=draw(rule_st),
        keep_every=draw(rule_st),
        keep_best=keep_best,
        metric="loss" if keep_best is not None else draw(st.sampled_from([None, "loss"])),
        mode=draw(st.sampled_from(["min", "max"])),
    )
    return ckpts, policy


@settings(max_examples=400, deadline=None)
@given(cases())
def test_policy_keeps_what_it_promises(
    case: tuple[dict[int, dict[str, object]], RetentionPolicy],
) -> None:
    ckpts, policy = case
    d = plan_retention(ckpts, policy)
    steps = sorted(ckpts)
    # Partition: every step is either kept or deleted, never both.
    assert sorted(d.keep + d.delete) == steps
    assert not set(d.keep) & set(d.delete)
    if not steps:
        return
    # Never deletes the newest complete checkpoint.
    assert steps[-1] in d.keep
    if not policy.deletes_anything:
        assert d.delete == ()
    if policy.keep_last is not None:
        assert set(steps[-policy.keep_last :]) <= set(d.keep)
        assert len(d.keep) >= min(policy.keep_last, len(steps))
    if policy.keep_every is not None:
        assert {s for s in steps if s % policy.keep_every == 0} <= set(d.keep)
    if policy.keep_best is not None:
        import math

        scored = [
            float(m["loss"])  # type: ignore[arg-type]
            for m in ckpts.values()
            if isinstance(m.get("loss"), (int, float)) and math.isfinite(float(m["loss"]))  # type: ignore[arg-type]
        ]
        kept_best = [s for s in d.keep if "best" in d.reasons[s]]
        assert len(kept_best) == min(policy.keep_best, len(scored))
        # Nothing deleted is strictly better than a checkpoint kept as best.
        sign = 1.0 if policy.mode == "min" else -1.0
        worst_kept = max((sign * float(ckpts[s]["loss"]) for s in kept_best), default=None)  # type: ignore[arg-type]
        for s in d.delete:
            v = ckpts[s].get("loss")
            if worst_kept is not None and isinstance(v, (int, float)) and math.isfinite(float(v)):
                assert sign * float(v) >= worst_kept
    # Every deleted step is unprotected by every rule (no over-deletion).
    for s in d.delete:
        assert policy.keep_last is None or s not in steps[-policy.keep_last :]
        assert policy.keep_every is None or s % policy.keep_every != 0


@settings(max_examples=200, deadline=None)
@given(steps_st, st.integers(1, 5))
def test_repeated_pruning_is_stable(steps: list[int], keep_last: int) -> None:
    # Applying the policy to what it kept deletes nothing more (keep-last only).
    policy = RetentionPolicy(keep_last=keep_last)
    first = plan_retention({s: {} for s in steps}, policy)
    second = plan_retention({s: {} for s in first.keep}, policy)
    assert second.delete == ()


def test_best_ties_go_to_the_newer_step() -> None:
    d = plan_retention(
        {1: {"loss": 1.0}, 2: {"loss": 1.0}, 3: {"loss": 9.0}},
        RetentionPolicy(keep_last=1, keep_best=1, metric="loss"),
    )
    assert d.keep == (2, 3)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"keep_last": 0},
        {"keep_every": -1},
        {"keep_best": 2},
        {"keep_last": True},
        {"mode": "median"},
    ],
)
def test_invalid_policies_are_usage_errors(kwargs: dict[str, object]) -> None:
    with pytest.raises(UsageError):
        RetentionPolicy(**kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------- store on disk


def _fake_checkpoint(
    root: Path, step: int, *, loss: float | None = None, commit: bool = True
) -> str:
    tmp = store.new_tmp_dir(str(root), step)
    os.makedirs(tmp)
    Path(tmp, ".metadata").write_bytes(b"m" * 10)
    Path(tmp, "__0_0.distcp").write_bytes(b"d" * (100 + step))
    store.write_marker(tmp, step=step, world_size=2, metrics={} if loss is None else {"loss": loss})
    if commit:
        store.commit(tmp, store.step_dir(str(root), step))
        return store.step_dir(str(root), step)
    return tmp


def test_marker_records_sizes_and_detects_truncation(tmp_path: Path) -> None:
    path = _fake_checkpoint(tmp_path, 5, loss=float("nan"))
    marker, why = store.read_marker(path)
    assert marker is not None and why == ""
    assert marker["files"] == {".metadata": 10, "__0_0.distcp": 105}
    assert marker["metrics"] == {"loss": "nan"}
    with open(os.path.join(path, "__0_0.distcp"), "r+b") as f:
        f.truncate(50)
    marker, why = store.read_marker(path)
    assert marker is None and "50 bytes" in why
    assert [c.complete for c in store.list_checkpoints(str(tmp_path))] == [False]


def test_clean_stale_rolls_forward_a_marked_tmp_and_removes_the_rest(tmp_path: Path) -> None:
    _fake_checkpoint(tmp_path, 1)
    rolled = _fake_checkpoint(tmp_path, 2, commit=False)  # died between marker and rename
    half = store.new_tmp_dir(str(tmp_path), 3)  # died while writing
    os.makedirs(half)
    Path(half, "__0_0.distcp").write_bytes(b"x")
    os.makedirs(tmp_path / ".tmp-delete-step-0-abc")  # died while deleting
    assert [c.step for c in store.list_checkpoints(str(tmp_path)) if c.complete] == [1]
    handled = store.clean_stale(str(tmp_path))
    assert len(handled) == 3
    assert not os.path.exists(rolled)
    assert sorted(os.listdir(tmp_path)) == ["step-1", "step-2"]
    infos = store.list_checkpoints(str(tmp_path))
    assert [(c.step, c.complete, c.latest) for c in infos] == [(1, True, False), (2, True, True)]


def test_recommit_of_the_same_step_replaces_it(tmp_path: Path) -> None:
    _fake_checkpoint(tmp_path, 4, loss=1.0)
    _fake_checkpoint(tmp_path, 4, loss=2.0)
    (info,) = store.list_checkpoints(str(tmp_path))
    assert info.metrics == {"loss": 2.0}
    assert sorted(os.listdir(tmp_path)) == ["step-4"]


def test_prune_deletes_only_what_policy_drops(tmp_path: Path) -> None:
    for step, loss in [(10, 3.0), (20, 1.0), (30, 2.0), (40, 4.0)]:
        _fake_checkpoint(tmp_path, step, loss=loss)
    dry = store.prune(
        str(tmp_path), RetentionPolicy(keep_last=1, keep_best=1, metric="loss"), dry_run=True
    )
    assert dry.decision.delete == (10, 30)
    assert len(os.listdir(tmp_path)) == 4
    store.prune(str(tmp_path), RetentionPolicy(keep_last=1, keep_best=1, metric="loss"))
    assert sorted(os.listdir(tmp_path)) == ["step-20", "step-40"]


# -------------------------------------------------------------------------------------------- CLI


def test_cli_list_and_prune(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        _fake_checkpoint(tmp_path, step, loss=float(step))
    os.makedirs(store.new_tmp_dir(str(tmp_path), 4))
    runner = CliRunner()
    out = runner.invoke(cli, ["list", str(tmp_path)])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert any(line.startswith("step-3 ") and "complete (latest)" in line for line in lines)
    assert any("INCOMPLETE" in line for line in lines)
    data = json.loads(runner.invoke(cli, ["list", str(tmp_path), "--json"]).output)
    assert [(c["step"], c["complete"]) for c in data["checkpoints"]] == [
        (1, True), (2, True), (3, True), (4, False)
    ]  # fmt: skip
    out = runner.invoke(cli, ["prune", str(tmp_path), "--keep-last", "1", "--dry-run", "--json"])
    assert json.loads(out.output)["delete"] == [1, 2]
    assert len(store.list_checkpoints(str(tmp_path))) == 4
    out = runner.invoke(cli, ["prune", str(tmp_path), "--keep-last", "2"])
    assert out.exit_code == 0 and "deleted: step-1" in out.output
    assert [c.step for c in store.list_checkpoints(str(tmp_path)) if c.complete] == [2, 3]


def test_cli_prune_needs_a_rule_and_list_needs_a_root(tmp_path: Path) -> None:
    out = CliRunner().invoke(cli, ["prune", str(tmp_path)])
    assert out.exit_code == 2 and "--keep-last" in out.output
    out = CliRunner().invoke(cli, ["list", str(tmp_path / "nope")])
    assert out.exit_code == 1 and out.output.startswith("error:")


def test_list_and_prune_do_not_import_torch(tmp_path: Path) -> None:
    _fake_checkpoint(tmp_path, 1)
    root = str(tmp_path)
    code = (
        "import sys\n"
        "from ckptools.cli.main import cli\n"
        f"for args in (['list', {root!r}], ['prune', {root!r}, '--keep-last', '1']):\n"
        "    try:\n"
        "        cli.main(args=args, prog_name='ckpt')\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("NO-TORCH")
