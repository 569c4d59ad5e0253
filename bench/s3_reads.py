"""Benchmark: ckptools on an S3-compatible server (moto's server mode on loopback, via s3fs).

Generates (or reuses, ``--src``) the Llama-shaped fp32 checkpoint of ``bench/consolidate.py``
(model only, written by 4 real FSDP2 ranks), starts ``moto_server`` in its own process on
127.0.0.1, uploads the checkpoint with s3fs, then measures:

* **bytes read from S3 per output byte** of ``consolidate s3://... LOCAL``: GetObject payload
  bytes counted at s3fs's request function (``tests.support.s3.GetCounter``), divided by the
  bytes of the safetensors files written (target <= 1.05);
* wall time and throughput (checkpoint bytes / s) of, each as its own ``ckpt`` process, with the
  credentials and endpoint in the environment as a user would set them:
  ``s3fs get`` of the whole checkpoint (the floor: the same bytes, one client),
  ``ckpt consolidate s3:// LOCAL``, ``ckpt consolidate s3:// s3://``,
  ``ckpt reshard s3:// s3:// --world-size 8``, ``ckpt verify s3://``,
  and ``ckpt consolidate LOCAL LOCAL`` for reference.

moto keeps objects in its own process and serves them over HTTP on loopback, so the absolute
numbers say how much ckptools adds over moving the bytes through the same server, not what a
real object store sustains. Linux only.

Usage::

    python bench/s3_reads.py --size-gb 2.0 [--src /tmp/ckbench-scale/fsdp2-2.0gb] [--repeat 2]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# bench/consolidate.py: the checkpoint generator
import consolidate as gen

BUCKET = "bench"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _start_server(port: int) -> subprocess.Popen[bytes]:
    server = shutil.which("moto_server") or os.path.join(
        os.path.dirname(sys.executable), "moto_server"
    )
    proc = subprocess.Popen(
        [server, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 30
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto_server did not start")


def _timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=2.0, choices=sorted(gen.SHAPES))
    ap.add_argument("--src", default=None, help="an existing checkpoint to use instead")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--workdir", default="/tmp/ckbench-s3")
    args = ap.parse_args()

    os.makedirs(args.workdir, exist_ok=True)
    src = args.src or os.path.join(args.workdir, f"fsdp2-{args.size_gb}gb")
    if not os.path.exists(os.path.join(src, ".metadata")):
        print(f"generating {src} ...", flush=True)
        gen.generate(src, args.size_gb)
    nbytes = _du(src)

    port = _free_port()
    env = {
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "NO_PROXY": "127.0.0.1",
    }
    os.environ.update(env)
    server = _start_server(port)
    try:
        import s3fs

        fs = s3fs.S3FileSystem()
        fs.mkdir(BUCKET)
        t0 = time.perf_counter()
        for name in sorted(os.listdir(src)):
            fs.put_file(os.path.join(src, name), f"{BUCKET}/src/{name}")
        upload_s = time.perf_counter() - t0
        url = f"s3://{BUCKET}/src"

        # 1. bytes read per output byte (in this process, counted at s3fs's request function)
        import ckptools
        from tests.support.s3 import GetCounter

        out = os.path.join(args.workdir, "hf-count")
        shutil.rmtree(out, ignore_errors=True)
        with GetCounter() as counter:
            result = ckptools.consolidate(url, out, quiet=True)
        ratio = counter.bytes / result.bytes_written
        shutil.rmtree(out, ignore_errors=True)

        # 2. wall times, each command its own process
        ckpt = [sys.executable, "-m", "ckptools"]
        local_out = os.path.join(args.workdir, "hf")
        get_dir = os.path.join(args.workdir, "get")
        cases: dict[str, list[float]] = {}

        def case(name: str, cmd: list[str], before: list[str] | None = None) -> None:
            for target in before or []:
                if target.startswith("s3://"):
                    key = target.removeprefix("s3://")
                    if fs.exists(key):
                        fs.rm(key, recursive=True)
                    fs.invalidate_cache()
                else:
                    shutil.rmtree(target, ignore_errors=True)
            cases.setdefault(name, []).append(_timed(cmd))

        for _ in range(args.repeat):
            get = f"s3fs.S3FileSystem().get('{BUCKET}/src/', '{get_dir}/', recursive=True)"
            case("s3fs get (floor)", [sys.executable, "-c", f"import s3fs; {get}"], [get_dir])
            case("consolidate s3 -> local", [*ckpt, "consolidate", url, local_out, "--quiet"],
                 [local_out])  # fmt: skip
            case("consolidate s3 -> s3", [*ckpt, "consolidate", url, f"s3://{BUCKET}/hf",
                 "--quiet"], [f"s3://{BUCKET}/hf"])  # fmt: skip
            case("reshard s3 -> s3 (8 ranks)", [*ckpt, "reshard", url, f"s3://{BUCKET}/r8",
                 "--world-size", "8", "--quiet"], [f"s3://{BUCKET}/r8"])  # fmt: skip
            case("verify s3", [*ckpt, "verify", url, "--quiet"])
            case("consolidate local -> local", [*ckpt, "consolidate", src, local_out,
                 "--quiet"], [local_out])  # fmt: skip
        shutil.rmtree(local_out, ignore_errors=True)
        shutil.rmtree(get_dir, ignore_errors=True)
    finally:
        server.terminate()
        server.wait()

    floor = statistics.median(cases["s3fs get (floor)"])
    lines = [
        f"### ckptools on S3 (moto server on loopback), {nbytes / 1e9:.2f} GB fp32 FSDP2 "
        "checkpoint",
        "",
        f"{datetime.date.today()}, {platform.machine()}, {os.cpu_count()} CPUs, "
        f"python {platform.python_version()}, s3fs {s3fs.__version__}; median of {args.repeat}.",
        f"Upload with s3fs put_file: {upload_s:.1f} s.",
        "",
        f"**Bytes read from S3 per output byte (consolidate s3:// -> local): {ratio:.4f}** "
        f"({counter.bytes:,} bytes in {counter.requests} GETs for {result.bytes_written:,} "
        "bytes written)",
        "",
        "| command | wall s | GB/s | vs s3fs get |",
        "|---|---:|---:|---:|",
    ]
    for name, times in cases.items():
        t = statistics.median(times)
        lines.append(f"| {name} | {t:.2f} | {nbytes / t / 1e9:.2f} | {t / floor:.2f}x |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
