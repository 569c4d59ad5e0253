"""``torchrun -m ckptools consolidate | reshard | shard | verify``: the real torchrun launcher (c10d
rendezvous on loopback) with 1, 2 and 4 processes, and 2 "nodes" (two launchers sharing one
rendezvous), gives the bytes and the report of one process; a failure on one rank makes every
rank exit non-zero and leaves nothing that looks complete.

The truth is the single-process command, itself proven bit-exact against torch's own loaders by
``tests/integration/test_consolidate.py`` and ``tests/distributed/test_reshard.py``; the resharded
output is also loaded here with torch's ``dcp.load``.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from ckptools.cli.main import cli
from ckptools.verify.checksums import CHECKSUM_FILE, write_checksums
from tests.conftest import Produced
from tests.support import zygote
from tests.support.producers import flip_bit, iter_files
from tests.support.reference import (
    assert_bitwise_equal,
    expected_checkpoints,
    load_reference,
    load_with_dcp,
)

pytestmark = pytest.mark.distributed

#: The launcher: what the ``torchrun`` console script runs (``torch.distributed.run:main``, called
#: as the script calls it), forked from a zygote that has imported torch (~3 s of CPU per
#: launcher, 30 of them). Its workers (``python -u -m ckptools ...``, torchrun's argv and
#: environment) are what is tested. They are forked from the same zygote
#: (``zygote.fork_torchrun_workers``: ~3 s of CPU each, ~60 of them), except under
#: ``fresh_workers=True``, where they are fresh interpreters started by torchrun itself, as under
#: the real ``torchrun`` (``test_shard_is_byte_identical``). Not ``-m torch.distributed.run``:
#: the launcher logs every rendezvous step with ``inspect.stack()``, which walks all of
#: ``sys.modules`` for each frame of a file no module names (runpy's three, under ``-m``), and a
#: zygote child has twice a fresh launcher's modules (tests/support/zygote.py's ``_main``).
_TORCHRUN_SCRIPT = "import sys\nfrom torch.distributed.run import main\nsys.argv[0] = 'torchrun'\n"
LAUNCHER = [sys.executable, "-c", _TORCHRUN_SCRIPT + "sys.exit(main())\n"]
_LAUNCHER_FORKING_WORKERS = [
    sys.executable,
    "-c",
    _TORCHRUN_SCRIPT + f"sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})\n"
    "from tests.support import zygote\n"
    "zygote.fork_torchrun_workers()\n"
    "sys.exit(main())\n",
]
_LAUNCHER_PRELOAD = (*zygote.PRELOAD, "torch.distributed.launcher.api")
#: (nodes, processes per node): 1, 2 and 4 processes on one node, and 2 nodes of 2 processes.
TOPOLOGIES = [
    pytest.param(1, 1, id="1proc"),
    pytest.param(1, 2, id="2procs"),
    pytest.param(1, 4, id="4procs", marks=pytest.mark.slow),
    pytest.param(2, 2, id="2nodes"),
]
_UUID = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_LAUNCH_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Launch:
    """What the torchrun launchers of one job did."""

    returncodes: list[int]  # one per launcher (node)
    output: str  # the launchers' own output (torch's failure summary)
    stdout: list[str]  # every worker's stdout
    stderr: list[str]  # every worker's stderr

    def worker_exitcodes(self) -> dict[int, int]:
        """Global rank -> exit code of every failed worker, from torchrun's failure summary."""
        found = re.findall(
            r"rank\s*:\s*(\d+) \(local_rank.*?\n\s*exitcode\s*:\s*(-?\d+)", self.output
        )
        return {int(r): int(c) for r, c in found}


