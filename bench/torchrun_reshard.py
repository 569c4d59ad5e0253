"""Benchmark: a *writing* ``ckpt reshard`` under torchrun, two revisions alternated (issue 27,
goal 4: the parse is paid once, not once per worker).

Generates (or reuses) the 405B-shaped FSDP2 checkpoint of ``bench/scale_405b.py`` with real items
and rows of ``--row-width`` elements (default 1: the real ~1.16M chunks at 1,024 ranks and a
``.metadata`` as large as the real one, in ~1.8 GB instead of ~810 GB), exports revision
``--base`` (and ``--head``, default: this working tree) as ``bench/ab.py`` does, then for
``--repeat`` rounds, the two trees alternated (their order swapped every round), runs::

    python -P -m torch.distributed.run --nproc-per-node N --monitor-interval 0.1 \\
        --master-port PORT --no-python sh -c \\
        'exec /usr/bin/time -f "%e %U %S %M" -o TIMES.$RANK python -P -m ckptools reshard \\
         SRC OUT --world-size 2048 -q'

from a directory holding no ``ckptools``, with only that tree on ``PYTHONPATH`` (each tree's
child prints ``ckptools.__file__`` once, first). ``--no-python`` and ``/usr/bin/time`` only
wrap each worker (``python -P -m ckptools``, as torchrun would start it) so that its own wall
time, CPU time and peak RSS are known; the launcher's wall time, and the CPU time of the
launcher and every worker together (``RUSAGE_CHILDREN`` of a wrapper process), are measured
around the whole launch. In the first round each output's digest (every file, ``.metadata``'s
``save_id`` masked) is taken, so the two trees are shown to write the same bytes; every output
is removed after its run (3.5 GB at 2,048 ranks).

Usage::

    python bench/torchrun_reshard.py --base main [--repeat 3] [--nproc 2] [--ranks 1024]
        [--target 2048]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
import scale_405b as gen  # the generator
from ab import _export, _measure  # a revision's package as files; wall, CPU

_WORKER = (
    'exec /usr/bin/time -f "%e %U %S %M" -o "$0.$RANK" '
    '"$1" -P -m ckptools reshard "$2" "$3" --world-size "$4" -q'
)
_UUID = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _env(tree: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1", "CKPTOOLS_NO_PROGRESS": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _digest(out: str) -> str:
    import xxhash

    h = xxhash.xxh3_128()
    for d, _, files in sorted(os.walk(out)):
        for f in sorted(files):
            path = os.path.join(d, f)
            h.update(os.path.relpath(path, out).encode() + b"\0")
            with open(path, "rb") as fh:
                if f == ".metadata":
                    h.update(_UUID.sub(b"0" * 36, fh.read()))
                    continue
                while chunk := fh.read(2**24):
                    h.update(chunk)
    return h.hexdigest()


def _launch(tree: str, src: str, out: str, target: int, cwd: str, nproc: int) -> dict[str, Any]:
    times = os.path.join(cwd, "times")
    cmd = [
        sys.executable, "-P", "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--monitor-interval", "0.1", "--master-addr", "127.0.0.1",
        "--master-port", str(_free_port()), "--no-python", "sh", "-c", _WORKER, times,
        sys.executable, src, out, str(target),
    ]  # fmt: skip
    load = os.getloadavg()[0]
    wall, cpu, _ = _measure(cmd, env=_env(tree), cwd=cwd)
    workers = []
    for rank in range(nproc):
        with open(f"{times}.{rank}") as f:
            w, u, s, rss = f.read().split()[-4:]
        os.remove(f"{times}.{rank}")
        workers.append({"wall": float(w), "cpu": float(u) + float(s), "rss_mib": int(rss) / 1024})
    return {"wall": wall, "cpu": cpu, "workers": workers, "load": load}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="the git revision to compare with")
    ap.add_argument("--head", default=None, help="a git revision (default: this working tree)")
    ap.add_argument("--ranks", type=int, default=1024, help="source ranks")
    ap.add_argument("--layers", type=int, default=126)
    ap.add_argument("--row-width", type=int, default=1)
    ap.add_argument("--target", type=int, default=2048, help="--world-size of the reshard")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=2, help="torchrun workers")
    ap.add_argument("--workdir", default="/tmp/ckbench-torchrun")
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoint")
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    src = gen.checkpoint_dir(args.workdir, args.layers, args.ranks, False, args.row_width)
    if not os.path.exists(os.path.join(src, ".metadata")):
        t = time.perf_counter()
        info = gen.generate(src, args.layers, args.ranks, row_width=args.row_width)
        print(f"generated {src} in {time.perf_counter() - t:.1f} s: {info}", flush=True)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"base": _export(args.base, args.workdir)}
    trees["head"] = root if args.head is None else _export(args.head, args.workdir)
    cwd = tempfile.mkdtemp(dir=args.workdir, prefix="cwd-")  # holds no ckptools
    for name, tree in trees.items():
        where = subprocess.run(
            [sys.executable, "-P", "-c", "import ckptools; print(ckptools.__file__)"],
            check=True, capture_output=True, text=True, env=_env(tree), cwd=cwd,
        ).stdout.strip()  # fmt: skip
        print(f"{name}: {where}", flush=True)
    out = os.path.join(args.workdir, "out")
    results: dict[str, list[dict[str, Any]]] = {"base": [], "head": []}
    digests: dict[str, str] = {}
    started = datetime.datetime.now(datetime.timezone.utc)
    for i in range(args.repeat):
        for name in ("base", "head") if i % 2 == 0 else ("head", "base"):
            shutil.rmtree(out, ignore_errors=True)
            r = _launch(trees[name], src, out, args.target, cwd, args.nproc)
            if i == 0:
                digests[name] = _digest(out)
            shutil.rmtree(out, ignore_errors=True)
            results[name].append(r)
            ranks = "; ".join(
                f"rank {k} {w['cpu']:.1f} s CPU {w['rss_mib']:.0f} MiB"
                for k, w in enumerate(r["workers"])
            )
            print(
                f"round {i + 1} {name}: wall {r['wall']:.1f} s, CPU {r['cpu']:.1f} s; {ranks}; "
                f"load before {r['load']:.1f}",
                flush=True,
            )
    ended = datetime.datetime.now(datetime.timezone.utc)
    print(f"\nsame bytes: {digests['base'] == digests['head']} ({digests})")
    print(
        f"{platform.node()}, {os.cpu_count()} CPUs, {started:%Y-%m-%d %H:%M}-{ended:%H:%M} UTC, "
        f"load now {os.getloadavg()[0]:.1f}\n"
    )
    print(
        "| tree | wall s, each round | median wall | CPU s, all processes (median) | "
        + " | ".join(f"rank {k}: CPU s / peak RSS MiB" for k in range(args.nproc))
        + " |"
    )
    print("| --- | --- | ---: | ---: |" + " ---: |" * args.nproc)  # fmt: skip
    for name, rs in results.items():

        def med(f: Any, rs: list[dict[str, Any]] = rs) -> float:
            return float(statistics.median(f(r) for r in rs))

        walls = ", ".join(f"{r['wall']:.1f}" for r in rs)
        per_rank = " | ".join(
            f"{med(lambda r, k=k: r['workers'][k]['cpu']):.1f} / "
            f"{med(lambda r, k=k: r['workers'][k]['rss_mib']):.0f}"
            for k in range(args.nproc)
        )
        print(
            f"| {name} | {walls} | {med(lambda r: r['wall']):.1f} "
            f"| {med(lambda r: r['cpu']):.1f} | {per_rank} |"
        )
    print(json.dumps(results))
    shutil.rmtree(cwd, ignore_errors=True)
    if not args.keep:
        shutil.rmtree(src, ignore_errors=True)


if __name__ == "__main__":
    main()
