"""Benchmark: DeepSpeed ZeRO-2 and ZeRO-3 checkpoints -> HF model and -> FSDP2 DCP (issue 16).

Generates (or reuses, under ``--workdir``) one checkpoint per ZeRO stage, written by **real
DeepSpeed** on 2 CPU ranks launched by ``torchrun`` (gloo, ``DS_ACCELERATOR=cpu``): a
transformers ``LlamaForCausalLM`` built from a config (hidden 1024, MLP 2816, vocab 32000, 14
layers, untied head: 245 M parameters, 0.98 GB of fp32 masters), a bf16 module, torch's AdamW as
the client optimizer and one optimizer step so the moments are real; ``engine.save_checkpoint``
writes ``latest``, the tag directory (~3 GB of optimizer files, 0.5 GB of bf16 module) and its
``zero_to_fp32.py``; rank 0 writes the ``config.json`` beside them.

Then, per stage, alternating, for ``--repeat`` rounds, each tool in a fresh child (wall time
around it, peak RSS = the largest ``ru_maxrss`` among its descendants):

* floor (consolidate): the master bytes ckptools reads (every chunk's byte range in the rank
  optimizer files, adjacent ranges merged) copied with ``os.copy_file_range`` into one file,
  then ``fsync`` -- exactly the bytes read and written, with ckptools' durability;
* ``ckpt consolidate DIR OUT`` (fp32, bit-exact) and ``--dtype bfloat16`` (the usual export);
* DeepSpeed: ``python DIR/zero_to_fp32.py DIR OUT --safe_serialization`` (the script
  ``save_checkpoint`` puts in the checkpoint directory);
* floor (reshard): ``cp -r`` of the tag directory, then ``sync`` of the copied files;
* ``ckpt reshard DIR OUT --world-size N`` (masters and both moments: an FSDP2 DCP);
* DeepSpeed: ``python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state``
  (per-parameter ``.pt`` files for DeepSpeed only; its worker processes' peak is the largest
  single one, not their sum).

Before the first round the fp32 outputs of ``ckpt consolidate`` and ``zero_to_fp32`` are
compared tensor by tensor (bit-exact, same names) so a fast wrong answer cannot pass.
Before each tool the checkpoint is put in the same page-cache state (``--cache``): ``warm``
reads every file of it once (untimed), ``cold`` evicts its pages with ``POSIX_FADV_DONTNEED``
(this VM cannot ``drop_caches``; its host may still cache the disk). Prints medians, peak RSS and
the same-run ratios.

Usage::

    python bench/deepspeed.py --repeat 3 [--workdir /tmp/ckbench-ds] [--stages 2 3]
        [--world-size 4] [--cache warm|cold] [--keep]
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
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
# This file is bench/deepspeed.py: with bench/ on the path, ``import deepspeed`` would import it.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]

REPO = os.path.dirname(HERE)
#: the tag every checkpoint is saved under (DeepSpeed writes it to ``latest``)
TAG = "global_step1"
#: written last by rank 0: a checkpoint without it is a generation that was cut off
DONE = ".bench-complete"

FLOOR = """
import os, sys, json
ranges, out = json.loads(sys.argv[1]), sys.argv[2]
fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
pos = 0
for path, offset, length in ranges:
    src = os.open(path, os.O_RDONLY)
    done = 0
    while done < length:
        n = os.copy_file_range(src, fd, length - done, offset + done, pos)
        if n == 0:
            raise SystemExit(f"{path}: short read at {offset + done}")
        done += n
        pos += n
    os.close(src)
os.fsync(fd)
os.close(fd)
"""

COMPARE = """
import sys, os, json
import torch
from safetensors import safe_open
a_dir, b_dir = sys.argv[1:3]
def files(d):
    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = ["model.safetensors"]
    return [os.path.join(d, n) for n in names]
def where(d):
    out = {}
    for path in files(d):
        with safe_open(path, "pt") as f:
            out.update({k: path for k in f.keys()})
    return out