def torchrun(
    args: list[str],
    tmp: Path,
    *,
    nodes: int = 1,
    nproc: int = 2,
    failing: bool = False,
    fresh_workers: bool = False,
    env: dict[str, str] | None = None,
) -> Launch:
    """Run ``torchrun ... -m ckptools ARGS``: ``nodes`` launchers on localhost (``--nnodes`` and
    ``--node-rank``, one c10d rendezvous endpoint), ``nproc`` workers each; every worker's output
    goes to its own log file. ``failing``: the workers are expected to exit non-zero.
    ``fresh_workers``: torchrun starts each worker as a fresh interpreter (see :data:`LAUNCHER`).
    ``env``: added to the launchers' (and so the workers') environment."""
    port = _free_port()
    logs = [tmp / f"torchrun-logs-{port}-{n}" for n in range(nodes)]
    env = dict(os.environ, CKPTOOLS_NO_PROGRESS="1", OMP_NUM_THREADS="1", **(env or {}))
    procs = []
    launcher = LAUNCHER if fresh_workers else _LAUNCHER_FORKING_WORKERS
    for node in range(nodes):
        cmd = [
            *launcher, f"--nnodes={nodes}", f"--node-rank={node}", f"--nproc-per-node={nproc}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=ckpt-{port}",
            "--max-restarts=0",
            # Where workers fail: long enough that when one worker fails the others finish
            # raising on their own before the launcher would stop them: their exit codes are
            # what is tested. Elsewhere torchrun's default (0.1 s): the launcher sleeps this long
            # between looks at its workers, so 2 s cost every successful launch ~1 s of waiting.
            *(["--monitor-interval=2"] if failing else []),
            f"--log-dir={logs[node]}", "--redirects=3", "-m", "ckptools", *args,
        ]  # fmt: skip
        # stdout and stderr into one file, in the order the launcher wrote them
        with open(tmp / f"launcher-{port}-{node}.log", "wb") as log:
            procs.append(
                zygote.start(cmd, env=env, cwd=os.getcwd(), stdout=log, stderr=log,
                             preload=_LAUNCHER_PRELOAD, siblings=not fresh_workers)
            )  # fmt: skip
    try:
        for p in procs:
            p.wait(timeout=_LAUNCH_TIMEOUT_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outputs = [
        (tmp / f"launcher-{port}-{node}.log").read_text(errors="replace") for node in range(nodes)
    ]
    stdout = [
        Path(f).read_text()
        for f in sorted(glob.glob(f"{tmp}/torchrun-logs-{port}-*/*/*/*/stdout.log"))
    ]
    stderr = [
        Path(f).read_text()
        for f in sorted(glob.glob(f"{tmp}/torchrun-logs-{port}-*/*/*/*/stderr.log"))
    ]
    assert len(stdout) == len(stderr) == nodes * nproc, "\n".join(outputs)
    return Launch([p.returncode for p in procs], "\n".join(outputs), stdout, stderr)


def _ok(launch: Launch) -> dict[str, Any]:
    """The launch succeeded on every worker; exactly one (rank 0) printed, its JSON is returned."""
    assert launch.returncodes == [0] * len(launch.returncodes), launch.output + "".join(
        launch.stderr
    )
    printed = [s for s in launch.stdout if s.strip()]
    assert len(printed) == 1, launch.stdout  # non-zero ranks print nothing
    data: dict[str, Any] = json.loads(printed[0])
    return data


def _one_process(args: list[str]) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(cli, args)
    assert result.exit_code in (0, 3), result.output
    return result.exit_code, json.loads(result.output)


def _tree(root: Path) -> dict[str, Any]:
    """Every file's bytes; DCP's ``save_id`` (a fresh uuid per save) masked in ``.metadata``, and
    the checksum manifest's creation time and digest of ``.metadata`` left out."""
    out: dict[str, Any] = {}
    for rel in iter_files(root):
        data = (root / rel).read_bytes()
        if os.path.basename(rel) == ".metadata":
            masked, n = _UUID.subn(b"0" * 36, data)
            assert n == 1, rel  # exactly the save_id
            out[rel] = masked
        elif os.path.basename(rel) == CHECKSUM_FILE:
            sums = json.loads(data)
            sums.pop("created")
            sums["files"] = {k: v for k, v in sums["files"].items() if not k.endswith(".metadata")}
            out[rel] = sums
        else:
            out[rel] = data
    return out


def _assert_same_tree(got: Path, expected: Path) -> None:
    a, b = _tree(got), _tree(expected)
    assert sorted(a) == sorted(b)
    for rel in b:
        assert a[rel] == b[rel], f"{rel} differs from the single-process output"
    assert not glob.glob(f"{got}.tmp-*")


def _same_report(got: dict[str, Any], expected: dict[str, Any], world: int, *drop: str) -> None:
    """The report of ``world`` processes is one process's, apart from timings and the note that
    says how many processes wrote."""
    if "notes" in got:
        shared = f"written by {world} ranks"
        assert (shared in got["notes"]) == (world > 1), got["notes"]
        # the two runs wrote to different OUTs, which a note may name
        mine = [n.replace(got["out"], "OUT") for n in got["notes"] if n != shared]
        assert mine == [n.replace(expected["out"], "OUT") for n in expected["notes"]]
    for key in ("seconds", "notes", *drop):
        got.pop(key, None)
        expected.pop(key, None)
    assert got == expected


# --------------------------------------------------------------------------------------------------
# Identical output at any number of processes and nodes
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("nodes", "nproc"), TOPOLOGIES)
def test_consolidate_is_byte_identical(
    produced: Callable[..., Produced], tmp_path: Path, nodes: int, nproc: int
) -> None:
    src = str(produced("fsdp2", world_size=4, optimizer=False).path)
    args = [
        "consolidate",
        src,
        "{out}",
        "--max-shard-size",
        "4KB",
        "--json",
        "-q",
        "--weights-only",
    ]
    single = tmp_path / "single"
    _, expected = _one_process([a.replace("{out}", str(single)) for a in args])
    assert len(expected["files"]) >= 3  # several output files, so the ranks' shares differ

    out = tmp_path / "scaled"
    got = _ok(torchrun([a.replace("{out}", str(out)) for a in args], tmp_path, nodes=nodes,
                       nproc=nproc))  # fmt: skip
    _assert_same_tree(out, single)
    _same_report(got, expected, nodes * nproc, "peak_rss_bytes", "gb_per_s", "out")


