"""Resumable conversions: a consolidate or reshard killed halfway (SIGKILL, Ctrl-C), run again
into the same destination, keeps the files already written and finishes with output identical
to an uninterrupted run; anything that does not match the journal is written again.

Truth: the same conversion run once without interruption (byte-identical files; DCP's
``.metadata`` differs only by its per-save id, so the data files and the loaded values are
compared), and torch's own ``dcp.load`` against the producer's reference.
"""

from __future__ import annotations

import _thread
import filecmp
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import ckptools
from ckptools.errors import UsageError
from ckptools.io import resume
from ckptools.plan.dcp import plan_dcp
from tests.conftest import Produced
from tests.support.reference import assert_checkpoint_matches, load_reference
from tests.support.s3 import download

ROOT = Path(__file__).resolve().parents[2]
SHARD = "2KB"  # several model files from the tiny producer model (~16 KB)

_KILLER = textwrap.dedent(
    """
    import os, signal, sys
    import ckptools
    from ckptools.io import resume

    record = resume.Journal.record
    count = [0]

    def record_then_die(self, rel, **kw):
        record(self, rel, **kw)
        count[0] += 1
        if count[0] == int(sys.argv[4]):
            os.kill(os.getpid(), signal.SIGKILL)

    resume.Journal.record = record_then_die
    command, src, out = sys.argv[1:4]
    if command == "consolidate":
        ckptools.consolidate(
            src, out, max_shard_size=sys.argv[5], quiet=True, workers=1, weights_only=True
        )
    else:
        ckptools.reshard(src, out, world_size=int(sys.argv[5]), quiet=True, workers=1)
    """
)


def _killed_run(command: str, src: Path, out: Path, after_files: int, arg: str) -> Path:
    """Run the conversion in a child that SIGKILLs itself once ``after_files`` files are
    journaled; return the staging directory it left."""
    proc = subprocess.run(
        [sys.executable, "-c", _KILLER, command, str(src), str(out), str(after_files), arg],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert not out.exists()
    (staging,) = out.parent.glob(f"{out.name}.tmp-*")
    return staging


@pytest.fixture(autouse=True)
def _ctrl_c_raises() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt while a test runs: ``_thread.interrupt_main`` does
    nothing where SIGINT is ignored, as it is in every process of a run started in the
    background by a shell (``make test &``)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupt_after(monkeypatch: pytest.MonkeyPatch, files: int) -> Any:
    """Make Ctrl-C arrive right after the ``files``-th file is journaled; returns the original
    ``Journal.record`` (to put back)."""
    record = resume.Journal.record
    calls = {"n": 0}

    def record_then_interrupt(self: resume.Journal, rel: str, **kw: Any) -> None:
        record(self, rel, **kw)
        calls["n"] += 1
        if calls["n"] == files:
            # as a Ctrl-C does: KeyboardInterrupt in the main thread, whichever thread journals
            _thread.interrupt_main()

    monkeypatch.setattr(resume.Journal, "record", record_then_interrupt)
    return record


def _journal_fingerprint(staging: Path) -> str:
    (part,) = staging.glob(f"{resume.JOURNAL_PREFIX}*.json")
    fp: str = json.loads(part.read_text())["fingerprint"]
    return fp


def _same_files(a: Path, b: Path, names: list[str]) -> None:
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert (sorted(match), mismatch, errors) == (sorted(names), [], [])


@pytest.fixture
def src(produced: Callable[..., Produced]) -> Produced:
    return produced("fsdp2", world_size=2, optimizer=True)


def test_killed_consolidate_resumes_and_matches(src: Produced, tmp_path: Path) -> None:
    clean = tmp_path / "clean"
    ckptools.consolidate(
        str(src.path), str(clean), max_shard_size=SHARD, quiet=True, weights_only=True
    )
    names = sorted(os.listdir(clean))
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) >= 4

    out = tmp_path / "out"
    staging = _killed_run("consolidate", src.path, out, 2, SHARD)
    kept = {n: (staging / n).stat() for n in shards if (staging / n).exists()}
    result = ckptools.consolidate(
        str(src.path), str(out), max_shard_size=SHARD, quiet=True, weights_only=True
    )
    assert any("resumed: 2 file(s)" in n for n in result.notes), result.notes
    assert not staging.exists()  # renamed onto OUT
    assert sorted(os.listdir(out)) == names  # no journal left in the model directory
    _same_files(clean, out, names)
    # the two journaled files were not written again
    rewritten = [n for n, st in kept.items() if (out / n).stat().st_mtime_ns != st.st_mtime_ns]
    assert len(kept) - len(rewritten) == 2


