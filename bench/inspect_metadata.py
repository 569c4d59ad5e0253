"""How fast `ckpt inspect` describes a large checkpoint from its metadata alone.

Builds a synthetic but valid DCP `.metadata` (torch's own metadata classes) for N tensors sharded
over R ranks (default 1,000 × 64: 64,000 chunks; data files are sparse, so only metadata is real),
then times, in the same run, each several times:

* `ckpt inspect PATH` (table) and `ckpt inspect PATH --json`, as subprocesses (startup included);
* torch's own reading of the same metadata: `FileSystemReader(PATH).read_metadata()` in a
  subprocess that imports torch (what any torch-based tool pays before printing anything).

Run: `.venv/bin/python bench/inspect_metadata.py [--tensors 1000] [--ranks 64]`
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _time(cmd: list[str], repeat: int) -> tuple[float, float]:
    """Median wall seconds and peak child RSS (MiB) of running ``cmd`` ``repeat`` times."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - t0)
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return statistics.median(times), rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    from tests.support.producers import big_many_tensors_metadata

    ckpt_bin = os.path.join(os.path.dirname(sys.executable), "ckpt")
    with tempfile.TemporaryDirectory() as tmp:
        path = big_many_tensors_metadata(
            os.path.join(tmp, "ckpt"), args.tensors, args.ranks, sized_files=True
        )
        meta_mib = os.path.getsize(os.path.join(path, ".metadata")) / 2**20
        torch_cmd = [
            sys.executable,
            "-c",
            "import sys, torch.distributed.checkpoint as d; "
            "d.FileSystemReader(sys.argv[1]).read_metadata()",
            path,
        ]
        rows = [
            ("ckpt inspect (table)", _time([ckpt_bin, "inspect", path], args.repeat)),
            ("ckpt inspect --json", _time([ckpt_bin, "inspect", path, "--json"], args.repeat)),
            ("torch read_metadata only", _time(torch_cmd, args.repeat)),
        ]
    base = rows[2][1][0]
    print(
        f"{args.tensors} tensors x {args.ranks} ranks = {args.tensors * args.ranks} chunks, "
        f".metadata {meta_mib:.1f} MiB, median of {args.repeat}"
    )
    print(f"{'command':<28}{'wall s':>8}{'vs torch':>10}")
    for name, (secs, _rss) in rows:
        print(f"{name:<28}{secs:>8.3f}{secs / base:>9.2f}x")
    print(f"peak RSS of any child: {rows[-1][1][1]:.0f} MiB (getrusage, max over all runs)")


if __name__ == "__main__":
    main()
