"""Benchmark: two revisions of ckptools in the same run (a refactor must not cost speed).

Generates (or reuses) the Llama-shaped fp32 checkpoint of ``bench/consolidate.py`` (4 real FSDP2
ranks, model + AdamW state with ``--optim``), exports revision ``--base`` into a scratch
worktree, then alternates, for ``--repeat`` rounds, the same commands from both trees (each in a
fresh child with ``PYTHONPATH`` pointing at its tree) and ``cp -r`` + ``sync`` of the same bytes:

* ``ckpt consolidate SRC OUT --quiet``
* ``ckpt reshard SRC OUT --world-size 8 --quiet``
* ``ckpt verify SRC --quiet``

Alternating rounds under the same load make the ratio between the revisions meaningful even on a
noisy machine; the absolute times are not. Prints medians, peak RSS and the ratios.

Usage::

    python bench/ab.py --base da620c1 --size-gb 2.0 --repeat 3 [--workdir /tmp/ckbench-ab]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
import consolidate as gen  # the generator and the measuring wrapper

COMMANDS = {
    "consolidate": lambda src, out: ["consolidate", src, out, "--quiet"],
    "reshard 4->8": lambda src, out: ["reshard", src, out, "--world-size", "8", "--quiet"],
    "verify": lambda src, out: ["verify", src, "--quiet"],
}


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


def _ckpt(tree: str, args: list[str]) -> list[str]:
    # -P: no current directory ahead of PYTHONPATH, or a run from the repository root would
    # import the working tree's ckptools for both revisions
    return ["env", f"PYTHONPATH={tree}", sys.executable, "-P", "-m", "ckptools", *args]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="the git revision to compare HEAD's tree with")
    ap.add_argument("--size-gb", type=float, default=2.0, choices=sorted(gen.SHAPES))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/ckbench-ab")
    args = ap.parse_args()

    os.makedirs(args.workdir, exist_ok=True)
    src = os.path.join(args.workdir, f"fsdp2-{args.size_gb}gb")
    if not os.path.isdir(src):
        print(f"generating {src} ...", flush=True)
        gen.generate(src, args.size_gb)
    nbytes = gen._du(src)
    trees = {"base": _export(args.base, args.workdir), "head": os.getcwd()}
    results: dict[str, list[tuple[float, int]]] = {}
    out = os.path.join(args.workdir, "out")

    def run(name: str, cmd: list[str]) -> None:
        shutil.rmtree(out, ignore_errors=True)
        results.setdefault(name, []).append(gen._measure(cmd))

    for _ in range(args.repeat):
        run("cp -r + sync", ["sh", "-c", f'cp -r "{src}" "$0" && sync "$0"/*', out])
        for command, make in COMMANDS.items():
            for label, tree in trees.items():
                run(f"{command} ({label})", _ckpt(tree, make(src, out)))
    shutil.rmtree(out, ignore_errors=True)
    print(_report(results, nbytes, args))


def _report(results: dict[str, list[tuple[float, int]]], nbytes: int, args: Any) -> str:
    med = {k: statistics.median(w for w, _ in v) for k, v in results.items()}
    floor = med["cp -r + sync"]
    lines = [
        f"### {nbytes / 1e9:.2f} GB, base {args.base} vs HEAD, median of {args.repeat} "
        "alternating rounds",
        "",
        "| command | wall s (median) | peak RSS MiB | x cp -r + sync |",
        "| --- | ---: | ---: | ---: |",
    ]
    for k, v in results.items():
        rss = max(r for _, r in v) / 2**20
        lines.append(f"| {k} | {med[k]:.2f} | {rss:.0f} | {med[k] / floor:.2f} |")
    lines.append("")
    for command in COMMANDS:
        base, head = med[f"{command} (base)"], med[f"{command} (head)"]
        lines.append(f"{command}: HEAD / base = {head / base:.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
