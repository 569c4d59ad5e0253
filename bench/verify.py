"""Benchmark: ``ckpt verify`` against ``cat`` of the same files (the physical read floor).

Generates (once) the ~2 GB Llama-shaped fp32 checkpoint written by 4 real FSDP2 ranks that
``bench/consolidate.py`` uses, then, alternating for ``--repeat`` rounds, measures in fresh
processes:

* ``cat FILES > /dev/null``: reads every byte once, single-threaded;
* ``ckpt verify SRC``: structure + content (every DCP item parsed, every zip record's CRC-32);
* ``ckpt verify SRC`` with a checksum manifest present (adds BLAKE2b-128 of every byte);
* ``ckpt verify --quick SRC``: structure only;
* ``ckpt checksum SRC``: verify + write the checksum manifest.

Each is measured with a cold page cache (``sync; echo 3 > /proc/sys/vm/drop_caches`` before
every run; needs root, and the script says when it could not) and with a warm one.

Usage::

    python bench/verify.py --size-gb 2.0 --repeat 3 [--workdir /tmp/ckbench-verify] [--keep]
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
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _generator() -> object:
    # The checkpoint generator lives in bench/consolidate.py (4 real FSDP2 ranks, meta-device
    # init); sharing it keeps the two benchmarks on the same bytes. Imported by name (not from a
    # path) so the spawned ranks can import it too.
    sys.path.insert(0, HERE)
    import consolidate

    return consolidate


def drop_caches() -> bool:
    """Drop the page cache; True when the kernel accepted it."""
    subprocess.run(["sync"], check=True)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _run(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS bytes of ``cmd`` (exit codes 0 and 3 accepted)."""
    code = (
        "import resource, subprocess, sys, time, json\n"
        "t = time.perf_counter()\n"
        "rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode\n"
        "dt = time.perf_counter() - t\n"
        "rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024\n"
        "print(json.dumps([dt, rss, rc]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *cmd], check=True, capture_output=True, text=True
    )
    wall, rss, rc = json.loads(out.stdout.strip().splitlines()[-1])
    if rc != 0:
        raise RuntimeError(f"{cmd} exited {rc}")
    return float(wall), int(rss)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/ckbench-verify")
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoint")
    args = ap.parse_args()

    src = os.path.join(args.workdir, f"fsdp2-{args.size_gb}gb")
    if not os.path.exists(os.path.join(src, ".metadata")):
        shutil.rmtree(src, ignore_errors=True)
        t = time.perf_counter()
        _generator().generate(src, args.size_gb)  # type: ignore[attr-defined]
        print(f"generated {src} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    sums = os.path.join(src, ".ckptools-checksums.json")
    if os.path.exists(sums):
        os.remove(sums)
    files = sorted(os.path.join(src, n) for n in os.listdir(src) if n.endswith(".distcp"))
    files.append(os.path.join(src, ".metadata"))
    nbytes = sum(os.path.getsize(f) for f in files)
    ckpt = os.path.join(os.path.dirname(sys.executable), "ckpt")
    with_sums = os.path.join(args.workdir, "with-sums")
    shutil.rmtree(with_sums, ignore_errors=True)
    os.makedirs(with_sums)
    for f in files:  # hard links: same bytes, and its own checksum manifest beside them
        os.link(f, os.path.join(with_sums, os.path.basename(f)))
    subprocess.run([ckpt, "checksum", with_sums, "--quiet"], check=True, stdout=subprocess.DEVNULL)
    tools: dict[str, list[str]] = {
        "cat > /dev/null": ["sh", "-c", 'cat "$@" > /dev/null', "cat", *files],
        "ckpt verify": [ckpt, "verify", src, "--quiet"],
        "ckpt verify (+checksums)": [ckpt, "verify", with_sums, "--quiet"],
        "ckpt verify --quick": [ckpt, "verify", src, "--quick", "--quiet"],
        "ckpt checksum": [ckpt, "checksum", src, "--quiet"],
    }
    results: dict[str, dict[str, list[tuple[float, int]]]] = {"cold": {}, "warm": {}}
    cold_ok = True
    for _ in range(args.repeat):
        for name, cmd in tools.items():
            for cache in ("cold", "warm"):
                if cache == "cold":
                    cold_ok = drop_caches() and cold_ok
                else:
                    _run(["sh", "-c", 'cat "$@" > /dev/null', "cat", *files])  # warm it
                results[cache].setdefault(name, []).append(_run(cmd))
                if os.path.exists(sums):
                    os.remove(sums)
    print(_report(results, nbytes, args, cold_ok))
    shutil.rmtree(with_sums, ignore_errors=True)
    if not args.keep:
        shutil.rmtree(src, ignore_errors=True)


def _report(
    results: dict[str, dict[str, list[tuple[float, int]]]], nbytes: int, args: object, cold: bool
) -> str:
    now = datetime.datetime.now(datetime.timezone.utc)
    lines = [
        f"### {nbytes / 1e9:.2f} GB fp32 FSDP2 checkpoint (4 ranks, model only), median of "
        f"{args.repeat} alternating runs",  # type: ignore[attr-defined]
        "",
        f"{platform.node()}: {os.cpu_count()} CPUs, {platform.platform()}, python "
        f"{platform.python_version()}, {now:%Y-%m-%d %H:%M} UTC"
        + ("" if cold else " (cold runs: page cache could NOT be dropped)"),
        "",
        "| tool | cache | wall s (median) | min s | GB/s | peak RSS MiB | speed vs cat |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for cache in ("cold", "warm"):
        cat = statistics.median(w for w, _ in results[cache]["cat > /dev/null"])
        for name, runs in results[cache].items():
            walls = [w for w, _ in runs]
            med = statistics.median(walls)
            rss = max(r for _, r in runs)
            lines.append(
                f"| {name} | {cache} | {med:.2f} | {min(walls):.2f} | {nbytes / med / 1e9:.2f} | "
                f"{rss / 2**20:.0f} | {cat / med:.0%} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
