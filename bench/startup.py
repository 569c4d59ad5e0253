"""Benchmark: start-up. ``ckpt --help``, and ``ckpt consolidate`` of a ~100 KB checkpoint up to
the first byte it writes, for this tree and (``--base``) another revision, in alternating runs.

The checkpoint is written by ``dcp.save`` (one process, 10 fp32 tensors of 40x64: 100.8 KiB).
Each run is a fresh ``python -P`` child with only its tree on ``PYTHONPATH`` (each tree's
``ckptools.__file__`` is printed once; trees are byte-compiled first, as an install is). The
first byte written is found with an audit hook installed before ckptools is imported: the
first file opened for writing inside the output's staging directory (``OUT.tmp-*``), where
the child prints its CPU time (``time.process_time``: interpreter start included) and the wall
time since the parent started it. Prints medians and minima; on a shared machine read CPU time.

Usage::

    python bench/startup.py --repeat 9 [--base 85548b2] [--workdir /tmp/ckbench-startup]
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: run in the child: the CLI, with a hook that reports the first write into OUT.tmp-*
HOOK = """
import os, sys, time
started = float(os.environ["CKPT_BENCH_T0"])
seen = []

def hook(event, args):
    if event != "open" or seen or args[0] is None or ".tmp-" not in str(args[0]):
        return
    mode, flags = args[1], args[2]
    writing = (mode and any(c in mode for c in "wa+")) or (
        flags and flags & (os.O_WRONLY | os.O_RDWR)
    )
    if writing:
        seen.append(1)
        cpu, wall = time.process_time(), time.time() - started
        os.write(2, f"FIRST-WRITE cpu={cpu:.4f} wall={wall:.4f}\\n".encode())

sys.addaudithook(hook)
from ckptools.cli import main
main(sys.argv[1:])
"""


def _env(tree: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = tree
    return env


def _export(rev: str, workdir: str) -> str:
    tree = os.path.join(workdir, f"tree-{rev}")
    if not os.path.isdir(tree):
        os.makedirs(tree)
        archive = subprocess.run(
            ["git", "-C", REPO, "archive", rev, "ckptools"], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
    return tree


def _small_checkpoint(path: str) -> None:
    if os.path.exists(os.path.join(path, ".metadata")):
        return
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    state = {"model": {f"layers.{i}.w": torch.randn(40, 64, generator=g) for i in range(10)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=path, no_dist=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default=None, help="a git revision to compare with")
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--workdir", default="/tmp/ckbench-startup")
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    src = os.path.join(args.workdir, "small")
    _small_checkpoint(src)
    out = os.path.join(args.workdir, "out")
    trees = {"this tree": REPO}
    if args.base:
        trees = {f"base {args.base}": _export(args.base, args.workdir), **trees}
    py = [sys.executable, "-P"]
    for label, tree in trees.items():
        subprocess.run([*py, "-m", "compileall", "-q", os.path.join(tree, "ckptools")],
                       env=_env(tree), check=True)  # fmt: skip
        code = "import ckptools; print(ckptools.__file__)"
        where = subprocess.run([*py, "-c", code], env=_env(tree), check=True,
                               capture_output=True, text=True)  # fmt: skip
        print(f"{label}: {where.stdout.strip()}")
    got: dict[str, dict[str, list[float]]] = {k: {} for k in trees}
    for _ in range(args.repeat):
        for label, tree in trees.items():
            shutil.rmtree(out, ignore_errors=True)
            env = {**_env(tree), "CKPT_BENCH_T0": repr(time.time())}
            run = subprocess.run([*py, "-c", HOOK, "consolidate", src, out, "-q"], env=env,
                                 check=True, capture_output=True, text=True)  # fmt: skip
            m = re.search(r"FIRST-WRITE cpu=(\S+) wall=(\S+)", run.stderr)
            assert m, run.stderr
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t = time.perf_counter()
            subprocess.run([*py, "-m", "ckptools", "--help"], env=env, check=True,
                           capture_output=True)  # fmt: skip
            wall = time.perf_counter() - t
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
            for key, value in (("first byte wall", float(m[2])), ("first byte CPU", float(m[1])),
                               ("--help wall", wall), ("--help CPU", cpu)):  # fmt: skip
                got[label].setdefault(key, []).append(value)
    shutil.rmtree(out, ignore_errors=True)
    print(f"\nload average {os.getloadavg()[0]:.1f}; seconds, median (min) of {args.repeat}\n")
    keys = list(next(iter(got.values())))
    print("| tree | " + " | ".join(keys) + " |")
    print("| --- |" + " ---: |" * len(keys))
    for label, values in got.items():
        cells = [f"{statistics.median(values[k]):.3f} ({min(values[k]):.3f})" for k in keys]
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