@pytest.fixture
def checksummed(produced: Callable[..., Produced], tmp_path: Path) -> Produced:
    """An FSDP2 model + optimizer checkpoint (2 ranks) protected by a checksum manifest: its
    reshard writes one too, hashed by every rank."""
    p = produced("fsdp2", world_size=2, optimizer=True)
    src = tmp_path / "src"
    shutil.copytree(p.path, src)
    write_checksums(str(src), quiet=True)
    return Produced(src, p.ref_path)


@pytest.mark.parametrize(("nodes", "nproc"), TOPOLOGIES)
def test_reshard_is_byte_identical(
    checksummed: Produced, tmp_path: Path, nodes: int, nproc: int
) -> None:
    # 5 target files over up to 4 processes: some write two, the balance is by bytes.
    args = ["reshard", str(checksummed.path), "{out}", "--world-size", "5", "--json", "-q"]
    single = tmp_path / "single"
    _, expected = _one_process([a.replace("{out}", str(single)) for a in args])
    assert (single / CHECKSUM_FILE).exists()

    out = tmp_path / "scaled"
    got = _ok(torchrun([a.replace("{out}", str(out)) for a in args], tmp_path, nodes=nodes,
                       nproc=nproc))  # fmt: skip
    _assert_same_tree(out, single)
    _same_report(got, expected, nodes * nproc, "out")
    if nproc * nodes == 4:
        # And, independently: torch's own dcp.load reads every entry back bit-exactly.
        ref = load_reference(checksummed.ref_path)
        assert_bitwise_equal(load_with_dcp(out, ref), expected_checkpoints(ref))
        # The checksum manifest the ranks hashed together is one verify accepts.
        code, report = _one_process(["verify", str(out), "--json", "-q"])
        assert code == 0 and report["checksums_checked"], report["findings"]


def test_a_dry_run_is_planned_once_and_printed_once(checksummed: Produced, tmp_path: Path) -> None:
    # rank 0 alone reads and plans (the other workers end at once: collective.plans_elsewhere)
    args = ["reshard", str(checksummed.path), str(tmp_path / "out"), "--world-size", "5",
            "--dry-run", "--json", "-q"]  # fmt: skip
    _, expected = _one_process(args)
    got = _ok(torchrun(args, tmp_path, nproc=2))
    _same_report(got, expected, 1)
    assert not (tmp_path / "out").exists()


