"""Benchmark: reading and planning a Llama-3.1-405B-shaped FSDP2 DCP checkpoint at R ranks.

A separate script from ``bench/scale.py`` (which measures torchrun scale-out of a *real*
FSDP2 checkpoint's copy): this one needs no tensor bytes at all. It writes the ``.metadata``
that FSDP2's ``dcp.save`` would write for a 405B model, with torch's own metadata classes
(``Metadata``, ``TensorStorageMetadata``, ``ChunkStorageMetadata``, ``MetadataIndex``,
``_StorageInfo``) pickled as ``FileSystemWriter.finish`` does, over **sparse** ``.distcp`` files
of the exact sizes the metadata records, so that every file-size check passes and the disk holds
nothing but the metadata. Shapes: 126 layers, hidden 16384, ffn 53248, vocab 128256, 8 kv heads
(head dim 128), bf16, every tensor ``Shard(0)`` split as ``torch.chunk`` splits it (FSDP2's rule;
identical empty trailing shards recorded once, as DCP dedups them). ``--layers`` and ``--ranks``
take any value; ``--optim`` adds AdamW state (``exp_avg``, ``exp_avg_sq`` sharded like the
parameter, a replicated 0-d ``step`` per parameter, ``param_groups`` as pickled objects).

Then, each command a fresh process, in the same run:

* torch: ``FileSystemReader(d).read_metadata()`` (imports torch, unpickles with the unchecked C
  unpickler into torch's dataclasses): the 1.0x of every ratio;
* ``ckpt inspect --json``; ``ckpt consolidate --dry-run``; ``ckpt reshard --world-size W
  --dry-run``;
* optionally (``--torchrun``) ``torchrun --nproc-per-node 2 -m ckptools reshard ... --dry-run``.

Wall time of the whole process, its CPU time (user + sys) and its peak RSS (``ru_maxrss`` of the
child, from ``wait4``). Run from the repository root::

    python bench/scale_405b.py --ranks 1024 [--layers 126] [--optim] [--target-world 2048]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Llama-3.1-405B (config.json of meta-llama/Llama-3.1-405B)
HIDDEN, FFN, VOCAB, KV_HEADS, HEADS = 16384, 53248, 128256, 8, 128
HEAD_DIM = HIDDEN // HEADS
#: DCP records each chunk's ``torch.save`` blob: the raw bytes plus ~1.5 KB of zip records
#: (tests/support/producers.py measures the same constant on torch 2.13)
TORCH_SAVE_OVERHEAD_BYTES = 1513


def llama_shapes(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """FQN and shape of every parameter of a Llama-3.1-405B-shaped model with ``layers`` layers,
    in ``model.named_parameters()`` order (HF names)."""
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    kv = KV_HEADS * HEAD_DIM
    for i in range(layers):
        p = f"model.layers.{i}"
        out += [
            (f"{p}.self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
            (f"{p}.self_attn.k_proj.weight", (kv, HIDDEN)),
            (f"{p}.self_attn.v_proj.weight", (kv, HIDDEN)),
            (f"{p}.self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
            (f"{p}.mlp.gate_proj.weight", (FFN, HIDDEN)),
            (f"{p}.mlp.up_proj.weight", (FFN, HIDDEN)),
            (f"{p}.mlp.down_proj.weight", (HIDDEN, FFN)),
            (f"{p}.input_layernorm.weight", (HIDDEN,)),
            (f"{p}.post_attention_layernorm.weight", (HIDDEN,)),
        ]
    out += [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]
    return out


def generate(
    out: str, layers: int, ranks: int, *, optim: bool = False, row_width: int | None = None
) -> dict[str, Any]:
    """Write the ``.metadata`` and sparse ``.distcp`` files of a 405B-shaped FSDP2 save at
    ``ranks`` ranks into ``out`` (replaced); returns counts for the report.

    ``row_width``: every tensor of two dims keeps its first dim, so its chunks are the same,
    but holds ``row_width`` elements per row, and the ``.distcp`` files hold real items instead
    of holes: each chunk a ``torch.save`` archive of zeros (what DCP writes per chunk), each
    object one of a float. A checkpoint with the real chunk count that a *writing* reshard can
    copy: at 1,024 ranks and width 1, ~1.16M chunks in ~1.8 GB (~1.5 KiB of archive each).
    """
    import io

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    bf16 = TensorProperties(dtype=torch.bfloat16)
    fp32 = TensorProperties(dtype=torch.float32)
    state_md: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, tuple[str, ...]] = {}
    file_end = [0] * ranks
    # one name per file, shared by its items, as FileSystemWriter records them
    file_names = [f"__{r}_0.distcp" for r in range(ranks)]
    n_chunks = 0
    items: list[list[bytes]] = [[] for _ in range(ranks)]  # with row_width: each file's items
    archives: dict[Any, bytes] = {}  # one archive per (dtype, sizes) or value: zeros are alike

    def archive(value: Any, key: Any) -> bytes:
        if key not in archives:
            buf = io.BytesIO()
            torch.save(value() if callable(value) else value, buf)
            archives[key] = buf.getvalue()
        return archives[key]

    def place(r: int, length: int, data: bytes | None) -> int:
        """Append an item of ``length`` bytes (``data``, with row_width) to rank file r."""
        if row_width is not None:
            assert data is not None
            items[r].append(data)
            length = len(data)
        file_end[r] += length
        return length

    def sharded(fqn: str, shape: tuple[int, ...], props: Any, itemsize: int, path: tuple) -> None:
        nonlocal n_chunks
        rows = shape[0]
        per = math.ceil(rows / ranks)
        rest = shape[1:] if row_width is None or len(shape) < 2 else (row_width,)
        shape = (rows, *rest)
        row_elems = math.prod(rest)
        dtype = props.dtype
        chunks: list[Any] = []
        for r in range(ranks):
            start = min(r * per, rows)
            size = min(per, rows - start)
            if size == 0 and chunks and chunks[-1].sizes[0] == 0:
                continue  # DCP dedups identical chunks: empty trailing shards once
            chunk = ChunkStorageMetadata(
                offsets=torch.Size([start, *(0 for _ in rest)]), sizes=torch.Size([size, *rest])
            )
            chunks.append(chunk)
            length = size * row_elems * itemsize + TORCH_SAVE_OVERHEAD_BYTES
            sizes = (size, *rest)
            data = None if row_width is None else archive(
                functools.partial(torch.zeros, sizes, dtype=dtype), (dtype, sizes)
            )  # fmt: skip
            offset = file_end[r]
            length = place(r, length, data)
            storage[MetadataIndex(fqn, chunk.offsets, len(chunks) - 1)] = _StorageInfo(
                relative_path=file_names[r], offset=offset, length=length
            )
        state_md[fqn] = TensorStorageMetadata(
            properties=props, size=torch.Size(shape), chunks=chunks
        )
        planner[fqn] = path
        n_chunks += len(chunks)

    def replicated_scalar(fqn: str, path: tuple) -> None:
        nonlocal n_chunks
        chunk = ChunkStorageMetadata(offsets=torch.Size([]), sizes=torch.Size([]))
        data = None if row_width is None else archive(functools.partial(torch.zeros, ()), "step")
        offset = file_end[0]
        length = place(0, 4 + TORCH_SAVE_OVERHEAD_BYTES, data)
        storage[MetadataIndex(fqn, chunk.offsets, 0)] = _StorageInfo(
            relative_path=file_names[0], offset=offset, length=length
        )
        state_md[fqn] = TensorStorageMetadata(properties=fp32, size=torch.Size([]), chunks=[chunk])
        planner[fqn] = path
        n_chunks += 1

    params = llama_shapes(layers)
    for fqn, shape in params:
        sharded(f"model.{fqn}", shape, bf16, 2, ("model", fqn))
    if optim:
        for fqn, shape in params:
            for k in ("exp_avg", "exp_avg_sq"):
                sharded(f"optim.state.{fqn}.{k}", shape, bf16, 2, ("optim", "state", fqn, k))
            replicated_scalar(f"optim.state.{fqn}.step", ("optim", "state", fqn, "step"))
        for k in ("lr", "betas", "eps", "weight_decay", "amsgrad", "params"):
            fqn = f"optim.param_groups.0.{k}"  # DCP keeps non-tensor values as pickled items
            state_md[fqn] = BytesStorageMetadata()
            data = None if row_width is None else archive(0.001, "object")
            offset = file_end[0]
            storage[MetadataIndex(fqn)] = _StorageInfo(file_names[0], offset, place(0, 64, data))
            planner[fqn] = ("optim", "param_groups", "0", k)
    metadata = Metadata(
        state_dict_metadata=state_md,
        planner_data=planner,
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=pathlib.Path(out), save_id=str(uuid.UUID(int=0))),
        version="1.0.0",
    )
    for r in range(ranks):
        with open(os.path.join(out, f"__{r}_0.distcp"), "wb") as f:
            if row_width is None:
                f.truncate(file_end[r])  # sparse: the sizes the metadata records, no data
            else:
                f.write(b"".join(items[r]))
    import pickle

    with open(os.path.join(out, ".metadata"), "wb") as f:  # as FileSystemWriter.finish does
        pickle.dump(metadata, f)
    return {
        "tensors": len(state_md),
        "chunks": n_chunks,
        "metadata_mib": os.path.getsize(os.path.join(out, ".metadata")) / 2**20,
        "stored_gib": sum(file_end) / 2**30,
    }


def checkpoint_dir(
    workdir: str, layers: int, ranks: int, optim: bool, row_width: int | None
) -> str:
    """Where :func:`generate`'s checkpoint of these parameters is kept."""
    width = "" if row_width is None else f"-w{row_width}"
    return os.path.join(workdir, f"llama405b-{layers}L-{ranks}r" + "-optim" * optim + width)


