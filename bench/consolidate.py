"""Benchmark: ``ckpt consolidate`` against ``cp -r`` (the physical floor) and torch's own paths.

Generates a Llama-shaped fp32 checkpoint written by **4 real FSDP2 ranks**
(``torch.multiprocessing`` + gloo + ``fully_shard`` on a model built on the meta device, so each
rank allocates only its shard; model state only, saved as
``{"model": get_model_state_dict(model)}`` with ``dcp.save``), then, alternating, for
``--repeat`` rounds, measures:

* ``cp -r SRC DST``: reads and writes every byte once;
* ``ckpt consolidate SRC OUT --quiet``;
* torch: ``dcp_to_torch_save`` to a ``.pt``, ``torch.load``, ``safetensors.torch.save_file``;
* torch: ``dcp.load`` into preallocated tensors, then ``save_file``;
* ``accelerate merge-weights`` when accelerate is installed.

Each command runs in a fresh child; wall time is measured around it, CPU time (user + sys) and
peak RSS are the child's (the wrapper has that one child); ``× cp`` is the median of same-round
ratios. ckpt runs as ``python -P -m ckptools`` with this checkout on ``PYTHONPATH`` (an editable
install elsewhere does not win; the tree it imports is printed). The page cache is warm (the
machine gives no way to drop it), so all tools read from memory and write to the page cache +
disk; ckpt fsyncs its output before the rename that commits it, so ``cp -r`` + ``sync`` of the
copied files is listed as a second floor.

Usage::

    python bench/consolidate.py --size-gb 0.5 --repeat 3 [--workdir /tmp/ckbench] [--keep]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

# Llama-like shapes per target size: (hidden, intermediate, vocab, layers); fp32.
SHAPES = {
    0.5: (1024, 2816, 32000, 5),
    2.0: (2048, 5632, 32000, 7),
    6.0: (3072, 8192, 32000, 11),
}


def build_fsdp2_model(shape: tuple[int, int, int, int], world: int) -> Any:
    """A Llama-shaped model (HF FQNs), FSDP2-sharded over ``world`` CPU ranks, allocated only as
    each rank's shard (built on the meta device). Collective: every rank calls it."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    hidden, inter, vocab, layers = shape

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.self_attn = nn.ModuleDict(
                {
                    k: nn.Linear(hidden, hidden, bias=False)
                    for k in ("q_proj", "k_proj", "v_proj", "o_proj")
                }
            )
            self.mlp = nn.ModuleDict(
                {
                    "gate_proj": nn.Linear(hidden, inter, bias=False),
                    "up_proj": nn.Linear(hidden, inter, bias=False),
                    "down_proj": nn.Linear(inter, hidden, bias=False),
                }
            )
            self.input_layernorm = nn.LayerNorm(hidden, bias=False)
            self.post_attention_layernorm = nn.LayerNorm(hidden, bias=False)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Module()
            self.model.embed_tokens = nn.Embedding(vocab, hidden)
            self.model.layers = nn.ModuleList(Block() for _ in range(layers))
            self.model.norm = nn.LayerNorm(hidden, bias=False)
            self.lm_head = nn.Linear(hidden, vocab, bias=False)

    with torch.device("meta"):
        model = Model()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    return model


def _worker(
    rank: int, world: int, out: str, shape: tuple[int, int, int, int], port: int, optim: bool
) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = build_fsdp2_model(shape, world)
    g = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for p in model.parameters():
            local = p._local_tensor
            local.copy_(torch.rand(local.shape, generator=g))
    if optim:
        # get_state_dict initialises AdamW's state (exp_avg, exp_avg_sq, step) for every param,
        # which is what a model + optimizer checkpoint holds.
        opt = torch.optim.AdamW(model.parameters())
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=out)
    else:
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=out)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    import socket

    with socket.socket() as s:  # a free port: other jobs on the machine may hold 29500
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def generate(out: str, size_gb: float, world: int = 4, *, optim: bool = False) -> None:
    """Write the benchmark checkpoint: ``SHAPES[size_gb]`` saved by ``world`` FSDP2 ranks."""
    import torch.multiprocessing as mp

    shape = SHAPES[size_gb]
    mp.spawn(_worker, args=(world, out, shape, free_port(), optim), nprocs=world, join=True)


