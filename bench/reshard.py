"""Benchmark: ``ckpt reshard`` against ``cp -r`` (the floor) and the native way to reshard.

Generates a Llama-shaped fp32 **model + AdamW state** checkpoint (~2 GB: 167 M parameters,
``exp_avg``, ``exp_avg_sq``, ``step``) written by 4 real FSDP2 ranks (``bench/consolidate.py``'s
generator), then, alternating, for each target world size (8 and 2) and ``--repeat`` rounds:

* ``cp -r SRC DST`` and ``cp -r`` + ``sync`` (ckpt fsyncs its output before the rename that commits
  it, so the second is the fair floor);
* ``ckpt reshard SRC OUT --world-size M --quiet``, in a fresh child (peak RSS = the child's);
* native: M real ranks (gloo, spawned) each build the FSDP2 model and AdamW on the meta device,
  ``get_state_dict`` → ``dcp.load(SRC)`` → ``set_state_dict`` → ``dcp.save(OUT)``; wall time from
  spawn to exit, peak RSS summed over the ranks (each rank holds its shard).

The page cache is warm for all (the same checkpoint is read every time).

Usage: ``python bench/reshard.py [--repeat 2] [--workdir /tmp/ckbench-reshard] [--keep]``
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
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# bench/consolidate.py: the checkpoint generator and the measuring helpers
import consolidate as gen

# (hidden, intermediate, vocab, layers): 167 M params, x3 with AdamW state = 2.0 GB fp32
SHAPE = (1024, 2816, 32000, 8)


def _native_worker(rank: int, world: int, src: str, out: str, port: int, rss_dir: str) -> None:
    import resource

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = gen.build_fsdp2_model(SHAPE, world)
    opt = torch.optim.AdamW(model.parameters())
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=src)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=out)
    with open(os.path.join(rss_dir, f"rss{rank}"), "w") as f:
        f.write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
    dist.barrier()
    dist.destroy_process_group()


def _native(src: str, out: str, world: int, workdir: str) -> tuple[float, int]:
    import torch.multiprocessing as mp

    rss_dir = os.path.join(workdir, "rss")
    shutil.rmtree(rss_dir, ignore_errors=True)
    os.makedirs(rss_dir)
    t0 = time.perf_counter()
    mp.spawn(
        _native_worker, args=(world, src, out, gen.free_port(), rss_dir), nprocs=world, join=True
    )
    wall = time.perf_counter() - t0
    rss = sum(int(Path(rss_dir, f).read_text()) for f in os.listdir(rss_dir))
    return wall, rss


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--targets", default="8,2")
    ap.add_argument("--workdir", default="/tmp/ckbench-reshard")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument(
        "--no-native", action="store_true", help="skip the native runs (quick ckpt-vs-cp checks)"
    )
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    src = os.path.join(args.workdir, "src")
    if not os.path.exists(os.path.join(src, ".metadata")):
        import torch.multiprocessing as mp

        shutil.rmtree(src, ignore_errors=True)
        mp.spawn(gen._worker, args=(4, src, SHAPE, gen.free_port(), True), nprocs=4, join=True)
    nbytes = gen._du(src)
    ckpt = os.path.join(os.path.dirname(sys.executable), "ckpt")
    dst = os.path.join(args.workdir, "dst")
    results: dict[str, list[tuple[float, int]]] = {}

    def run(name: str, fn: Any) -> None:
        shutil.rmtree(dst, ignore_errors=True)
        subprocess.run(["sync"], check=True)
        results.setdefault(name, []).append(fn())

    for _ in range(args.repeat):
        run("cp -r", lambda: gen._measure(["cp", "-r", src, dst]))
        run("cp -r + sync", lambda: gen._measure(["sh", "-c", f"cp -r {src} {dst} && sync"]))
        for m in (int(x) for x in args.targets.split(",")):
            run(f"ckpt reshard 4->{m}", lambda m=m: gen._measure(
                [ckpt, "reshard", src, dst, "--world-size", str(m), "--quiet"]))  # fmt: skip
            if not args.no_native:
                run(f"native 4->{m}", lambda m=m: _native(src, dst, m, args.workdir))
    shutil.rmtree(dst, ignore_errors=True)
    if not args.keep:
        shutil.rmtree(src, ignore_errors=True)

    floor = statistics.median(w for w, _ in results["cp -r + sync"])
    lines = [
        f"## reshard: 4 -> M ranks, model + AdamW state "
        f"({nbytes / 1e9:.2f} GB, `bench/reshard.py`)",
        "",
        f"{datetime.date.today()}, {platform.node()} ({os.cpu_count()} cores, "
        f"Python {platform.python_version()}), warm page cache, median of {args.repeat}.",
        "",
        "| command | wall s | GB/s | peak RSS MiB | vs cp -r + sync |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, runs in results.items():
        wall = statistics.median(w for w, _ in runs)
        rss = max(r for _, r in runs)
        lines.append(
            f"| {name} | {wall:.2f} | {nbytes / wall / 1e9:.2f} | {rss / 2**20:.0f} | "
            f"{wall / floor:.2f}x |"
        )
    for m in (int(x) for x in args.targets.split(",") if not args.no_native):
        ours = statistics.median(w for w, _ in results[f"ckpt reshard 4->{m}"])
        native = statistics.median(w for w, _ in results[f"native 4->{m}"])
        lines.append(f"\n4 -> {m}: ckpt reshard is {native / ours:.1f}x faster than native.")
    print("\n".join(lines))
    print(json.dumps({k: v for k, v in results.items()}), file=sys.stderr)


if __name__ == "__main__":
    main()
