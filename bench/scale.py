"""Benchmark: ``ckpt consolidate`` scaled out with torchrun over 1, 2 and 4 processes.

Generates (or reuses) the Llama-shaped fp32 checkpoint of ``bench/consolidate.py`` (model only,
written by 4 real FSDP2 ranks, ~0.5 / 2 / 6 GB), then, alternating, for ``--repeat`` rounds:

* ``cp -r SRC DST`` + ``sync``: the physical floor with the durability ckpt gives its output;
* ``ckpt consolidate SRC OUT --quiet``: one process (the default);
* ``torchrun --nproc-per-node K -m ckptools consolidate SRC OUT --quiet`` for each K in
  ``--procs`` (c10d rendezvous on loopback): every worker copies its byte share of the chunks
  into files rank 0 created, rank 0 writes the index and renames last.

For each: wall time of the whole command (for torchrun: launcher start, rendezvous, every
worker importing torch, the copy, teardown), throughput over the checkpoint's bytes, the time
ckpt itself reports (``seconds`` of rank 0's ``--json``: from the call to the commit, process
group set-up included), the peak RSS summed over the command's processes (each process's own
peak, ``VmHWM``, sampled from ``/proc`` every 20 ms; the launcher counted separately), and the
ratio to ``cp -r`` + ``sync`` of the same bytes in the same run. Under each launcher the same
job without the copy (``verify --quick``: rendezvous, torch import, gloo group, manifest read)
gives torchrun's start-up cost, and the conversion's own time is the difference. The page cache
is warm (the same checkpoint is read every time). Linux only (``/proc``).

Usage::

    python bench/scale.py --size-gb 2.0 --repeat 3 [--procs 1,2,4] [--workdir /tmp/ckbench]

The 405B-shaped checkpoint at 1,024 ranks (metadata over sparse files, for reading and planning
at scale rather than copying) is ``bench/scale_405b.py``: it shares nothing with this script's
real-bytes runs but the subject, and keeping it apart keeps each one's report to one table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# bench/consolidate.py: the checkpoint generator and its helpers
import consolidate as gen

_SAMPLE_S = 0.02


@dataclass
class Run:
    wall_s: float
    ckpt_s: float | None  # rank 0's own "seconds" (None for cp)
    workers_rss: int  # sum over the worker processes of each one's peak RSS
    launcher_rss: int  # torchrun's own peak (0 when there is no launcher)


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(c) for c in f.read().split())
    except OSError:
        pass  # the process has exited
    return out


def _hwm(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _run(cmd: list[str], launcher: bool) -> tuple[float, int, int, str]:
    """Run ``cmd``; wall seconds, summed peak RSS of its worker processes, the launcher's peak,
    and stdout. A sampler thread walks the process tree and keeps each process's peak."""
    peaks: dict[int, int] = {}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            stack = [proc.pid]
            while stack:
                pid = stack.pop()
                peaks[pid] = max(peaks.get(pid, 0), _hwm(pid))
                stack.extend(_children(pid))
            time.sleep(_SAMPLE_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, _ = proc.communicate()
    wall = time.perf_counter() - t0
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    launcher_rss = peaks.pop(proc.pid, 0) if launcher else 0
    return wall, sum(peaks.values()), launcher_rss, stdout


def _ckpt_seconds(stdout: str) -> float | None:
    start = stdout.find("{")  # rank 0's --json report (the other ranks print nothing)
    return float(json.loads(stdout[start:])["seconds"]) if start >= 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size-gb", type=float, default=2.0, choices=sorted(gen.SHAPES))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--procs", default="1,2,4", help="torchrun process counts")
    ap.add_argument("--workers", type=int, default=None, help="copy threads per process")
    ap.add_argument("--workdir", default="/tmp/ckbench")
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoint")
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    src = os.path.join(args.workdir, f"fsdp2-{args.size_gb}gb")
    if not os.path.exists(os.path.join(src, ".metadata")):
        shutil.rmtree(src, ignore_errors=True)
        t = time.perf_counter()
        gen.generate(src, args.size_gb)
        print(f"generated {src} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    nbytes = gen._du(src)
    bin_dir = os.path.dirname(sys.executable)
    out = os.path.join(args.workdir, "scale-out")
    tail = ["consolidate", src, out, "--quiet", "--json"]
    if args.workers:
        tail += ["--workers", str(args.workers)]
    commands: dict[str, tuple[list[str], bool]] = {
        "cp -r + sync": (["sh", "-c", f'cp -r "{src}" "{out}" && sync "{out}"/*'], False),
        "ckpt consolidate (1 process)": ([os.path.join(bin_dir, "ckpt"), *tail], False),
    }
    for k in (int(x) for x in args.procs.split(",")):
        launcher = [
            os.path.join(bin_dir, "torchrun"), f"--nproc-per-node={k}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{gen.free_port()}", "--max-restarts=0", "-m", "ckptools",
        ]  # fmt: skip
        commands[f"torchrun x{k} ckpt consolidate"] = ([*launcher, *tail], True)
        # The same job without the copy: launcher, rendezvous, torch import, gloo group,
        # manifest read. Its wall time is what torchrun costs before any byte moves.
        quick = ["verify", src, "--quick", "--quiet", "--json"]
        commands[f"torchrun x{k} start-up only (verify --quick)"] = ([*launcher, *quick], True)
    env_note = os.environ.get("OMP_NUM_THREADS")
    results: dict[str, list[Run]] = {name: [] for name in commands}
    for _ in range(args.repeat):
        for name, (cmd, launcher) in commands.items():
            shutil.rmtree(out, ignore_errors=True)
            subprocess.run(["sync"], check=True)
            wall, rss, launcher_rss, stdout = _run(cmd, launcher)
            results[name].append(Run(wall, _ckpt_seconds(stdout), rss, launcher_rss))
    shutil.rmtree(out, ignore_errors=True)
    if not args.keep:
        shutil.rmtree(src, ignore_errors=True)
    print(_report(results, nbytes, args, env_note))


def _report(
    results: dict[str, list[Run]], nbytes: int, args: argparse.Namespace, omp: str | None
) -> str:
    floor = statistics.median(r.wall_s for r in results["cp -r + sync"])
    now = datetime.datetime.now(datetime.timezone.utc)
    lines = [
        f"### {nbytes / 1e9:.2f} GB fp32 FSDP2 checkpoint (4 ranks, model only), "
        f"median of {args.repeat} alternating runs",
        "",
        f"{platform.node()}: {os.cpu_count()} CPUs, {platform.platform()}, python "
        f"{platform.python_version()}, {now:%Y-%m-%d %H:%M} UTC; warm page cache"
        + (f"; OMP_NUM_THREADS={omp}" if omp else ""),
        "",
        "| command | wall s | GB/s (wall) | ckpt s | GB/s (ckpt) | peak RSS MiB (sum) | "
        "launcher MiB | × cp+sync |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    startup = {}
    for name, runs in results.items():
        if "start-up only" in name:
            startup[name.split()[1]] = statistics.median(r.wall_s for r in runs)
    for name, runs in results.items():
        wall = statistics.median(r.wall_s for r in runs)
        own = [r.ckpt_s for r in runs if r.ckpt_s is not None]
        ckpt_s = statistics.median(own) if own else None
        rss = max(r.workers_rss for r in runs)
        launcher = max(r.launcher_rss for r in runs)
        moves = "start-up only" not in name  # the start-up rows move no bytes
        lines.append(
            f"| {name} | {wall:.2f} | "
            + (f"{nbytes / wall / 1e9:.2f}" if moves else "-")
            + (f" | {ckpt_s:.2f} | " if ckpt_s is not None else " | - | ")
            + (f"{nbytes / ckpt_s / 1e9:.2f}" if moves and ckpt_s else "-")
            + f" | {rss / 2**20:.0f} | {launcher / 2**20:.0f} | "
            + (f"{wall / floor:.2f} |" if moves else "- |")
        )
    for k, base in startup.items():
        runs = results[f"torchrun {k} ckpt consolidate"]
        copy = statistics.median(r.wall_s for r in runs) - base
        lines.append(
            f"\ntorchrun {k}: {base:.2f} s start-up; the conversion itself ~{copy:.2f} s"
            + (
                f" ({nbytes / copy / 1e9:.2f} GB/s, {copy / floor:.2f}x cp -r + sync)."
                if copy > 0.1 * base
                else " (within the start-up's noise)."
            )
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