def measure(cmd: list[str]) -> tuple[float, int, float]:
    """Wall seconds, peak RSS bytes and CPU seconds (user + sys) of ``cmd`` run in a fresh
    wrapper process."""
    code = (
        "import resource, subprocess, sys, time, json\n"
        "t = time.perf_counter()\n"
        "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)\n"
        "dt = time.perf_counter() - t\n"
        "ru = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
        "print(json.dumps([dt, ru.ru_maxrss * 1024, ru.ru_utime + ru.ru_stime]))\n"
    )
    # stderr passes through, so a failing tool says why
    out = subprocess.run(
        [sys.executable, "-c", code, *cmd], check=True, stdout=subprocess.PIPE, text=True
    )
    wall, rss, cpu = json.loads(out.stdout.strip().splitlines()[-1])
    return float(wall), int(rss), float(cpu)


def _measure(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS bytes of ``cmd`` (what the other benches take)."""
    wall, rss, _ = measure(cmd)
    return wall, rss


#: this checkout, which the ckpt children import (not whatever tree an editable install names)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ckpt_command() -> list[str]:
    """``python -P -m ckptools`` importing this checkout only (``-P``: no current directory
    ahead of ``PYTHONPATH``); prints which ckptools that is, once."""
    env = ["env", f"PYTHONPATH={REPO}"]
    code = "import ckptools; print(ckptools.__file__)"
    where = subprocess.run([*env, sys.executable, "-P", "-c", code], check=True,
                           capture_output=True, text=True).stdout.strip()  # fmt: skip
    print(f"ckpt runs {where}", file=sys.stderr)
    return [*env, sys.executable, "-P", "-m", "ckptools"]


TORCH_SAVE_PATH = """
import sys, torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from safetensors.torch import save_file
src, out, tmp = sys.argv[1:4]
dcp_to_torch_save(src, tmp)
sd = torch.load(tmp, weights_only=True)["model"]
save_file(sd, out, metadata={"format": "pt"})
"""

TORCH_LOAD_PATH = """
import sys, torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
src, out = sys.argv[1:3]
meta = dcp.FileSystemReader(src).read_metadata().state_dict_metadata
sd = {k.removeprefix("model."): torch.empty(m.size, dtype=m.properties.dtype)
      for k, m in meta.items() if k.startswith("model.")}
dcp.load({"model": sd}, checkpoint_id=src, no_dist=True)
save_file(sd, out, metadata={"format": "pt"})
"""


def _du(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(dirpath, f))
    return total


def plan_timing(workdir: str, n_tensors: int, ranks: int) -> str:
    """Time reading the manifest and planning for synthetic 405B-shaped DCP metadata.

    Uses the test suite's generator of valid DCP ``.metadata`` (run from the repository root).
    """
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from ckptools.plan.safetensors import plan_consolidation
    from ckptools.producers import read_manifest
    from ckptools.verbs.consolidate import select_tensors
    from tests.support.producers import big_many_tensors_metadata

    src = os.path.join(workdir, f"meta-{n_tensors}x{ranks}")
    big_many_tensors_metadata(src, n_tensors, ranks, sized_files=True)
    t0 = time.perf_counter()
    manifest = read_manifest(src)
    t1 = time.perf_counter()
    names = select_tensors(manifest)
    plan = plan_consolidation(manifest, names, max_shard_size=5 * 10**9)
    t2 = time.perf_counter()
    chunks = sum(len(t.chunks) for t in plan.tensors)
    shutil.rmtree(src, ignore_errors=True)
    return (
        f"{n_tensors} tensors x {ranks} ranks ({chunks} chunks): read manifest {t1 - t0:.2f} s, "
        f"select + plan {t2 - t1:.2f} s"
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size-gb", type=float, default=0.5, choices=sorted(SHAPES))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/ckbench")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoint")
    ap.add_argument(
        "--plan-only",
        metavar="TENSORSxRANKS",
        help="only time manifest + planning for synthetic metadata, e.g. 1000x1024",
    )
    args = ap.parse_args()
    if args.plan_only:
        n, ranks = (int(x) for x in args.plan_only.split("x"))
        print(plan_timing(args.workdir, n, ranks))
        return

    src = os.path.join(args.workdir, f"fsdp2-{args.size_gb}gb")
    if not os.path.exists(os.path.join(src, ".metadata")):
        shutil.rmtree(src, ignore_errors=True)
        t = time.perf_counter()
        generate(src, args.size_gb)
        print(f"generated {src} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    nbytes = _du(src)
    ckpt_cmd = [*ckpt_command(), "consolidate", src, "{out}", "--quiet"]
    if args.workers:
        ckpt_cmd += ["--workers", str(args.workers)]
    tools: dict[str, list[str]] = {
        "cp -r": ["cp", "-r", src, "{out}"],
        # ckpt fsyncs its output before the atomic rename; this is the floor with that durability.
        "cp -r + sync": ["sh", "-c", f'cp -r "{src}" "$0" && sync "$0"/*', "{out}"],
        "ckpt consolidate": ckpt_cmd,
        "torch dcp_to_torch_save+save_file": [
            sys.executable,
            "-c",
            TORCH_SAVE_PATH,
            src,
            "{out}.safetensors",
            "{out}.pt",
        ],
        "torch dcp.load+save_file": [
            sys.executable,
            "-c",
            TORCH_LOAD_PATH,
            src,
            "{out}.safetensors",
        ],
    }
    if shutil.which("accelerate"):
        tools["accelerate merge-weights"] = ["accelerate", "merge-weights", src, "{out}"]
    results: dict[str, list[tuple[float, int, float]]] = {k: [] for k in tools}
    for r in range(args.repeat):
        for name, cmd in tools.items():
            out = os.path.join(args.workdir, f"out-{r}")
            for p in (out, out + ".pt", out + ".safetensors"):
                shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else (
                    os.remove(p) if os.path.exists(p) else None
                )
            subprocess.run(["sync"], check=True)
            results[name].append(measure([c.replace("{out}", out) for c in cmd]))
            for p in (out, out + ".pt", out + ".safetensors"):
                shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else (
                    os.remove(p) if os.path.exists(p) else None
                )
    report = _report(results, nbytes, args)
    print(report)
    if not args.keep:
        shutil.rmtree(src, ignore_errors=True)


def _report(results: dict[str, list[tuple[float, int, float]]], nbytes: int, args: Any) -> str:
    cp = [w for w, _, _ in results["cp -r"]]
    now = datetime.datetime.now(datetime.timezone.utc)
    lines = [
        f"### {nbytes / 1e9:.2f} GB fp32 FSDP2 checkpoint (4 ranks, model only), "
        f"median of {args.repeat} alternating runs",
        "",
        f"{platform.node()}: {os.cpu_count()} CPUs, {platform.platform()}, python "
        f"{platform.python_version()}, {now:%Y-%m-%d %H:%M} UTC, load {os.getloadavg()[0]:.1f}",
        "",
        "| tool | wall s (median) | min s | CPU s (median) | GB/s | peak RSS MiB | × cp |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, runs in results.items():
        walls = [w for w, _, _ in runs]
        med = statistics.median(walls)
        cpu = statistics.median(c for _, _, c in runs)
        rss = max(r for _, r, _ in runs)
        ratio = statistics.median(w / c for w, c in zip(walls, cp, strict=True))  # same-round
        lines.append(
            f"| {name} | {med:.2f} | {min(walls):.2f} | {cpu:.2f} | {nbytes / med / 1e9:.2f} | "
            f"{rss / 2**20:.0f} | {ratio:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_NOFILE, resource.getrlimit(resource.RLIMIT_NOFILE))
    main()