def test_killed_reshard_resumes_and_loads(src: Produced, tmp_path: Path) -> None:
    clean = tmp_path / "clean"
    ckptools.reshard(str(src.path), str(clean), world_size=5, quiet=True)
    out = tmp_path / "out"
    _killed_run("reshard", src.path, out, 3, "5")
    result = ckptools.reshard(str(src.path), str(out), world_size=5, quiet=True)
    assert any("resumed: 3 file(s)" in n for n in result.notes), result.notes
    data = sorted(n for n in os.listdir(clean) if n.endswith(".distcp"))
    assert sorted(os.listdir(out)) == sorted([".metadata", *data])
    _same_files(clean, out, data)
    assert_checkpoint_matches(out, load_reference(src.ref_path))
    assert ckptools.verify(str(out), quiet=True).ok


def test_a_changed_file_or_option_is_not_trusted(src: Produced, tmp_path: Path) -> None:
    clean = tmp_path / "clean"
    ckptools.consolidate(
        str(src.path), str(clean), max_shard_size=SHARD, quiet=True, weights_only=True
    )
    out = tmp_path / "out"
    staging = _killed_run("consolidate", src.path, out, 2, SHARD)
    journaled = [n for n in os.listdir(staging) if n.endswith(".safetensors")]

    # Another option: a different conversion; the interrupted one's directory is left alone.
    other = ckptools.consolidate(
        str(src.path), str(out), max_shard_size="3KB", quiet=True, weights_only=True
    )
    assert not any("resumed" in n for n in other.notes)
    assert staging.exists()
    ckptools.consolidate(
        str(src.path), str(out), max_shard_size=SHARD, quiet=True, overwrite=True, weights_only=True
    )
    # (the overwrite run resumed from the staging directory: it is gone now)
    assert not staging.exists()
    _same_files(clean, out, sorted(os.listdir(clean)))

    # A journaled file damaged after the kill is written again.
    out2 = tmp_path / "out2"
    staging = _killed_run("consolidate", src.path, out2, 2, SHARD)
    done = sorted(n for n in os.listdir(staging) if n in journaled)
    victim = staging / done[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))  # same size, new mtime
    result = ckptools.consolidate(
        str(src.path), str(out2), max_shard_size=SHARD, quiet=True, weights_only=True
    )
    assert any("resumed: 1 file(s)" in n for n in result.notes), result.notes
    _same_files(clean, out2, sorted(os.listdir(clean)))