a, b = where(a_dir), where(b_dir)
if set(a) != set(b):
    raise SystemExit(f"names differ: {sorted(set(a) ^ set(b))[:5]}")
for k in sorted(a):
    with safe_open(a[k], "pt") as fa, safe_open(b[k], "pt") as fb:
        x, y = fa.get_tensor(k), fb.get_tensor(k)
    if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(torch.uint8),
                                                                    y.view(torch.uint8)):
        raise SystemExit(f"{k}: differs")
print(len(a))
"""


MEASURE = """
import resource, subprocess, sys, time, json
t = time.perf_counter()
subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)
dt = time.perf_counter() - t
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps([dt, ru.ru_maxrss * 1024, ru.ru_utime + ru.ru_stime]))
"""

#: one measured run: wall seconds, peak RSS bytes (largest descendant), CPU seconds (all of them)
Run = tuple[float, int, float]


def measure(cmd: list[str]) -> Run:
    """Wall time, peak RSS and CPU time of ``cmd`` run under a fresh wrapper process (whose
    only descendants are ``cmd``'s); stderr passes through, so a failing tool says why."""
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, *cmd], check=True, stdout=subprocess.PIPE, text=True
    )
    wall, rss, cpu = json.loads(done.stdout.strip().splitlines()[-1])
    return float(wall), int(rss), float(cpu)


def llama_config(layers: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=32000,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )


def produce_rank(out: str, stage: int, layers: int) -> None:
    """One torchrun rank: build the model, one DeepSpeed step, ``save_checkpoint(out)``.

    Every rank calls it (collective: ``deepspeed.initialize``, the step, the save).
    """
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = llama_config(layers)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": True},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    g = torch.Generator().manual_seed(1234 + rank)
    ids = torch.randint(0, config.vocab_size, (1, 32), generator=g)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(out, tag=TAG)
    dist.barrier()
    if rank == 0:
        config.save_pretrained(out)
        with open(os.path.join(out, DONE), "w") as f:
            f.write("ok\n")
    dist.barrier()
    dist.destroy_process_group()


def generate(out: str, stage: int, layers: int) -> None:
    """Write the ZeRO-``stage`` checkpoint into ``out`` with 2 torchrun ranks (unless there)."""
    if os.path.exists(os.path.join(out, DONE)):
        return
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [os.path.abspath(__file__), "--produce", out, "--stages", str(stage)]
    cmd += ["--layers", str(layers)]
    subprocess.run(cmd, check=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    print(f"generated {out} in {time.perf_counter() - t:.1f} s", file=sys.stderr)


def master_ranges(src: str) -> list[tuple[str, int, int]]:
    """The byte ranges ``ckpt consolidate`` reads: every chunk of the exported tensors, merged
    where one ends where the next begins (a rank's partition holds its parameters back to back).
    """
    sys.path.insert(0, REPO)
    from ckptools.producers import read_manifest
    from ckptools.verbs.consolidate import select_tensors

    manifest = read_manifest(src)
    root = manifest.data_root or manifest.root
    pieces = sorted(
        (os.path.join(root, c.file), c.offset, c.length)
        for fqn in select_tensors(manifest).values()
        for c in manifest.tensors[fqn].chunks
    )
    merged: list[tuple[str, int, int]] = []
    for path, off, n in pieces:
        if merged and merged[-1][0] == path and merged[-1][1] + merged[-1][2] == off:
            merged[-1] = (path, merged[-1][1], merged[-1][2] + n)
        else:
            merged.append((path, off, n))
    return merged


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def set_cache(src: str, state: str) -> None:
    """Put every file of ``src`` in the page cache (``warm``: read through once, untimed) or out
    of it (``cold``: ``POSIX_FADV_DONTNEED``; clean pages only, so after a ``sync``)."""
    for d, _, files in os.walk(src):
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                if state == "cold":
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    continue
                while os.read(fd, 1 << 24):
                    pass
            finally:
                os.close(fd)


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)


