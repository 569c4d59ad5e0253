"""Benchmark: ``consolidate --adapter`` / ``--merge-lora`` on a PEFT LoRA DCP, against ``cp -r``.

Builds a Llama-shaped fp32 model of about ``--size-gb`` (built on the meta device, then filled),
wraps it with peft's ``get_peft_model`` (LoRA r=16 on q/k/v/o), and saves
``{"model": get_model_state_dict(model)}`` with ``dcp.save`` (one process). Then, alternating for
``--repeat`` rounds, each in a fresh child process:

* ``cp -r SRC DST && sync``: reads and writes every byte once (the floor of any full copy);
* ``consolidate --adapter``: should read only the adapter's bytes;
* ``consolidate --merge-lora``: every byte, plus one row block per merged weight;
* plain ``consolidate`` (the wrapped names as stored), for reference.

Reported per command: wall time (median), the child's peak RSS, and the bytes it read through
``read``-family calls (``rchar`` of ``/proc/self/io``: page-cache hits included, python's own
counted around the call alone, after the imports). The page cache is warm.

With ``--base REV``, ``--merge-lora`` also runs from revision ``REV`` (exported as files,
``PYTHONPATH`` pointing at them) in every round, beside the current tree's: a same-run A/B.

Usage::

    python bench/lora.py --size-gb 2 --repeat 3 [--base REV] [--workdir /tmp/lorabench] [--keep]
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

sys.path.insert(0, os.path.dirname(__file__))

# Imports are timed apart (peft, which --adapter uses for LoraConfig's defaults, pulls in torch
# and transformers: seconds on a loaded machine), each mode importing what it uses (peft only
# for --adapter: peak RSS is the command's own); rchar is counted around the call alone.
_CHILD = r"""
import json, resource, sys, time
def rchar():
    return int(dict(l.split(": ") for l in open("/proc/self/io").read().splitlines())["rchar"])
src, out, mode = sys.argv[1:4]
t = time.perf_counter()
import ckptools, torch
if mode == "adapter":
    import peft  # what --adapter imports for LoraConfig's defaults; --merge-lora does not
imports = time.perf_counter() - t
kw = {"adapter": dict(adapter=True, lora_alpha=32.0),
      "merge": dict(merge_lora=True, lora_alpha=32.0), "plain": {}}[mode]
before, t = rchar(), time.perf_counter()
r = ckptools.consolidate(src, out, quiet=True, overwrite=True, **kw)
wall = time.perf_counter() - t
print(json.dumps({"wall_s": wall, "import_s": imports, "read": rchar() - before,
                  "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "written": r.bytes_written}))
"""


def make_checkpoint(path: str, size_gb: float) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp
    from peft import LoraConfig, get_peft_model
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden = 2048
    per_layer = 4 * hidden * hidden + 3 * hidden * 5632  # attention + MLP, fp32 elements
    layers = max(1, round(size_gb * 1e9 / 4 / per_layer))
    cfg = LlamaConfig(
        vocab_size=32000, hidden_size=hidden, intermediate_size=5632, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=16, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        base = LlamaForCausalLM(cfg)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model = get_peft_model(base, lora)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=gen)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(path)
    adapter = sum(p.numel() * 4 for n, p in model.named_parameters() if "lora_" in n)
    total = sum(p.numel() * 4 for p in model.parameters())
    return {"layers": layers, "total_bytes": total, "adapter_bytes": adapter}


def _tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = args.workdir
    src = os.path.join(work, "src")
    if os.path.exists(work):
        shutil.rmtree(work)
    os.makedirs(work)
    # a child makes it: ru_maxrss survives fork and exec, so the children measured later must
    # not descend from a process that held the model
    made = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--make", src, "--size-gb", str(args.size_gb)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    info = json.loads(made.stdout.strip().splitlines()[-1])
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"": here}
    if args.base:
        from ab import _export  # bench/ab.py: the package at a revision, as files

        trees["_base"] = _export(args.base, work)
    modes = [("adapter", ""), ("merge", ""), ("plain", "")] + [("merge", "_base")] * bool(args.base)
    times: dict[str, list[dict[str, Any]]] = {"cp": [], **{m + t: [] for m, t in modes}}
    for _ in range(args.repeat):
        dst = os.path.join(work, "cp")
        shutil.rmtree(dst, ignore_errors=True)
        t = time.perf_counter()
        subprocess.run(["bash", "-c", f"cp -r {src} {dst} && sync {dst}"], check=True)
        times["cp"].append({"wall_s": time.perf_counter() - t})
        shutil.rmtree(dst)
        for mode, tree in modes:
            out = os.path.join(work, mode + tree)
            done = subprocess.run(
                # -P: PYTHONPATH's tree, never the current directory's (the repository root)
                [sys.executable, "-P", "-c", _CHILD, src, out, mode],
                check=True, capture_output=True, text=True,
                env={**os.environ, "PYTHONPATH": trees[tree]},
            )  # fmt: skip
            times[mode + tree].append(json.loads(done.stdout.strip().splitlines()[-1]))
            shutil.rmtree(out)
    summary = {}
    for mode, runs in times.items():
        row: dict[str, Any] = {"wall_s": round(statistics.median(r["wall_s"] for r in runs), 3)}
        for k in ("import_s", "rss", "read", "written"):
            if k in runs[0]:
                row[k] = max(r[k] for r in runs)
        summary[mode] = row
    summary["ratios"] = {
        "cp_over_adapter": round(summary["cp"]["wall_s"] / summary["adapter"]["wall_s"], 2),
        "merge_over_cp": round(summary["merge"]["wall_s"] / summary["cp"]["wall_s"], 2),
    }
    if args.base:
        summary["ratios"]["merge_over_base"] = round(
            statistics.median(
                a["wall_s"] / b["wall_s"]
                for a, b in zip(times["merge"], times["merge_base"], strict=True)
            ),
            2,
        )
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "checkpoint": {**info, "on_disk_bytes": _tree_bytes(src)},
        "repeat": args.repeat,
        "results": summary,
    }
    if not args.keep:
        shutil.rmtree(work)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", default="/tmp/lorabench")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--base", help="also run --merge-lora from this git revision (A/B)")
    parser.add_argument("--make", metavar="PATH", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.make:
        print(json.dumps(make_checkpoint(args.make, args.size_gb)))
        return
    print(json.dumps(run(args), indent=2))


if __name__ == "__main__":
    main()