def test_ctrl_c_keeps_the_files_and_a_rerun_finishes(
    src: Produced, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = _interrupt_after(monkeypatch, 2)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        ckptools.reshard(str(src.path), str(out), world_size=4, quiet=True, workers=1)
    assert not out.exists()
    (staging,) = tmp_path.glob("out.tmp-*")
    # files already written when Ctrl-C came finish their fsync (and are journaled); items
    # not started are cancelled: how many depends on timing with a model this small
    kept = resume.Journal.open(str(staging), _journal_fingerprint(staging)).done_count
    assert 2 <= kept <= 4
    monkeypatch.setattr(resume.Journal, "record", record)
    result = ckptools.reshard(str(src.path), str(out), world_size=4, quiet=True)
    assert any(f"resumed: {kept} file(s)" in n for n in result.notes), result.notes
    assert_checkpoint_matches(out, load_reference(src.ref_path))

    # An error that is not an interrupt still removes everything.
    def fail(self: resume.Journal, rel: str, **kw: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(resume.Journal, "record", fail)
    with pytest.raises(OSError):
        ckptools.reshard(str(src.path), str(tmp_path / "o2"), world_size=4, quiet=True)
    assert not list(tmp_path.glob("o2*"))


def test_a_running_conversion_is_not_resumed_by_another(src: Produced, tmp_path: Path) -> None:
    import fcntl

    out = tmp_path / "out"
    staging = _killed_run("consolidate", src.path, out, 1, SHARD)
    fd = os.open(staging, os.O_RDONLY)  # as the first run would hold it while alive
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(UsageError, match="another ckptools run is writing it"):
            ckptools.consolidate(
                str(src.path), str(out), max_shard_size=SHARD, quiet=True, weights_only=True
            )
    finally:
        os.close(fd)
    ckptools.consolidate(
        str(src.path), str(out), max_shard_size=SHARD, quiet=True, weights_only=True
    )
    assert (out / "model.safetensors.index.json").exists()


def test_interrupted_s3_reshard_resumes_bit_exact(
    src: Produced, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = _interrupt_after(monkeypatch, 2)
    out = f"{s3_bucket}/re"
    with pytest.raises(KeyboardInterrupt):
        ckptools.reshard(str(src.path), out, world_size=5, quiet=True, workers=1)
    assert not ckptools.verify(out, quick=True).ok  # no marker: incomplete, never complete
    monkeypatch.setattr(resume.Journal, "record", record)
    result = ckptools.reshard(str(src.path), out, world_size=5, quiet=True, workers=1)
    # uploads already in flight when Ctrl-C came may have finished too
    kept = [int(n.split()[1]) for n in result.notes if n.startswith("resumed: ")]
    assert len(kept) == 1 and 2 <= kept[0] <= 5, result.notes
    got = tmp_path / "got"
    names = download(out, str(got))
    assert names == [".metadata"] + [f"__{r}_0.distcp" for r in range(5)]
    clean = tmp_path / "clean"
    ckptools.reshard(str(src.path), str(clean), world_size=5, quiet=True)
    _same_files(clean, got, names[1:])
    assert_checkpoint_matches(got, load_reference(src.ref_path))


def test_ctrl_c_inside_an_item_never_journals_its_file(
    src: Produced, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One worker: the interrupt lands in the middle of the last item of rank file 2 (files 0
    # and 1 are done and journaled), after its archive head is written. That file must not be
    # synced and journaled as complete, or the rerun would keep a half-written item.
    from ckptools.engine import dcp_writer

    real = dcp_writer._write_tensor
    manifest = ckptools.read_manifest(str(src.path))
    plan = plan_dcp(manifest, 4)
    last = max((t for t in plan.tensors if t.rank == 2), key=lambda t: t.offset)

    def interrupted(fd: int, item: Any, *args: Any, **kwargs: Any) -> None:
        if item.rank == last.rank and item.offset == last.offset:
            os.pwrite(fd, b"\xff" * 64, item.offset)
            raise KeyboardInterrupt
        real(fd, item, *args, **kwargs)

    monkeypatch.setattr(dcp_writer, "_write_tensor", interrupted)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        ckptools.reshard(str(src.path), str(out), world_size=4, quiet=True, workers=1)
    (staging,) = tmp_path.glob("out.tmp-*")
    journal = resume.Journal.open(str(staging), _journal_fingerprint(staging))
    assert journal.is_done("__1_0.distcp") and not journal.is_done("__2_0.distcp")
    monkeypatch.undo()
    ckptools.reshard(str(src.path), str(out), world_size=4, quiet=True)
    fresh = tmp_path / "fresh"
    ckptools.reshard(str(src.path), str(fresh), world_size=4, quiet=True)
    for r in range(4):
        assert filecmp.cmp(out / f"__{r}_0.distcp", fresh / f"__{r}_0.distcp", shallow=False)


def test_a_run_killed_while_writing_its_first_journal_part_leaves_nothing(
    src: Produced, tmp_path: Path
) -> None:
    # kill -9 between the journal part's temporary file and its rename: the directory holds a
    # `.ckptools-resume-0.json.tmp-<id>` and no journal; nothing in it can be resumed, so the next
    # run removes it (it used to be kept as "another conversion's")
    out = tmp_path / "out"
    dead = tmp_path / "out.tmp-0badf00d"
    dead.mkdir()
    (dead / f"{resume.JOURNAL_PREFIX}0.json.tmp-1234abcd").write_bytes(b'{"format": 1, "fin')
    (dead / "model.safetensors").write_bytes(b"\0" * 100)
    ckptools.consolidate(str(src.path), str(out), quiet=True, weights_only=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
