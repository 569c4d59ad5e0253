"""``ckpt consolidate`` of a zstd DCP (torch's ``FileSystemWriter(_extensions=[ZStandard()])``)
against its floor: ``zstd -d`` of the same items (extracted beforehand, not timed) plus ``cp`` of
what they decode to. Both in the same run, alternating, page cache warm; peak memory is each
process's VmHWM.

``zstd -d + cp + sync`` is the floor with its copy made durable (``ckpt consolidate`` fsyncs its
output before its atomic rename, so on a slow disk the floor's own bytes reaching the disk bound
it). ``--baseline DIR``: also time the ``ckptools`` of another tree (``git archive`` of an older
commit), alternating with this one, for a before/after ratio in the same run.

Usage: ``python bench/zstd_consolidate.py --size-gb 1.0 --repeat 3 [--baseline /tmp/old]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_MAKE = """
import sys, warnings, torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._extension import ZStandard
n_bytes, out = int(sys.argv[1]), sys.argv[2]
g = torch.Generator().manual_seed(0)
per = 64 * 2**20  # bf16 weights of a real model's size class (trained weights compress ~10%)
state = {}
for i in range(max(1, n_bytes // per)):
    w = torch.randn(per // 2 // 4096, 4096, generator=g) * 0.02
    state[f"model.layers.{i}.weight"] = w.bfloat16()
warnings.simplefilter("ignore")
dcp.save(state, storage_writer=FileSystemWriter(out, _extensions=[ZStandard()]), no_dist=True)
"""

_PEAK = """
import re, runpy, sys
try:
    runpy.run_module("ckptools", run_name="__main__")
except SystemExit as e:
    code = e.code
hwm = re.search(r"VmHWM:\\s*(\\d+)", open("/proc/self/status").read()).group(1)
print("peak_kib", hwm, file=sys.stderr)
sys.exit(code)
"""


def _run(cmd: list[str], **kw: object) -> tuple[float, str]:
    t0 = time.perf_counter()
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)  # type: ignore[call-overload]
    return time.perf_counter() - t0, done.stderr


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--baseline", default=None, help="another tree whose ckptools to time too")
    args = ap.parse_args()
    trees = {"ckpt": REPO, **({"baseline": args.baseline} if args.baseline else {})}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        src = os.path.join(tmp, "zstd")
        subprocess.run(
            [sys.executable, "-c", _MAKE, str(int(args.size_gb * 2**30)), src], check=True
        )
        sys.path.insert(0, REPO)
        import ckptools

        m = ckptools.read_manifest(src)
        items = os.path.join(tmp, "items")
        os.makedirs(items)
        stored = 0
        for t in m.tensors.values():
            for c in t.chunks:
                with open(os.path.join(src, c.file), "rb") as f:
                    f.seek(c.offset)
                    data = f.read(c.length)
                stored += len(data)
                with open(os.path.join(items, f"{t.fqn}.zst"), "wb") as f:
                    f.write(data)
        times: dict[str, list[float]] = {name: [] for name in [*trees, "floor", "floor+sync"]}
        peaks: dict[str, list[int]] = {name: [] for name in trees}
        for _ in range(args.repeat):
            for name, tree in trees.items():
                out = os.path.join(tmp, "out")
                shutil.rmtree(out, ignore_errors=True)
                subprocess.run(["sync"], check=True)
                took, err = _run(
                    [sys.executable, "-c", _PEAK, "consolidate", src, out, "--weights-only"],
                    env={**os.environ, "PYTHONPATH": tree},
                    cwd=tree,  # the tree's ckptools, not the one in the working directory
                )
                assert os.path.getsize(os.path.join(out, "model.safetensors")) >= m.total_bytes
                times[name].append(took)
                peaks[name].append(int(err.split("peak_kib")[-1].split()[0]))
            dec, copy = os.path.join(tmp, "dec"), os.path.join(tmp, "copy")
            shutil.rmtree(dec, ignore_errors=True)
            shutil.rmtree(copy, ignore_errors=True)
            subprocess.run(["sync"], check=True)
            files = sorted(os.path.join(items, f) for f in os.listdir(items))
            os.makedirs(dec)
            t1, _ = _run(["zstd", "-d", "-q", *files, "--output-dir-flat", dec])
            t2, _ = _run(["cp", "-r", dec, copy])
            t3, _ = _run(["sync", *(os.path.join(copy, f) for f in os.listdir(copy))])
            times["floor"].append(t1 + t2)
            times["floor+sync"].append(t1 + t2 + t3)
        med = {name: statistics.median(runs) for name, runs in times.items()}
        floor = med["floor"]
        print(f"logical {m.total_bytes / 2**30:.2f} GiB, stored (zstd) {stored / 2**30:.2f} GiB")
        print("| command | wall s (median) | runs | vs floor | vs floor+sync | peak MiB |")
        print("| --- | ---: | --- | ---: | ---: | ---: |")
        for name, runs in times.items():
            label = {"ckpt": "`ckpt consolidate --weights-only`",
                     "baseline": f"`ckpt consolidate --weights-only` ({args.baseline})",
                     "floor": "`zstd -d` + `cp -r`",
                     "floor+sync": "`zstd -d` + `cp -r` + `sync`"}[name]  # fmt: skip
            peak = f"{max(peaks[name]) / 1024:.0f}" if name in peaks else ""
            print(
                f"| {label} | {med[name]:.2f} | {[round(x, 2) for x in runs]} | "
                f"{med[name] / floor:.2f}x | {med[name] / med['floor+sync']:.2f}x | {peak} |"
            )


if __name__ == "__main__":
    main()
