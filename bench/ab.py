"""Benchmark: two revisions of ckptools in the same run (a refactor must not cost speed).

Generates (or reuses) the Llama-shaped fp32 checkpoint of ``bench/consolidate.py`` (4 real FSDP2
ranks), or takes any checkpoint with ``--src`` (e.g. one ``bench/per_rank.py --keep`` wrote),
exports revision ``--base`` (and ``--head``, default: this working tree) into scratch
directories, then alternates, for ``--repeat`` rounds, ``cp -r`` + ``sync`` of the same bytes
and the same commands from both trees:

* ``ckpt consolidate SRC OUT --quiet``
* ``ckpt reshard SRC OUT --world-size 8 --quiet``
* ``ckpt verify SRC --quiet``

Each command runs in a fresh child started as ``python -P`` with only its tree on
``PYTHONPATH`` (without ``-P`` a run from the repository root imports the working tree's
ckptools for both revisions); each tree's child prints ``ckptools.__file__`` once, first, so
the report shows which code ran. Wall time (start-up included), CPU time (user + sys, steadier
than wall on a shared machine) and peak RSS are those of the child. Ratios are medians of
same-round ratios. Prints one table and the ratios. ``--cold`` empties the page cache (``sync``,
then ``3`` into ``/proc/sys/vm/drop_caches``: root only) before every command, so each reads
the source, and the interpreter and its imports, from disk. ``--rotate`` starts round r with its
r-th run, so that every run takes each place in a round equally often.

Usage::

    python bench/ab.py --base da620c1 --size-gb 2.0 --repeat 5 [--commands consolidate] [--cold]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
import consolidate as gen  # the generator

COMMANDS = {
    "consolidate": lambda src, out: ["consolidate", src, out, "--quiet"],
    "reshard 4->8": lambda src, out: ["reshard", src, out, "--world-size", "8", "--quiet"],
    "verify": lambda src, out: ["verify", src, "--quiet"],
}

_MEASURE = (
    "import json, resource, subprocess, sys, time\n"
    "t = time.perf_counter()\n"
    "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)\n"
    "dt = time.perf_counter() - t\n"
    "ru = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
    "print(json.dumps([dt, ru.ru_utime + ru.ru_stime, ru.ru_maxrss / 1024]))\n"
)


def _measure(
    cmd: list[str], env: dict[str, str] | None = None, cwd: str | None = None
) -> tuple[float, float, float]:
    """Wall s, CPU s (``cmd`` and every process it waited for) and peak RSS MiB (its largest
    process) of ``cmd``, run in a fresh wrapper process (``env``, ``cwd``: as subprocess's)."""
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, *cmd], check=True, stdout=subprocess.PIPE, text=True,
        env=env, cwd=cwd,
    )  # fmt: skip
    wall, cpu, rss = json.loads(out.stdout.strip().splitlines()[-1])
    return float(wall), float(cpu), float(rss)


def _export(rev: str, workdir: str) -> str:
    """The package at ``rev``, as files in a scratch directory (no git worktree to clean up)."""
    tree = os.path.join(workdir, f"tree-{rev}")
    if not os.path.isdir(tree):
        os.makedirs(tree)
        archive = subprocess.run(
            ["git", "archive", rev, "ckptools"], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
    return tree


def _python(tree: str) -> list[str]:
    # -P: no current directory (or script directory) ahead of PYTHONPATH
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = tree
    return ["env", "-i", *(f"{k}={v}" for k, v in env.items()), sys.executable, "-P"]


def _imported_from(tree: str) -> str:
    """Byte-compile ``tree`` (as an install would be: the first round must not pay for it) and
    say which ckptools its children import."""
    subprocess.run([*_python(tree), "-m", "compileall", "-q", os.path.join(tree, "ckptools")],
                   check=True)  # fmt: skip
    code = "import ckptools; print(ckptools.__file__)"
    return subprocess.run(
        [*_python(tree), "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="the git revision to compare with")
    ap.add_argument("--head", default=None, help="a git revision (default: this working tree)")
    ap.add_argument("--size-gb", type=float, default=2.0, choices=sorted(gen.SHAPES))
    ap.add_argument("--src", default=None, help="an existing checkpoint instead of generating")
    ap.add_argument("--commands", nargs="+", default=list(COMMANDS), choices=list(COMMANDS))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/ckbench-ab")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each command")
    ap.add_argument(
        "--rotate", action="store_true", help="round r starts with the r-th run (places balanced)"
    )
    args = ap.parse_args()

    os.makedirs(args.workdir, exist_ok=True)
    src = args.src or os.path.join(args.workdir, f"fsdp2-{args.size_gb}gb")
    if not os.path.isdir(src):
        print(f"generating {src} ...", flush=True)
        gen.generate(src, args.size_gb)
    nbytes = gen._du(src)
    head = os.getcwd() if args.head is None else _export(args.head, args.workdir)
    trees = {"base": _export(args.base, args.workdir), "head": head}
    for label, tree in trees.items():
        print(f"{label}: imports {_imported_from(tree)}", flush=True)
    results: dict[str, list[tuple[float, float, float]]] = {}
    out = os.path.join(args.workdir, "out")

    def run(name: str, cmd: list[str]) -> None:
        shutil.rmtree(out, ignore_errors=True)
        subprocess.run(["sync"], check=True)
        if args.cold:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        results.setdefault(name, []).append(_measure(cmd))

    runs = [("cp -r + sync", ["sh", "-c", f'cp -r "{src}" "$0" && sync "$0"/*', out])]
    for command in args.commands:
        for label, tree in trees.items():
            argv = [*_python(tree), "-m", "ckptools", *COMMANDS[command](src, out)]
            runs.append((f"{command} ({label})", argv))
    for r in range(args.repeat):
        # --rotate: round r starts with the r-th run, so each takes every place in a round
        # equally often (the same code measured 1.17x and 1.06x `cp` in two places of one run)
        shift = r % len(runs) if args.rotate else 0
        for name, cmd in runs[shift:] + runs[:shift]:
            run(name, cmd)
        print(f"round {r}: " + ", ".join(f"{k} {v[-1][0]:.2f} s" for k, v in results.items()),
              flush=True)  # fmt: skip
    shutil.rmtree(out, ignore_errors=True)
    print(_report(results, nbytes, args))


def _ratio(a: list[tuple[float, float, float]], b: list[tuple[float, float, float]]) -> float:
    return statistics.median(x[0] / y[0] for x, y in zip(a, b, strict=True))


def _report(results: dict[str, list[tuple[float, float, float]]], nbytes: int, args: Any) -> str:
    floor = results["cp -r + sync"]
    lines = [
        f"### {nbytes / 1e9:.2f} GB, base {args.base} vs {args.head or 'working tree'}, "
        f"median of {args.repeat} alternating rounds{' (rotated)' if args.rotate else ''}, "
        f"{'cold' if args.cold else 'warm'} cache",
        "",
        "| command | wall s | CPU s | peak RSS MiB | x cp -r + sync (same-round) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for k, v in results.items():
        wall = statistics.median(x[0] for x in v)
        cpu = statistics.median(x[1] for x in v)
        lines.append(
            f"| {k} | {wall:.2f} | {cpu:.2f} | {max(x[2] for x in v):.0f} | "
            f"{_ratio(v, floor):.2f} |"
        )
    lines.append("")
    for command in args.commands:
        base, head = results[f"{command} (base)"], results[f"{command} (head)"]
        cpu = statistics.median(h[1] / b[1] for h, b in zip(head, base, strict=True))
        lines.append(f"{command}: head / base = {_ratio(head, base):.2f} wall, {cpu:.2f} CPU")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
