"""How a run's outer directory resolves to one numbered checkpoint (``newest_numbered``)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptools.errors import IncompleteCheckpointError
from ckptools.producers.run_dirs import newest_numbered

STEP = re.compile(r"^step-(\d+)$")


def _run(tmp_path: Path, steps: range, complete: set[int]) -> tuple[Path, list[str]]:
    for n in steps:
        (tmp_path / f"step-{n}").mkdir()
        if n in complete:
            (tmp_path / f"step-{n}" / "done").write_text("")
    looked: list[str] = []
    return tmp_path, looked


def _complete(looked: list[str]) -> Callable[[str], bool]:
    def check(path: str) -> bool:
        looked.append(Path(path).name)
        return (Path(path) / "done").exists()

    return check


def test_numbers_not_names_order_and_only_newer_ones_are_looked_into(tmp_path: Path) -> None:
    # step-100 sorts before step-20 by name; 120 and 119 are cut off
    run, looked = _run(tmp_path, range(1, 121), set(range(1, 119)))
    chosen = newest_numbered(str(run), STEP, _complete(looked), "no done file")
    assert chosen is not None and chosen.name == "step-118"
    assert looked == ["step-120", "step-119", "step-118"]  # not 120 listings
    assert chosen.skipped == ("step-119", "step-120")
    assert "using step-118, the newest complete of 120 checkpoints" in chosen.note()


def test_the_producers_record_wins_when_complete(tmp_path: Path) -> None:
    run, looked = _run(tmp_path, range(1, 6), {1, 2, 3, 4, 5})
    chosen = newest_numbered(str(run), STEP, _complete(looked), "", prefer=("step-3", "latest"))
    assert chosen is not None and chosen.name == "step-3" and looked == ["step-3"]
    assert "(newer than that record, ignored: step-4, step-5)" in chosen.note()
    looked.clear()
    gone = newest_numbered(str(run), STEP, _complete(looked), "", prefer=("step-9", "latest"))
    assert gone is not None and gone.name == "step-5"


def test_none_complete_names_them_all(tmp_path: Path) -> None:
    run, looked = _run(tmp_path, range(1, 3), set())
    with pytest.raises(IncompleteCheckpointError, match="none of step-1, step-2 is complete"):
        newest_numbered(str(run), STEP, _complete(looked), "no done file")
    assert newest_numbered(str(tmp_path / "step-1"), STEP, _complete(looked), "") is None


def test_a_save_the_run_readers_know_is_a_numbered_save_to_the_config_search() -> None:
    """``layouts.numbered`` lists the patterns apart from the readers (finding a config must not
    import them all): every producer whose saves ``layouts.saves`` reads is in that list, so
    ``consolidate`` finds the run's config from any of their saves."""
    from ckptools.producers import numbered, registry, saves

    assert {s.pattern for _, s in saves.producers()} == set(registry.declared("SAVES"))
    for name in ("checkpoint-500", "global_step7", "global_step_7", "step-10", "iter_0000010"):
        assert numbered.is_numbered_save(name), name
    assert not numbered.is_numbered_save("iter_10") and not numbered.is_numbered_save("hf_model")
