"""The zygote (``tests/support/zygote.py``) that the kill sweeps and SIGKILL soaks fork their
processes from: each child behaves as the ``python -m`` / ``python -c`` it stands for, as far as
those tests can tell: its own pid, the test's environment, working directory and argv, ckptools
imported afresh from this tree, exit codes, and death by SIGKILL or Ctrl-C as a real interpreter
dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support import zygote

ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import json, os, sys
import ckptools
print(json.dumps({
    "pid": os.getpid(), "ppid": os.getppid(), "cwd": os.getcwd(), "argv": sys.argv,
    "probe": os.environ.get("ZYGOTE_PROBE"), "name": __name__,
    "ckptools": ckptools.__file__, "torch_loaded": "torch" in sys.modules,
}))
sys.exit(int(os.environ.get("ZYGOTE_EXIT", "0")))
"""


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


def test_a_child_is_its_own_process_in_the_tests_environment(tmp_path: Path) -> None:
    done = zygote.run(
        [sys.executable, "-c", _PROBE, "a", "b"],
        env=_env(ZYGOTE_PROBE="x", ZYGOTE_EXIT="7"),
        cwd=str(tmp_path),
        timeout=120,
    )
    assert done.returncode == 7, done.stderr
    seen = json.loads(done.stdout)
    assert seen["pid"] not in (os.getpid(), None) and seen["ppid"] != os.getpid()
    assert (seen["cwd"], seen["argv"], seen["probe"]) == (str(tmp_path), ["-c", "a", "b"], "x")
    assert seen["name"] == "__main__"
    # torch came preloaded; ckptools was imported by the child, from this tree
    assert seen["torch_loaded"]
    assert seen["ckptools"] == str(ROOT / "ckptools" / "__init__.py")
    # a second child is another process, from the same zygote
    again = zygote.run([sys.executable, "-c", _PROBE], env=_env(), cwd=str(ROOT), timeout=120)
    assert json.loads(again.stdout)["pid"] != seen["pid"]
    assert json.loads(again.stdout)["ppid"] == seen["ppid"]


def test_python_m_ckptools_runs_the_cli(tmp_path: Path) -> None:
    done = zygote.run(
        [sys.executable, "-m", "ckptools", "inspect", str(tmp_path / "missing")],
        env=_env(),
        cwd=str(ROOT),
        timeout=120,
    )
    real = subprocess.run(
        [sys.executable, "-m", "ckptools", "inspect", str(tmp_path / "missing")],
        env=_env(),
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stdout, done.stderr) == (
        real.returncode,
        real.stdout,
        real.stderr,
    )
    assert done.returncode == 1 and done.stderr.startswith("error: ")


def test_signals_end_a_child_as_they_end_an_interpreter(tmp_path: Path) -> None:
    code = "import time\nprint('ready', flush=True)\ntime.sleep(60)"
    # A shell starts a background job with SIGINT ignored, and processes inherit that: then an
    # interpreter started by this test would ignore Ctrl-C, and so must the zygote's child.
    ctrl_c_ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    cases = [(signal.SIGKILL, -signal.SIGKILL, b""), (signal.SIGINT, None, b"")]
    if not ctrl_c_ignored:
        cases[1] = (signal.SIGINT, -signal.SIGINT, b"KeyboardInterrupt\n")
    for sig, code_after, stderr_tail in cases:
        child = zygote.start(
            [sys.executable, "-c", code],
            env=_env(),
            cwd=str(tmp_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert child.stdout is not None and child.stderr is not None
        assert child.stdout.readline() == b"ready\n"
        assert child.poll() is None
        child.send_signal(sig)
        if code_after is None:  # ignored: still running a second later
            time.sleep(1.0)
            assert child.poll() is None
            child.kill()
            child.wait(timeout=30)
        else:
            assert child.wait(timeout=30) == code_after
        assert child.stderr.read().endswith(stderr_tail)
        child.stdout.close()
        child.stderr.close()


def test_only_an_environment_read_at_import_needs_another_zygote() -> None:
    base = zygote.import_time_env(_env())
    # OpenMP's thread count is read when torch's libraries load: another zygote
    assert zygote.import_time_env(_env(OMP_NUM_THREADS="3")) != base
    # what ckptools reads is read by the child, which imports ckptools itself: the same one
    assert zygote.import_time_env(_env(CKPTOOLS_SPOOL_DIR="/x", CKPTOOLS_NO_PROGRESS="1")) == base


_WORKER = """
import json, os, sys
print(json.dumps({
    "pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0), "argv": sys.argv,
    "rank": os.environ.get("RANK"), "torch_loaded": "torch" in sys.modules,
    "unbuffered": sys.stdout.write_through, "raw": type(sys.stdout.buffer).__name__,
}))
"""

# In a child started with siblings=True: torchrun's own SubprocessHandler, whose Popen
# fork_torchrun_workers replaced, starts three workers and stops one as torchrun does.
_LAUNCHER = """
import json, os, sys, time
from tests.support import zygote
zygote.fork_torchrun_workers()
from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import (
    SubprocessHandler,
)
out, probe = sys.argv[1], sys.argv[2]
def worker(name, code, **env):
    return SubprocessHandler(sys.executable, ("-u", "-c", code, name), env=env,
                             stdout=f"{out}/{name}.out", stderr=f"{out}/{name}.err",
                             local_rank_id=0, numa_options=None)
done = worker("probe", probe, RANK="1", TORCH_NCCL_ASYNC_ERROR_HANDLING="1")
sleeper = worker("sleeper", "import time; time.sleep(60)")
seen = {"launcher": os.getpid(), "probe_exit": done.proc.wait(timeout=60)}
assert sleeper.proc.poll() is None
try:
    sleeper.proc.wait(timeout=0.2)
except Exception as e:
    seen["timeout"] = type(e).__name__
sleeper.close()  # os.killpg(pid, SIGTERM), as torchrun stops its workers
seen["sleeper_exit"] = sleeper.proc.wait(timeout=60)
try:
    worker("other", probe, OMP_NUM_THREADS="7")
except RuntimeError as e:
    seen["refused"] = str(e)
print(json.dumps(seen))
"""


def test_a_child_with_siblings_has_torchruns_workers_forked_by_the_zygote(tmp_path: Path) -> None:
    done = zygote.run(
        [sys.executable, "-c", _LAUNCHER, str(tmp_path), _WORKER],
        env=_env(OMP_NUM_THREADS="1"),
        cwd=str(ROOT),
        timeout=120,
        siblings=True,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    worker = json.loads((tmp_path / "probe.out").read_text())
    # a process of its own, forked by the zygote (the launcher's sibling), not by the launcher
    assert worker["ppid"] != seen["launcher"] and worker["pid"] != seen["launcher"]
    assert worker["torch_loaded"] and worker["rank"] == "1"
    assert worker["argv"] == ["-c", "probe"]
    # a session of its own (torchrun stops workers with killpg), stdout unbuffered as under -u
    assert worker["sid"] == worker["pid"]
    assert worker["unbuffered"] and worker["raw"] == "FileIO"
    assert seen["probe_exit"] == 0
    assert seen["timeout"] == "TimeoutExpired"
    assert seen["sleeper_exit"] == -signal.SIGTERM
    # an environment that torch reads when imported is not the zygote's: refused, by name
    assert "OMP_NUM_THREADS" in seen["refused"], seen