def tools_for(src: str, out: str, world_size: int) -> dict[str, list[str]]:
    """Each measured command, ``out`` being where it writes (removed before and after)."""
    tag_dir = os.path.join(src, TAG)
    ckpt = [sys.executable, "-m", "ckptools"]
    ranges = json.dumps(master_ranges(src))
    return {
        "floor: master bytes -> 1 file + fsync": [
            "sh",
            "-c",
            'mkdir "$0" && exec "$1" -c "$2" "$3" "$0/model.bin"',
            out,
            sys.executable,
            FLOOR,
            ranges,
        ],
        "ckpt consolidate": [*ckpt, "consolidate", src, out, "--quiet"],
        "ckpt consolidate --dtype bfloat16": [
            *ckpt,
            "consolidate",
            src,
            out,
            "--quiet",
            "--dtype",
            "bfloat16",
        ],
        "zero_to_fp32 --safe_serialization": [
            sys.executable,
            os.path.join(src, "zero_to_fp32.py"),
            src,
            out,
            "--safe_serialization",
        ],
        "floor: cp -r tag dir + sync": [
            "sh",
            "-c",
            'cp -r "$1" "$0" && find "$0" -type f -exec sync {} +',
            out,
            tag_dir,
        ],
        f"ckpt reshard --world-size {world_size}": [
            *ckpt,
            "reshard",
            src,
            out,
            "--world-size",
            str(world_size),
            "--quiet",
        ],
        "ds_to_universal": [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            tag_dir,
            "--output_folder",
            out,
            # DeepSpeed asks a Megatron-style client for ``universal_checkpoint_info``; a plain
            # model has none, and this flag is DeepSpeed's own way to proceed without it
            "--inject_missing_state",
        ],
    }


