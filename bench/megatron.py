"""Benchmark (issue 26 §6): ``ckpt consolidate`` of a ~1 GB Megatron-core ``torch_dist`` checkpoint
against ``cp -r`` of the same bytes and the path a user without Megatron has: torch's DCP
(``dcp.load`` of the model tensors, or ``dcp_to_torch_save``) plus a mapping script (unstack the
layers, split QKV per query group and fc1 into gate/up, drop the vocabulary padding, rename to
HF), then ``safetensors.torch.save_file``.

The checkpoint is written once by **real Megatron-core** (its own venv, see
``fixtures/megatron/make_venv.sh``): ``fixtures/megatron/generate.py bench-model`` under torchrun
builds a Llama-shaped ``GPTModel`` (local spec, bf16 in ``Float16Module``, GQA, swiglu, untied,
vocab 32000, layers to reach ``--size-gb``) at TP ``--tp``, PP 1, and saves it with Megatron-LM's
``save_checkpoint`` without optimizer state (``--no-save-optim``), plus
``<run>-hf/config.json`` (the equivalent ``LlamaConfig``). Then, alternating for ``--repeat``
rounds (each command in a fresh child; wall time around it, peak RSS = the child's
``ru_maxrss``, CPU = its user + sys: on a shared machine the steadier figure; warm page
cache; the order of the tools rotates each round):

* ``cp -r ITER_DIR OUT`` and ``cp -r`` + ``sync`` (the floors);
* ``ckpt consolidate RUN_DIR OUT --config HF_DIR --quiet`` (the command line is ``--ckpt-args``);
* torch ``dcp.load`` into preallocated tensors + mapping + ``save_file``;
* torch ``dcp_to_torch_save`` + ``torch.load`` + mapping + ``save_file`` (it has to unpickle
  Megatron's objects, ``args`` with Megatron enums among them: without Megatron installed it
  fails, and the table says so).

``--moe`` (issue 38): a Mixtral-shaped MoE instead, written by ``generate.py bench-moe-model``
(bf16, every layer 8 swiglu experts top-2 with a softmax router, hidden 1024, expert ffn 2816,
GQA 16/4, vocab 32000, untied, layers to reach ``--size-gb``) at TP ``--tp`` (default 1) x EP
``--ep`` (default 2) on TP x EP ranks, with ``<run>-hf/config.json`` its ``MixtralConfig``.
The torch rows' mapping is the dense Llama one, so an MoE run times the floors and ckpt only
(``--no-torch`` leaves the torch rows out of a dense run too).

Before the rounds the tree's ``ckptools`` is byte-compiled (``compileall``): where
``PYTHONDONTWRITEBYTECODE`` is set (this project's machines) every ckpt child would otherwise
compile its ~190 modules from source (~0.4 s), which no installed ckptools pays. The load
average (1 min) before each round is printed with the table. One untimed ckpt run comes first
(page cache, and the conversion kept in the user's cache).

Usage (the main venv runs this; the generator runs in the Megatron venv)::

    python bench/megatron.py --workdir /tmp/mgbench --size-gb 1.0 --tp 2 --repeat 3 \\
        [--megatron-python /work/megatron-venv/bin/python] [--keep] [--no-torch]
    python bench/megatron.py --moe --workdir /tmp/mgbench --size-gb 1.2 --tp 1 --ep 2 \\
        --repeat 5 --keep [--base REV]

``--base REV`` adds a row: ckpt from git revision ``REV`` (exported as files), in the same
rounds, so a change is measured against its parent under the same load.

Targets from the issues: consolidate ≤ 1.25× ``cp`` (+ ``sync``) and ≤ 512 MiB peak RSS
(issue 26, dense); for the MoE run (issue 38) ≤ 1.25× ``cp -r`` + ``sync`` and ≤ 256 MiB.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from consolidate import _du, measure  # the measuring wrapper

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GENERATOR = os.path.join(REPO, "fixtures", "megatron", "generate.py")

#: the mapping a user writes without Megatron: Megatron-core's GPT names/layouts -> HF Llama
MAPPING = """
import json, sys, torch

def to_hf(sd, config):
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    groups, vocab = config["num_key_value_heads"], config["vocab_size"]
    d = config.get("head_dim") or hidden // heads
    q_rows = heads // groups * d
    out = {
        "model.embed_tokens.weight": sd.pop("embedding.word_embeddings.weight")[:vocab],
        "model.norm.weight": sd.pop("decoder.final_layernorm.weight"),
    }
    if "output_layer.weight" in sd:
        out["lm_head.weight"] = sd.pop("output_layer.weight")[:vocab]
    stacked = {
        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
        "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
        "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for src, dst in stacked.items():
            out[p + dst] = sd["decoder.layers." + src][i]
        qkv = sd["decoder.layers.self_attention.linear_qkv.weight"][i].reshape(groups, -1, hidden)
        out[p + "self_attn.q_proj.weight"] = qkv[:, :q_rows].reshape(-1, hidden).clone()
        out[p + "self_attn.k_proj.weight"] = qkv[:, q_rows:q_rows + d].reshape(-1, hidden).clone()
        out[p + "self_attn.v_proj.weight"] = qkv[:, q_rows + d:].reshape(-1, hidden).clone()
        gate, up = sd["decoder.layers.mlp.linear_fc1.weight"][i].chunk(2)
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
    return {k: v.contiguous() for k, v in out.items()}
"""

DCP_LOAD = (
    MAPPING
    + """
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from safetensors.torch import save_file
src, out, cfg = sys.argv[1:4]
meta = dcp.FileSystemReader(src).read_metadata().state_dict_metadata
sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
      if isinstance(m, TensorStorageMetadata) and not k.startswith("optimizer.")}
