"""``ckpt consolidate`` of a zstd DCP (torch's ``FileSystemWriter(_extensions=[ZStandard()])``)
against its floor: ``zstd -d`` of the same items (extracted beforehand, not timed) plus ``cp`` of
what they decode to. Both in the same run, alternating, page cache warm; peak memory is each
process's VmHWM.

Usage: ``python bench/zstd_consolidate.py --size-gb 1.0 --repeat 3``
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
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": REPO}
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
        times: dict[str, list[float]] = {"ckpt": [], "floor": []}
        peaks: list[int] = []
        for _ in range(args.repeat):
            out = os.path.join(tmp, "out")
            shutil.rmtree(out, ignore_errors=True)
            took, err = _run(
                [sys.executable, "-c", _PEAK, "consolidate", src, out, "--weights-only"], env=env
            )
            assert os.path.getsize(os.path.join(out, "model.safetensors")) >= m.total_bytes
            times["ckpt"].append(took)
            peaks.append(int(err.split("peak_kib")[-1].split()[0]))
            dec, copy = os.path.join(tmp, "dec"), os.path.join(tmp, "copy")
            shutil.rmtree(dec, ignore_errors=True)
            shutil.rmtree(copy, ignore_errors=True)
            files = sorted(os.path.join(items, f) for f in os.listdir(items))
            os.makedirs(dec)
            t1, _ = _run(["zstd", "-d", "-q", *files, "--output-dir-flat", dec])
            t2, _ = _run(["cp", "-r", dec, copy])
            times["floor"].append(t1 + t2)
        ckpt, floor = statistics.median(times["ckpt"]), statistics.median(times["floor"])
        logical = m.total_bytes
        print(f"logical {logical / 2**30:.2f} GiB, stored (zstd) {stored / 2**30:.2f} GiB")
        print(f"ckpt consolidate: {ckpt:.2f} s (runs {[round(x, 2) for x in times['ckpt']]})")
        print(f"zstd -d + cp:     {floor:.2f} s (runs {[round(x, 2) for x in times['floor']]})")
        print(f"ratio {ckpt / floor:.2f}x; ckpt peak memory {max(peaks) / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