def check_same(src: str, out_a: str, out_b: str, zero_cmd: list[str]) -> int:
    """Run ``ckpt consolidate`` and ``zero_to_fp32`` once and compare their outputs bit-exactly;
    returns how many tensors matched."""
    ckpt = [sys.executable, "-m", "ckptools", "consolidate", src, out_a, "--quiet"]
    subprocess.run(ckpt, check=True, stdout=subprocess.DEVNULL)
    subprocess.run(zero_cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    done = subprocess.run(
        [sys.executable, "-c", COMPARE, out_a, out_b], check=True, stdout=subprocess.PIPE, text=True
    )
    return int(done.stdout.strip().splitlines()[-1])


def bench_stage(stage: int, args: Any) -> str:
    src = os.path.join(args.workdir, f"zero{stage}")
    generate(src, stage, args.layers)
    out = os.path.join(args.workdir, "out")
    tools = tools_for(src, out, args.world_size)
    _remove(out)
    _remove(out + "-b")
    zero_cmd = [*tools["zero_to_fp32 --safe_serialization"][:2], src, out + "-b"]
    zero_cmd += ["--safe_serialization"]
    matched = check_same(src, out, out + "-b", zero_cmd)
    _remove(out)
    _remove(out + "-b")
    results: dict[str, list[Run]] = {k: [] for k in tools}
    for _ in range(args.repeat):
        for name, cmd in tools.items():
            _remove(out)
            subprocess.run(["sync"], check=True)
            set_cache(src, args.cache)
            time.sleep(1)  # the previous tool's writeback settles before the next starts
            results[name].append(measure(cmd))
            _remove(out)
    masters = sum(n for _, _, n in master_ranges(src))
    return _report(stage, results, src, masters, matched, args)


def _report(
    stage: int, results: dict[str, list[Run]], src: str, masters: int, matched: int, args: Any
) -> str:
    def ratio(name: str, base: str) -> float:
        """Median over rounds of the two tools' wall times in the same round."""
        pairs = zip(results[name], results[base], strict=True)
        return statistics.median(a[0] / b[0] for a, b in pairs)

    tag_bytes = _du(os.path.join(src, TAG))
    lines = [
        f"### ZeRO-{stage}, 2 ranks: tag dir {tag_bytes / 1e9:.2f} GB, fp32 masters "
        f"{masters / 1e9:.2f} GB; median of {args.repeat} alternating rounds, "
        f"page cache {args.cache}",
        "",
        f"ckpt consolidate == zero_to_fp32 bit-exactly ({matched} tensors, same names). Ratios "
        "are medians of the same-round ratios; floor = the row's own floor (consolidate: master "
        "bytes; reshard and ds_to_universal: cp -r).",
        "",
        "| tool | wall s (median) | min s | CPU s (median) | peak RSS MiB | x floor "
        "| x zero_to_fp32 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, runs in results.items():
        reshaping = name.startswith(("floor: cp", "ckpt reshard", "ds_to"))
        floor = (
            "floor: cp -r tag dir + sync" if reshaping else "floor: master bytes -> 1 file + fsync"
        )
        lines.append(
            f"{row_head(name, runs)} | {ratio(name, floor):.2f} | "
            f"{ratio(name, 'zero_to_fp32 --safe_serialization'):.2f} |"
        )
    return "\n".join([*lines, "", each_round(results)])


def row_head(name: str, runs: list[Run]) -> str:
    """``| tool | wall s (median) | min s | CPU s (median) | peak RSS MiB`` of one table row."""
    walls = [r[0] for r in runs]
    return (
        f"| {name} | {statistics.median(walls):.2f} | {min(walls):.2f} | "
        f"{statistics.median(r[2] for r in runs):.2f} | {max(r[1] for r in runs) / 2**20:.0f}"
    )


def each_round(results: dict[str, list[Run]]) -> str:
    """Every round's wall time per tool, after a table."""
    return "each round's wall s: " + "; ".join(
        f"{name} " + " ".join(f"{r[0]:.2f}" for r in runs) for name, runs in results.items()
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/ckbench-ds")
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3], choices=[1, 2, 3])
    ap.add_argument("--layers", type=int, default=14)
    ap.add_argument("--world-size", type=int, default=4, help="ckpt reshard's target")
    ap.add_argument(
        "--cache",
        choices=["warm", "cold"],
        default="warm",
        help="before each tool, read the checkpoint into the page cache, or evict it (fadvise)",
    )
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoints")
    ap.add_argument("--produce", metavar="DIR", help=argparse.SUPPRESS)  # a torchrun rank
    args = ap.parse_args()
    if args.produce:
        produce_rank(args.produce, args.stages[0], args.layers)
        return
    os.makedirs(args.workdir, exist_ok=True)
    os.environ.update(DS_ACCELERATOR="cpu", PYTHONPATH=REPO)
    # An installed package runs from its bytecode (DeepSpeed's is in site-packages); a checkout
    # under PYTHONDONTWRITEBYTECODE would compile ckptools' sources in every run (~0.12 s here).
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    for stage in args.stages:  # all generated first: a generation failure costs no timing
        generate(os.path.join(args.workdir, f"zero{stage}"), stage, args.layers)
    now = datetime.datetime.now(datetime.timezone.utc)
    print(
        f"{platform.node()}: {os.cpu_count()} CPUs, {platform.platform()}, python "
        f"{platform.python_version()}, {now:%Y-%m-%d %H:%M} UTC, load {os.getloadavg()[0]:.1f}\n"
    )
    for stage in args.stages:
        print(bench_stage(stage, args), "\n", flush=True)
    # ds_to_universal writes ``latest_universal`` beside its output folder
    _remove(os.path.join(args.workdir, "latest_universal"))
    if not args.keep:
        for stage in args.stages:
            shutil.rmtree(os.path.join(args.workdir, f"zero{stage}"), ignore_errors=True)


if __name__ == "__main__":
    main()
