"""Benchmark: a ``torch.save`` training checkpoint -> HF model and -> FSDP2 DCP, against ``cp``.

Generates (or reuses) the file a DDP or FSDP1-tutorial script writes,
``torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": n}, path)``,
for a Llama-shaped fp32 model with AdamW state after one step (by default ~0.67 GB of weights,
~2.0 GB in all), then, alternating, for ``--repeat`` rounds, measures in fresh children:

* ``cp`` + ``sync`` of the file (the floor: every byte read and written once, durably);
* ``ckpt consolidate FILE OUT`` (the model part: a third of the bytes);
* ``ckpt reshard FILE OUT --world-size 8`` (model and optimizer: every tensor byte);
* torch: ``torch.load`` + ``safetensors.torch.save_file`` of the model (the usual script);
* torch: ``torch.load`` + ``dcp.save`` of model and optimizer (keyed as the file keys them).

Prints medians, peak RSS and the ratios to ``cp`` + ``sync``.

Usage::

    python bench/torch_save.py --repeat 3 [--workdir /tmp/ckbench-ts] [--layers 8]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
import consolidate as gen  # the measuring wrapper

TORCH_SAFETENSORS = """
import sys, torch
from safetensors.torch import save_file
src, out = sys.argv[1:3]
sd = torch.load(src, weights_only=True, mmap=True)["model"]
save_file(sd, out, metadata={"format": "pt"})
"""

TORCH_DCP = """
import sys, torch
import torch.distributed.checkpoint as dcp
src, out = sys.argv[1:3]
state = torch.load(src, weights_only=True, mmap=True)
dcp.save({"model": state["model"], "optim": state["optimizer"]}, checkpoint_id=out, no_dist=True)
"""


def generate(path: str, layers: int) -> None:
    """The checkpoint: Llama shapes (hidden 1024, MLP 2816, vocab 32000), AdamW after one step."""
    import torch
    from torch import nn

    hidden, inter, vocab = 1024, 2816, 32000
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(hidden, hidden, bias=False) for _ in range(4)]
        blocks += [nn.Linear(hidden, inter, bias=False), nn.Linear(hidden, inter, bias=False)]
        blocks += [nn.Linear(inter, hidden, bias=False), nn.RMSNorm(hidden), nn.RMSNorm(hidden)]
    model = nn.Sequential(nn.Embedding(vocab, hidden), *blocks, nn.Linear(hidden, vocab))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--workdir", default="/tmp/ckbench-ts")
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    src = os.path.join(args.workdir, f"checkpoint-{args.layers}l.pth")
    if not os.path.exists(src):
        t = time.perf_counter()
        generate(src, args.layers)
        print(f"generated {src} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    nbytes = os.path.getsize(src)
    ckpt = [sys.executable, "-m", "ckptools"]
    tools: dict[str, list[str]] = {
        "cp + sync": ["sh", "-c", f'mkdir "$0" && cp "{src}" "$0"/ && sync "$0"/*', "{out}"],
        "ckpt consolidate": [*ckpt, "consolidate", src, "{out}", "--quiet"],
        "ckpt reshard --world-size 8": [
            *ckpt,
            "reshard",
            src,
            "{out}",
            "--world-size",
            "8",
            "--quiet",
        ],
        "torch.load + save_file (model)": [sys.executable, "-c", TORCH_SAFETENSORS, src, "{out}"],
        "torch.load + dcp.save (model + optim)": [sys.executable, "-c", TORCH_DCP, src, "{out}"],
    }
    results: dict[str, list[tuple[float, int]]] = {k: [] for k in tools}
    out = os.path.join(args.workdir, "out")
    for _ in range(args.repeat):
        for name, cmd in tools.items():
            _remove(out)
            subprocess.run(["sync"], check=True)
            results[name].append(gen._measure([c.replace("{out}", out) for c in cmd]))
            _remove(out)
    print(_report(results, nbytes, args))


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)


def _report(results: dict[str, list[tuple[float, int]]], nbytes: int, args: Any) -> str:
    floor = statistics.median(w for w, _ in results["cp + sync"])
    lines = [
        f"### {nbytes / 1e9:.2f} GB torch.save training checkpoint (model + AdamW), "
        f"median of {args.repeat} alternating rounds",
        "",
        "| tool | wall s (median) | peak RSS MiB | x cp + sync |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, runs in results.items():
        med = statistics.median(w for w, _ in runs)
        rss = max(r for _, r in runs) / 2**20
        lines.append(f"| {name} | {med:.2f} | {rss:.0f} | {med / floor:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