dcp.load(sd, checkpoint_id=src, no_dist=True)
save_file(to_hf(sd, json.load(open(cfg))), out, metadata={"format": "pt"})
"""
)

DCP_TO_TORCH_SAVE = (
    MAPPING
    + """
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from safetensors.torch import save_file
src, out, cfg, tmp = sys.argv[1:5]
dcp_to_torch_save(src, tmp)
sd = torch.load(tmp, weights_only=False)
sd = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
save_file(to_hf(sd, json.load(open(cfg))), out, metadata={"format": "pt"})
"""
)


def generate(
    workdir: str, size_gb: float, tp: int, megatron_python: str, ep: int | None = None
) -> str:
    """The run directory Megatron-core writes (reused when it is there); ``ep``: the MoE run
    at TP ``tp`` x EP ``ep`` (``bench-moe-model``), else the dense one."""
    name = (
        f"megatron-{size_gb}gb-tp{tp}" if ep is None else f"megatron-moe-{size_gb}gb-tp{tp}-ep{ep}"
    )
    run = os.path.join(workdir, name)
    if os.path.isfile(os.path.join(run, "latest_checkpointed_iteration.txt")):
        return run
    shutil.rmtree(run, ignore_errors=True)
    shutil.rmtree(run + "-hf", ignore_errors=True)
    mode = ["bench-model"] if ep is None else ["bench-moe-model", "--ep", str(ep)]
    cmd = [
        megatron_python,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={tp if ep is None else tp * ep}",
        "--master-port",
        str(29500 + os.getpid() % 1000),
        GENERATOR,
        *mode,
        "--out",
        run,
        "--hf-config-out",
        run + "-hf",
        "--size-gb",
        str(size_gb),
        "--tp",
        str(tp),
    ]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return run


def _iter_dir(run: str) -> str:
    with open(os.path.join(run, "latest_checkpointed_iteration.txt")) as f:
        return os.path.join(run, f"iter_{int(f.read().strip()):07d}")


def _clean(out: str) -> None:
    for p in (out, out + ".pt", out + ".safetensors"):
        if os.path.isdir(p):
            shutil.rmtree(p)
        elif os.path.exists(p):
            os.remove(p)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workdir", default="/tmp/mgbench")
    ap.add_argument("--size-gb", type=float, default=None, help="default 1.0 (--moe: 1.2)")
    ap.add_argument("--tp", type=int, default=None, help="default 2 (--moe: 1)")
    ap.add_argument("--moe", action="store_true", help="the Mixtral-shaped MoE run (issue 38)")
    ap.add_argument("--ep", type=int, default=2, help="--moe: expert-parallel size")
    ap.add_argument("--no-torch", action="store_true", help="time the floors and ckpt only")
    ap.add_argument("--base", help="also run ckpt from this git revision, in the same rounds (A/B)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--megatron-python", default="/work/megatron-venv/bin/python")
    ap.add_argument(
        "--ckpt-args",
        default="consolidate {run} {out} --config {hf} --quiet",
        help="ckpt's command line; {run}, {iter}, {hf} and {out} are filled in",
    )
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoint")
    args = ap.parse_args()
    if args.size_gb is None:
        args.size_gb = 1.2 if args.moe else 1.0
    if args.tp is None:
        args.tp = 1 if args.moe else 2
    os.makedirs(args.workdir, exist_ok=True)
    run = generate(
        args.workdir, args.size_gb, args.tp, args.megatron_python, args.ep if args.moe else None
    )
    # what an installed ckptools has: its modules byte-compiled (see the module's docstring)
    subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(REPO, "ckptools")],
                   check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    src, hf = _iter_dir(run), run + "-hf"
    cfg = os.path.join(hf, "config.json")
    nbytes = _du(src)
    # this tree's ckptools (-P: no current directory ahead of PYTHONPATH; an editable install
    # elsewhere does not win)
    ckpt = ["env", f"PYTHONPATH={REPO}", sys.executable, "-P", "-m", "ckptools"]
    fill = {"run": run, "iter": src, "hf": hf}
    tools: dict[str, list[str]] = {
        "cp -r": ["cp", "-r", src, "{out}"],
        "cp -r + sync": ["sh", "-c", f'cp -r "{src}" "$0" && sync "$0"/*', "{out}"],
        "ckpt consolidate": [
            *ckpt,
            *(a.format(**fill, out="{out}") for a in args.ckpt_args.split()),
        ],
        "torch dcp.load + mapping + save_file": [
            sys.executable,
            "-c",
            DCP_LOAD,
            src,
            "{out}.safetensors",
            cfg,
        ],
        "torch dcp_to_torch_save + mapping + save_file": [
            sys.executable,
            "-c",
            DCP_TO_TORCH_SAVE,
            src,
            "{out}.safetensors",
            cfg,
            "{out}.pt",
        ],
    }
    if args.moe or args.no_torch:
        tools = {k: v for k, v in tools.items() if not k.startswith("torch")}
    if args.base:
        from ab import _export  # bench/ab.py: the package at a revision, as files

        tree = _export(args.base, args.workdir)
        subprocess.run([sys.executable, "-m", "compileall", "-q", tree], check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        base_cmd = ["env", f"PYTHONPATH={tree}", sys.executable, "-P", "-m", "ckptools"]
        tools[f"ckpt consolidate at {args.base}"] = [
            *base_cmd,
            *(a.format(**fill, out="{out}") for a in args.ckpt_args.split()),
        ]
    # one untimed ckpt run first: the page cache holds the source, and the user's cache the
    # conversion transformers' mapping gives (derived once per config and transformers version,
    # with transformers imported: seconds, which every later run is spared)
    warm = os.path.join(args.workdir, "out-warm")
    _clean(warm)
    for name in [k for k in tools if k.startswith("ckpt")]:
        subprocess.run([c.replace("{out}", warm) for c in tools[name]], check=True)
        _clean(warm)
    results: dict[str, list[tuple[float, int, float]]] = {k: [] for k in tools}
    failed: dict[str, str] = {}
    loads: list[float] = []
    for r in range(args.repeat):
        loads.append(os.getloadavg()[0])
        # the order rotates each round: a tool that always ran right after another's output
        # was deleted (1 GB of page cache and extents freed) would always pay for it
        names = list(tools)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            cmd = tools[name]
            if name in failed:
                continue
            out = os.path.join(args.workdir, f"out-{r}")
            _clean(out)
            subprocess.run(["sync"], check=True)
            try:
                results[name].append(measure([c.replace("{out}", out) for c in cmd]))
            except subprocess.CalledProcessError as e:
                failed[name] = f"exit {e.returncode}"
            _clean(out)
    print(_report(results, failed, nbytes, args, loads))
    if not args.keep:
        shutil.rmtree(run, ignore_errors=True)
        shutil.rmtree(run + "-hf", ignore_errors=True)


def _report(
    results: dict[str, list[tuple[float, int, float]]],
    failed: dict[str, str],
    nbytes: int,
    args: argparse.Namespace,
    loads: list[float],
) -> str:
    cp_walls = [w for w, _, _ in results["cp -r"]]
    sync_walls = [w for w, _, _ in results["cp -r + sync"]]
    cp = statistics.median(cp_walls)
    now = datetime.datetime.now(datetime.timezone.utc)
    what = f"TP {args.tp}" if not args.moe else f"Mixtral-shaped MoE, TP {args.tp} x EP {args.ep}"
    lines = [
        f"### {nbytes / 1e9:.2f} GB ({nbytes / 2**30:.2f} GiB) bf16 Megatron-core torch_dist "
        f"checkpoint ({what}, model only), median of {args.repeat} alternating runs",
        "",
        f"{platform.node()}: {os.cpu_count()} CPUs, {platform.platform()}, python "
        f"{platform.python_version()}, {now:%Y-%m-%d %H:%M} UTC; load average (1 min) before "
        f"each round: {' '.join(f'{x:.1f}' for x in loads)}",
        "",
        "| tool | wall s (median) | min s | GB/s | peak RSS MiB | CPU s (median) | × cp | "
        "× cp + sync (same-round median) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, runs in results.items():
        if name in failed or not runs:
            lines.append(f"| {name} | failed ({failed.get(name, 'no run')}) | | | | | | |")
            continue
        walls = [w for w, _, _ in runs]
        med = statistics.median(walls)
        rss = max(r for _, r, _ in runs)
        cpu = statistics.median(c for _, _, c in runs)
        same_round = statistics.median(w / s for w, s in zip(walls, sync_walls, strict=False))
        lines.append(
            f"| {name} | {med:.2f} | {min(walls):.2f} | {nbytes / med / 1e9:.2f} | "
            f"{rss / 2**20:.0f} | {cpu:.2f} | {med / cp:.2f} | {same_round:.2f} |"
        )
    lines.append("")
    lines.append("each round's wall s: " + "; ".join(
        f"{name} " + " ".join(f"{w:.2f}" for w, _, _ in runs) for name, runs in results.items()
    ))  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