def test_shard_is_byte_identical(produced: Callable[..., Produced], tmp_path: Path) -> None:
    src = str(produced("hf_sharded").path)
    args = ["shard", src, "{out}", "--world-size", "3", "--json", "-q"]
    single = tmp_path / "single"
    _, expected = _one_process([a.replace("{out}", str(single)) for a in args])
    out = tmp_path / "scaled"
    # the one launch whose workers are fresh interpreters, as under the real torchrun
    got = _ok(
        torchrun(
            [a.replace("{out}", str(out)) for a in args], tmp_path, nproc=2, fresh_workers=True
        )
    )
    _assert_same_tree(out, single)
    _same_report(got, expected, 2, "out")


def test_shard_to_megatron_is_byte_identical(tmp_path: Path) -> None:
    # values the plan holds (common_state, the layers' extra states) and the run directory's
    # own markers, which rank 0 writes after the .metadata
    src = str(Path(__file__).resolve().parents[2] / "fixtures" / "megatron" / "hf_qwen2")
    args = ["shard", src, "{out}", "--world-size", "3", "--to", "megatron",
            "--make-vocab-size-divisible-by", "16", "--json", "-q"]  # fmt: skip
    single = tmp_path / "single"
    _, expected = _one_process([a.replace("{out}", str(single)) for a in args])
    out = tmp_path / "scaled"
    got = _ok(torchrun([a.replace("{out}", str(out)) for a in args], tmp_path, nproc=2))
    _assert_same_tree(out, single)
    _same_report(got, expected, 2, "out")


