"""Does an async CheckpointManager save overlap training? Step times with sync vs async saves.

Trains a small MLP-stack model (``--hidden``, ``--layers``; ~100 MB of fp32 parameters + AdamW
state by default) in one process for ``--steps`` steps, saving every ``--every`` steps, three ways:
no saves (the floor), ``CheckpointManager(async_save=False)`` and ``async_save=True``. Prints the
mean step time, the time a save blocks the training loop, and total wall time. Checksums are off
so the numbers measure the save path itself (they are one extra read pass on rank 0).

Usage:
    .venv/bin/python bench/async_save.py [--hidden 1024 --layers 8 --steps 30 --every 10]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
from torch import nn

import ckptools


def build(hidden: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(hidden, hidden) for _ in range(layers)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def run(mode: str, args: argparse.Namespace, root: str) -> dict[str, float]:
    model, opt = build(args.hidden, args.layers)
    x = torch.randn(args.batch, args.hidden)
    mgr = (
        None
        if mode == "none"
        else ckptools.CheckpointManager(
            os.path.join(root, mode), keep_last=2, async_save=mode == "async", checksums=False
        )
    )
    step_times: list[float] = []
    blocked: list[float] = []
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        s = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        step_times.append(time.perf_counter() - s)
        if mgr is not None and step % args.every == 0:
            b = time.perf_counter()
            mgr.save(step, model, opt, extra={"step": step})
            blocked.append(time.perf_counter() - b)
    if mgr is not None:
        mgr.close()
    wall = time.perf_counter() - t0
    return {
        "step_ms": 1000 * statistics.mean(step_times),
        "save_block_ms": 1000 * statistics.mean(blocked) if blocked else 0.0,
        "wall_s": wall,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=10)
    args = p.parse_args()
    params = sum(p.numel() for p in build(args.hidden, args.layers)[0].parameters())
    state_mb = params * 4 * 3 / 2**20
    root = tempfile.mkdtemp(prefix="ckptools-bench-async-")
    try:
        print(
            f"model: {params / 1e6:.1f} M params, checkpoint ~{state_mb:.0f} MiB "
            f"(fp32 weights + AdamW); {args.steps} steps, save every {args.every}; "
            f"torch {torch.__version__}, {os.cpu_count()} CPUs"
        )
        results = {mode: run(mode, args, root) for mode in ("none", "sync", "async")}
        print(f"{'mode':<6} {'step ms':>8} {'save blocks ms':>15} {'wall s':>7}")
        for mode, r in results.items():
            print(f"{mode:<6} {r['step_ms']:>8.1f} {r['save_block_ms']:>15.1f} {r['wall_s']:>7.2f}")
        sync, asy = results["sync"], results["async"]
        print(
            f"async blocks the loop {sync['save_block_ms'] / max(asy['save_block_ms'], 1e-9):.1f}x "
            f"less per save; wall {sync['wall_s'] / asy['wall_s']:.2f}x of sync"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