@dataclass
class Result:
    wall_s: float
    cpu_s: float
    rss_mib: float


def measure(cmd: list[str], env: dict[str, str] | None = None) -> Result:
    """Wall, CPU (user + sys) and peak RSS of ``cmd`` (its own process; for torchrun, the
    largest of the launcher and its workers, as ``RUSAGE_CHILDREN`` of the launcher reports)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env=env)
    _, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise subprocess.CalledProcessError(os.waitstatus_to_exitcode(status), cmd)
    return Result(wall, ru.ru_utime + ru.ru_stime, ru.ru_maxrss / 1024)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=126)
    ap.add_argument("--optim", action="store_true", help="add AdamW state")
    ap.add_argument(
        "--row-width", type=int, default=None,
        help="rows of this many elements and real items instead of sparse files (generate())",
    )  # fmt: skip
    ap.add_argument("--target-world", type=int, default=2048)
    ap.add_argument("--workdir", default="/tmp/ckbench")
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoint")
    ap.add_argument("--generate-only", action="store_true")
    ap.add_argument("--torchrun", action="store_true", help="also time reshard under torchrun x2")
    ap.add_argument(
        "--only", default="", help="comma-separated row names to run (torch,inspect,cons,reshard)"
    )
    args = ap.parse_args()
    src = checkpoint_dir(args.workdir, args.layers, args.ranks, args.optim, args.row_width)
    if not os.path.exists(os.path.join(src, ".metadata")):
        t = time.perf_counter()
        info = generate(src, args.layers, args.ranks, optim=args.optim, row_width=args.row_width)
        print(f"generated {src} in {time.perf_counter() - t:.1f} s: {info}", file=sys.stderr)
    if args.generate_only:
        return
    py = sys.executable
    env = {**os.environ, "PYTHONPATH": ROOT}
    ckpt = [py, "-m", "ckptools"]
    out = os.path.join(args.workdir, "scale405b-out")
    torch_read = (
        "import sys, torch.distributed.checkpoint as d; "
        "d.FileSystemReader(sys.argv[1]).read_metadata()"
    )
    rows: dict[str, list[str]] = {
        "torch": [py, "-c", torch_read, src],
        "inspect": [*ckpt, "inspect", src, "--json"],
        "cons": [*ckpt, "consolidate", src, out, "--dry-run"],
        "reshard": [
            *ckpt,
            "reshard",
            src,
            out,
            "--world-size",
            str(args.target_world),
            "--dry-run",
        ],
    }
    if args.torchrun:
        rows["torchrun"] = [
            os.path.join(os.path.dirname(py), "torchrun"), "--nproc-per-node=2",
            "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29531", "--max-restarts=0",
            "-m", "ckptools", "reshard", src, out, "--world-size", str(args.target_world),
            "--dry-run",
        ]  # fmt: skip
    names = {
        "torch": "torch `read_metadata()`",
        "inspect": "`ckpt inspect --json`",
        "cons": "`ckpt consolidate --dry-run`",
        "reshard": f"`ckpt reshard --world-size {args.target_world} --dry-run`",
        "torchrun": f"`torchrun --nproc-per-node 2 -m ckptools reshard ... {args.target_world}`",
    }
    only = [k for k in args.only.split(",") if k] or list(rows)
    if "torch" not in only:
        only.insert(0, "torch")
    results = {k: measure(rows[k], env) for k in only}
    load = os.getloadavg()
    base = results["torch"].wall_s
    meta_mib = os.path.getsize(os.path.join(src, ".metadata")) / 2**20
    print(
        f"\n{args.layers} layers x {args.ranks} ranks{' + AdamW' if args.optim else ''}, "
        f".metadata {meta_mib:.0f} MiB; {platform.node()}, {os.cpu_count()} CPUs, "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"load {load[0]:.1f}/{load[1]:.1f}\n"
    )
    print("| command | wall s | CPU s | x torch (wall) | peak RSS MiB |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for k, r in results.items():
        print(
            f"| {names[k]} | {r.wall_s:.1f} | {r.cpu_s:.1f} | {r.wall_s / base:.2f} "
            f"| {r.rss_mib:.0f} |"
        )
    shutil.rmtree(out, ignore_errors=True)
    if not args.keep:
        shutil.rmtree(src, ignore_errors=True)


if __name__ == "__main__":
    main()