# --------------------------------------------------------------------------------------------------
# verify: the report of one process, damage included
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def damaged(checksummed: Produced, tmp_path: Path) -> Path:
    """The checksummed checkpoint with a bit flipped in a tensor of each rank file: CRC and
    checksum findings in files that different ranks read."""
    import ckptools

    src = tmp_path / "damaged"
    shutil.copytree(checksummed.path, src)
    manifest = ckptools.read_manifest(str(src))
    for rank_file in ("__0_0.distcp", "__1_0.distcp"):
        chunk = max(
            (c for t in manifest.tensors.values() for c in t.chunks if c.file == rank_file),
            key=lambda c: c.length,
        )
        flip_bit(src / rank_file, chunk.offset + chunk.length // 2)
    return src


@pytest.mark.parametrize("state", ["whole", "damaged"])
@pytest.mark.parametrize(("nodes", "nproc"), TOPOLOGIES)
def test_verify_reports_what_one_process_reports(
    checksummed: Produced, damaged: Path, tmp_path: Path, nodes: int, nproc: int, state: str
) -> None:
    path = str(checksummed.path if state == "whole" else damaged)
    args = ["verify", path, "--check-finite", "--json", "-q"]
    code, expected = _one_process(args)
    launch = torchrun(args, tmp_path, nodes=nodes, nproc=nproc, failing=state == "damaged")
    printed = [s for s in launch.stdout if s.strip()]
    assert len(printed) == 1, launch.stdout  # rank 0 reports, the others print nothing
    _same_report(json.loads(printed[0]), expected, nodes * nproc)
    if state == "whole":
        assert code == 0 and expected["checksums_checked"] and expected["findings"] == []
        assert launch.returncodes == [0] * nodes, launch.output
    else:
        kinds = sorted({f["kind"] for f in expected["findings"]})
        files = {f["file"] for f in expected["findings"]}
        assert code == 3 and kinds == ["checksum", "crc"], expected["findings"]
        assert {"__0_0.distcp", "__1_0.distcp"} <= files
        # Every worker found the damage (exit 3), not only the one that printed.
        _assert_every_worker_left(launch, 3, nodes=nodes, nproc=nproc)


# --------------------------------------------------------------------------------------------------
# A failure on one rank: every rank exits non-zero, nothing that looks complete is left
# --------------------------------------------------------------------------------------------------


def _assert_every_worker_left(launch: Launch, code: int, *, nodes: int = 1, nproc: int = 2) -> None:
    """Every worker of every node left with ``code``: none ended 0.

    torchrun SIGTERMs a node's workers still running once its first one has exited, so a worker
    may read -SIGTERM; the first to leave on each node shows the code it decided. (ckptools ends
    every rank at once after the last all-gather, which makes that rare, not impossible.)
    """
    assert all(rc != 0 for rc in launch.returncodes), launch.output
    codes = launch.worker_exitcodes()
    assert sorted(codes) == list(range(nodes * nproc)), launch.output
    assert set(codes.values()) <= {code, -signal.SIGTERM}, launch.output + "".join(launch.stderr)
    for node in range(nodes):
        assert code in [codes[r] for r in range(node * nproc, (node + 1) * nproc)], launch.output


def _assert_all_failed(launch: Launch, code: int = 1) -> None:
    """Both workers of a one-node launch left with ``code`` and printed no result."""
    _assert_every_worker_left(launch, code)
    assert all(s.strip() == "" for s in launch.stdout)


def _assert_nothing_left(out: Path) -> None:
    assert not out.exists()
    assert glob.glob(f"{out}.tmp-*") == []


@pytest.mark.parametrize("command", ["consolidate", "reshard", "shard"])
def test_unwritable_destination_fails_every_rank(
    produced: Callable[..., Produced], tmp_path: Path, command: str
) -> None:
    source = produced("hf_sharded") if command == "shard" else produced("fsdp2", world_size=2,
                                                                        optimizer=True)  # fmt: skip
    # OUT's own name fits (255 bytes), the staging directory's `<out>.tmp-<id>` does not: only
    # rank 0, which makes it, finds out (every rank checks OUT itself before any work)
    out = tmp_path / ("o" * 250)
    extra = ["--world-size", "3"] if command != "consolidate" else ["--weights-only"]
    launch = torchrun(
        [command, str(source.path), str(out), *extra, "-q"], tmp_path, nproc=2, failing=True
    )
    _assert_all_failed(launch, code=2)
    # Rank 1 did nothing wrong: it learnt of rank 0's error and left with it, named by the
    # command that was run (a shard once reported itself as a failed reshard)
    told = f"error: {command} failed on another rank (rank 0)"
    assert any(line.startswith(told) for s in launch.stderr for line in s.splitlines())
    assert any("name is too long" in s for s in launch.stderr)
    assert list(tmp_path.glob("o*")) == []


def _break_archive(path: Path, offset: int, length: int) -> None:
    """Zero the zip end record of the DCP item at ``offset``: the manifest still reads (sizes are
    right), but the item cannot be opened, which only the rank copying it finds out."""
    with open(path, "r+b") as f:
        f.seek(offset + length - 22)
        f.write(bytes(22))


def test_damage_found_by_one_rank_fails_every_rank(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    import ckptools
    from ckptools.engine.collective import balance
    from ckptools.plan.dcp import plan_dcp

    p = produced("fsdp2", world_size=2, optimizer=True)
    src = tmp_path / "src"
    shutil.copytree(p.path, src)
    # A source item that only the files of process 1 need (2 processes, 2 target files).
    plan = plan_dcp(ckptools.read_manifest(str(src)), 2)
    owner = balance(plan.file_sizes, 2)
    used_by_0 = {(c.file, c.offset) for t in plan.tensors if owner[t.rank] == 0 for c in t.sources}
    victim = next(
        c for t in plan.tensors if owner[t.rank] == 1 for c in t.sources
        if (c.file, c.offset) not in used_by_0
    )  # fmt: skip
    _break_archive(src / victim.file, victim.offset, victim.length)

    out = tmp_path / "out"
    launch = torchrun(
        ["reshard", str(src), str(out), "--world-size", "2", "-q"], tmp_path, failing=True
    )
    _assert_all_failed(launch)
    assert any("no zip end record" in s and "another rank" not in s for s in launch.stderr)
    assert any("reshard failed on another rank (rank 1)" in s for s in launch.stderr)
    _assert_nothing_left(out)


#: A ``sitecustomize`` for fresh torchrun workers: an audit hook (``sys.addaudithook``) that
#: appends each file a worker opens, and each directory it lists, below ``$OPENS_UNDER`` to
#: ``$OPENS_LOG/rank<RANK>``. Every Python-level open (``open``, ``io.open``, ``os.open``, which
#: ckptools' local reader uses) and listing raises these events, in the worker itself: test
#: code only, nothing in ckptools knows of it. The launcher (no ``RANK``) records nothing.
_OPENS_HOOK = """
import os, sys
_under, _log, _rank = (os.environ.get(k) for k in ("OPENS_UNDER", "OPENS_LOG", "RANK"))
if _under and _log and _rank is not None:
    _under = _under.rstrip("/") + "/"
    def _record(event, args):
        if event in ("open", "os.listdir", "os.scandir") and args and isinstance(args[0], str):
            path = os.path.abspath(args[0])
            if (path + "/").startswith(_under):
                fd = os.open(f"{_log}/rank{_rank}", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
                try:
                    os.write(fd, f"{event} {path[len(_under):]}\\n".encode())
                finally:
                    os.close(fd)
    sys.addaudithook(_record)
"""


def test_reshard_of_a_wrapper_layout_is_byte_identical_and_read_by_rank_0_alone(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    """HF Trainer: model and optimizer DCP directories, whose rank files are balanced together,
    and the files beside them (trainer state, per-rank RNG state) that rank 0 copies. Rank 0
    alone reads the source's metadata and plans (collective.Ranks.scatter_from_root hands rank
    1 its share): rank 1 opens no file of the source but the ``.distcp`` files it copies from,
    and lists no directory of it, yet writes the same bytes one process writes."""
    src = produced("trainer").path
    args = ["reshard", str(src), "{out}", "--world-size", "3", "--json", "-q"]
    single = tmp_path / "single"
    _, expected = _one_process([a.replace("{out}", str(single)) for a in args])
    assert len(expected["parts"]) == 2 and expected["copied_files"]
    hook, log = tmp_path / "hook", tmp_path / "opens"
    hook.mkdir()
    log.mkdir()
    (hook / "sitecustomize.py").write_text(_OPENS_HOOK)
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": path, "OPENS_UNDER": str(src), "OPENS_LOG": str(log)}
    out = tmp_path / "scaled"
    # fresh interpreters, which import sitecustomize (a zygote's forked workers would not)
    launch = torchrun([a.replace("{out}", str(out)) for a in args], tmp_path, nproc=2, env=env,
                      fresh_workers=True)  # fmt: skip
    got = _ok(launch)
    _assert_same_tree(out, single)
    _same_report(got, expected, 2, "out")

    seen = [set((log / f"rank{r}").read_text().splitlines()) for r in range(2)]
    metadata = {f"open {rel}" for rel in iter_files(src) if os.path.basename(rel) == ".metadata"}
    assert len(metadata) == 2 and metadata <= seen[0]  # the hook sees rank 0 read them
    assert seen[1], "rank 1 read nothing of the source: it copied nothing"
    assert all(s.startswith("open ") and s.endswith(".distcp") for s in seen[1]), seen[1]


@pytest.mark.parametrize("source", ["missing", "hostile"])
def test_a_source_rank_0_cannot_read_fails_every_rank(source: str, tmp_path: Path) -> None:
    """Rank 0 alone reads the source: its error (no checkpoint there; a ``.metadata`` pickle
    that would run code) reaches rank 1, and both exit 1 with one line, writing nothing."""
    from tests.support.producers import malicious_metadata

    src = tmp_path / "src"
    sentinel = malicious_metadata(src) if source == "hostile" else None
    out = tmp_path / "out"
    launch = torchrun(
        ["reshard", str(src), str(out), "--world-size", "3", "-q"], tmp_path, failing=True
    )
    _assert_all_failed(launch)
    own, told = sorted((s.strip() for s in launch.stderr), key=lambda s: "another rank" in s)
    reason = "not on ckptools' allowlist" if source == "hostile" else "no such file or directory"
    assert own.startswith(f"error: {src}") and reason in own, launch.stderr  # rank 0's error
    assert told.startswith("error: reshard failed on another rank (rank 0): "), launch.stderr
    assert reason in told and "\n" not in own + told, launch.stderr  # one line each
    _assert_nothing_left(out)
    assert sentinel is None or not os.path.exists(sentinel)


def test_consolidate_to_an_object_store_under_torchrun_is_refused_on_every_rank(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    # Ranks write byte ranges of shared files, which no object can take: a usage error, decided
    # alike on every rank before anything is written (memory:// is an fsspec store too).
    src = str(produced("fsdp2", world_size=4, optimizer=False).path)
    launch = torchrun(
        ["consolidate", src, "memory://bucket/hf", "-q", "--weights-only"], tmp_path, failing=True
    )
    _assert_all_failed(launch, 2)
    assert all("local or shared directory" in s for s in launch.stderr)
