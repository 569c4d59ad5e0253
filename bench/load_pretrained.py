"""Benchmark: ``ckptools.load_pretrained`` into an FSDP2 model against one ``cat`` of the files.

Generates a Llama-shaped fp32 Hugging Face model directory with transformers itself
(``LlamaForCausalLM`` from a ``LlamaConfig``, random init, ``save_pretrained`` in 500 MB shards),
then starts ``--world`` real ranks (``torch.multiprocessing`` + gloo). For ``--repeat`` rounds:

* rank 0 runs ``cat`` of every ``*.safetensors`` file to ``/dev/null`` (the floor: every byte
  read once, from the page cache, by one process) while the others wait at a barrier;
* rank 0 reads every file into freshly allocated memory (the floor for any loader whose
  destination is new memory: the kernel zeroes each page on first touch);
* every rank builds the model on the meta device, ``fully_shard``\\s each decoder layer and the
  root, allocates its shard with ``to_empty(device="cpu")`` (pages not touched yet), resets its
  peak resident set (``/proc/self/clear_refs``) and, between two barriers, calls
  ``ckptools.load_pretrained``. The wall time is the slowest rank's; each rank reports its peak
  resident set over the call minus its resident set before it, and its shard's bytes (the
  pages the load touches for the first time count here: the extra is shard + overhead); then
  it loads again into the same model, whose pages are now touched (ckptools' own cost).

The page cache is warm (files were just written; the machine gives no way to drop it), so this
measures the CPU cost of moving bytes, which is what ranks sharing a node pay.

Usage::

    python bench/load_pretrained.py --size-gb 2.0 --world 4 --repeat 3 [--workdir /tmp/lpbench]
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

# Llama-like shapes per target size: (hidden, intermediate, vocab, layers); fp32, untied.
SHAPES = {
    0.5: (1024, 2816, 32000, 5),
    2.0: (2048, 5632, 32000, 7),
}


def _config(shape: tuple[int, int, int, int]) -> Any:
    from transformers import LlamaConfig

    hidden, inter, vocab, layers = shape
    return LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=hidden // 128, num_key_value_heads=hidden // 128, head_dim=128,
        tie_word_embeddings=False,
    )  # fmt: skip


def generate(out: str, shape: tuple[int, int, int, int]) -> None:
    """The published model: transformers' own init and ``save_pretrained``."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(_config(shape)).save_pretrained(out, max_shard_size="500MB")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _read_into_fresh_memory(files: list[str]) -> float:
    """Seconds for one process to read every file into newly allocated memory (torch.empty, then
    one ``preadv`` per file): what any loader pays whose destination pages are touched for the
    first time (the kernel zeroes each page before the copy)."""
    import torch

    t = time.perf_counter()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            dst = torch.empty(size, dtype=torch.uint8)
            got = 0
            while got < size:
                got += os.preadv(fd, [memoryview(dst.numpy())[got:]], got)
            del dst
        finally:
            os.close(fd)
    return time.perf_counter() - t


def _worker(rank: int, world: int, src: str, shape: Any, port: int, repeat: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    import ckptools

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    files = sorted(glob.glob(os.path.join(src, "*.safetensors")))
    rounds: list[dict[str, Any]] = []
    for _ in range(repeat):
        cat_s = fresh_s = 0.0
        if rank == 0:
            t = time.perf_counter()
            subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
            cat_s = time.perf_counter() - t
            fresh_s = _read_into_fresh_memory(files)
        with torch.device("meta"):
            model = LlamaForCausalLM(_config(shape))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        shard = sum(p.to_local().nbytes for p in model.parameters())
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # peak resident set := current
        before = _status("VmRSS")
        dist.barrier()
        t = time.perf_counter()
        result = ckptools.load_pretrained(model, src)
        dist.barrier()
        load_s = time.perf_counter() - t
        assert tuple(result) == ([], []), result
        extra = _status("VmHWM") - before
        dist.barrier()
        t = time.perf_counter()
        ckptools.load_pretrained(model, src)  # again: the parameters' pages are touched now
        dist.barrier()
        again_s = time.perf_counter() - t
        rounds.append(
            {"cat_s": cat_s, "fresh_s": fresh_s, "load_s": load_s, "again_s": again_s,
             "extra": extra, "shard": shard}
        )  # fmt: skip
        del model
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, rounds)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-gb", type=float, default=2.0, choices=sorted(SHAPES))
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", default="/tmp/lpbench")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    import torch.multiprocessing as mp

    src = os.path.join(args.workdir, f"llama-{args.size_gb}gb")
    if not os.path.exists(os.path.join(src, "model.safetensors.index.json")):
        t = time.perf_counter()
        generate(src, SHAPES[args.size_gb])
        print(f"generated {src} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    nbytes = sum(os.path.getsize(p) for p in glob.glob(os.path.join(src, "*.safetensors")))
    out = os.path.join(args.workdir, "rounds.json")
    mp.spawn(
        _worker,
        args=(args.world, src, SHAPES[args.size_gb], _free_port(), args.repeat, out),
        nprocs=args.world,
        join=True,
    )
    with open(out) as f:
        per_rank = json.load(f)
    print(_report(per_rank, nbytes, args))
    if not args.keep:
        shutil.rmtree(args.workdir, ignore_errors=True)


def _report(per_rank: list[list[dict[str, Any]]], nbytes: int, args: Any) -> str:
    mib = 2**20
    cat = statistics.median(r["cat_s"] for r in per_rank[0])
    fresh = statistics.median(r["fresh_s"] for r in per_rank[0])
    load = statistics.median(r["load_s"] for r in per_rank[0])  # the same on every rank
    again = statistics.median(r["again_s"] for r in per_rank[0])
    lines = [
        f"{datetime.date.today()}, {platform.node()} ({os.cpu_count()} CPUs), "
        f"load average {os.getloadavg()[0]:.1f}; {nbytes / 1e9:.2f} GB of safetensors, "
        f"{args.world} FSDP2 ranks, median of {args.repeat}",
        "",
        "| what | wall s | x cat |",
        "| --- | ---: | ---: |",
        f"| cat of the files | {cat:.2f} | 1.00 |",
        f"| one process reads the files into fresh memory | {fresh:.2f} | {fresh / cat:.2f} |",
        f"| load_pretrained, {args.world} ranks, fresh model | {load:.2f} | {load / cat:.2f} |",
        f"| load_pretrained again, same model (pages touched) | {again:.2f} | {again / cat:.2f} |",
        "",
        "| rank | shard MiB | peak extra MiB (max over rounds) | extra - shard MiB |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for rank, rounds in enumerate(per_rank):
        shard = rounds[0]["shard"]
        extra = max(r["extra"] for r in rounds)
        lines.append(
            f"| {rank} | {shard / mib:.0f} | {extra / mib:.0f} | {(extra - shard) / mib:.0f} |"
        )
    lines.append("")
    lines.append("rounds (load s): " + ", ".join(f"{r['load_s']:.2f}" for r in per_rank[0]))
    lines.append("rounds (again s): " + ", ".join(f"{r['again_s']:.2f}" for r in per_rank[0]))
    lines.append("rounds (cat s): " + ", ".join(f"{r['cat_s']:.2f}" for r in per_rank[0]))
    lines.append("rounds (fresh s): " + ", ".join(f"{r['fresh_s']:.2f}" for r in per_rank[0]))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
