"""Benchmark: per-rank checkpoints (issue 15) -> HF model and -> FSDP2 DCP, beside the producers'
own mergers and ``cp -r``.

Generates (or reuses, under ``--workdir``) three ~2 GB checkpoints, each written by its real
producer on 2 CPU ranks (gloo):

* ``verl/``: verl 0.9.1's ``FSDPCheckpointManager.save_checkpoint`` (FSDP2 through verl's own
  ``apply_fsdp2``) of a transformers ``LlamaForCausalLM`` from a config (hidden 1024, MLP 2816,
  vocab 32000, 8 layers, untied head: 168 M parameters, fp32) after one AdamW step:
  ``model_world_size_2_rank_r.pt`` (0.67 GB), ``optim_...`` (1.35 GB), ``extra_state_...``,
  ``fsdp_config.json`` and ``huggingface/``. verl cannot share ckptools' environment (it pins
  ``transformers<5.11``), so this part runs in ``--verl-python`` (the venv
  ``fixtures/verl/generate.py`` describes);
* ``dcp_rank_local/``: the same model under ``fully_shard``, ``{"model", "optim"}`` from
  ``get_state_dict`` saved by ``dcp.save(..., use_collectives=False)`` (``__r.metadata`` per rank,
  no ``.metadata``);
* ``hf_distributed/``: transformers' ``save_pretrained(..., distributed_checkpoint=True)`` of a
  Llama loaded at TP 2 (``DistributedConfig(tp_size=2)``; hidden 2048, MLP 5632, 7 layers:
  491 M parameters, 1.96 GB fp32, model only), o_proj and down_proj sliced on dim 1.

Then, per checkpoint, alternating, for ``--repeat`` rounds, each tool in a fresh child (wall time
around it, peak RSS = the largest ``ru_maxrss`` among its descendants; the same page-cache state
before each, ``--cache``): ``ckpt consolidate`` (fp32, bit-exact; and ``--dtype bfloat16`` for
verl), the producer's own merger where there is one (verl: ``python -m verl.model_merger merge
--backend fsdp``, which always writes bf16 -- it calls ``.bfloat16()`` on every shard and has no
flag for fp32; transformers: ``consolidate_distributed_checkpoint``), ``ckpt reshard --world-size
4``, and the floors: ``cp -r`` + ``sync`` of the files the consolidation reads (verl: the model
files; rank-local DCP: the model's byte ranges inside the ``.distcp`` files, copied with
``copy_file_range`` + ``fsync``; transformers: the whole directory) and of the whole directory
(reshard). Before the first round the outputs of ckpt and of the producer's merger are compared
tensor by tensor (bit-exact after the same cast). Prints medians, peak RSS and same-round ratios.

Usage::

    python bench/per_rank.py --repeat 3 [--workdir /tmp/ckbench-pr] [--cache warm|cold]
        [--cases verl dcp_rank_local hf_distributed] [--verl-python PYTHON] [--keep]
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


def _load_ds_bench() -> Any:
    """bench/deepspeed.py (measure, the byte floor, cache states, the compare script), loaded
    under its own name: as ``deepspeed`` it would shadow the package for anything that probes it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ds_bench", os.path.join(HERE, "deepspeed.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ds_bench = _load_ds_bench()

REPO = os.path.dirname(HERE)
DONE = ds_bench.DONE
CASES = ("verl", "dcp_rank_local", "hf_distributed")
#: the Llama of the verl and rank-local DCP checkpoints: 168 M fp32 parameters, 2.0 GB with AdamW
SMALL = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8}
#: the Llama of the transformers checkpoint (model only): 491 M fp32 parameters, 1.96 GB
LARGE = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 7}

TRANSFORMERS_CONSOLIDATE = """
import sys
from transformers.distributed import consolidate_distributed_checkpoint
consolidate_distributed_checkpoint(sys.argv[1], sys.argv[2])
"""


def llama(shape: dict[str, int]) -> Any:
    """A fp32 ``LlamaForCausalLM`` from a config, seeded (every rank builds the same one)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        **shape,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=32000,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    config.architectures = ["LlamaForCausalLM"]
    return LlamaForCausalLM(config).float()


def _step(model: Any, rank: int) -> Any:
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    g = torch.Generator().manual_seed(1234 + rank)
    ids = torch.randint(0, 32000, (1, 16), generator=g)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    return opt


def _tokenizer() -> Any:
    """A word-level fast tokenizer built here (no download): verl's manager saves it beside the
    config, as a run's does, and verl's merger will not finish without one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(1000)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def produce_rank(case: str, out: str) -> None:
    """One torchrun rank of ``case``'s producer; every rank calls it (collective saves)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if case == "verl":
        from torch.distributed.device_mesh import init_device_mesh
        from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
        from verl.utils.fsdp_utils import apply_fsdp2

        model = llama(SMALL)
        # the mesh verl's FSDP workers build (named "fsdp": its merger refuses any other name)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
        apply_fsdp2(model, {"mesh": mesh}, {})
        opt = _step(model, rank)
        manager = FSDPCheckpointManager(model, opt, None, processing_class=_tokenizer())
        manager.save_checkpoint(out, global_step=1)
    elif case == "dcp_rank_local":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.fsdp import fully_shard

        model = llama(SMALL)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        opt = _step(model, rank)
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=out, use_collectives=False)
    else:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.distributed import DistributedConfig

        src = out + "-src"
        if rank == 0:
            llama(LARGE).save_pretrained(src)
        dist.barrier()
        model = AutoModelForCausalLM.from_pretrained(
            src, distributed_config=DistributedConfig(tp_size=2), dtype=torch.float32
        )
        model.save_pretrained(out, distributed_checkpoint=True)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(src)
    dist.barrier()
    if rank == 0:
        with open(os.path.join(out, DONE), "w") as f:
            f.write("ok\n")
    dist.barrier()
    dist.destroy_process_group()


def generate(case: str, out: str, python: str) -> None:
    """Write ``case``'s checkpoint into ``out``: 2 torchrun ranks of ``python`` (unless there)."""
    if os.path.exists(os.path.join(out, DONE)):
        return
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [os.path.abspath(__file__), "--produce", case, out]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the producer's own world
    subprocess.run(cmd, check=True, env=env)
    print(f"generated {out} in {time.perf_counter() - t:.1f} s", file=sys.stderr)


def _files(src: str, prefix: str) -> list[str]:
    return sorted(os.path.join(src, n) for n in os.listdir(src) if n.startswith(prefix))


def _cp_sync(out: str, *paths: str) -> list[str]:
    """``cp -r`` of ``paths`` into a new ``out``, then ``sync`` of every copied file."""
    script = 'mkdir "$0" && cp -r "$@" "$0" && find "$0" -type f -exec sync {} +'
    return ["sh", "-c", script, out, *paths]


def tools_for(
    case: str, src: str, out: str, args: Any
) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Each measured command (``out`` is where it writes), and each one's floor."""
    ckpt = [sys.executable, "-m", "ckptools"]
    consolidate = [*ckpt, "consolidate", src, out, "--quiet"]
    reshard = [*ckpt, "reshard", src, out, "--world-size", str(args.world_size), "--quiet"]
    whole = _cp_sync(out, *_files(src, ""))
    if case == "verl":
        model_floor = "floor: cp -r model files + sync"
        tools = {
            model_floor: _cp_sync(out, *_files(src, "model_world_size_")),
            "ckpt consolidate": consolidate,
            "ckpt consolidate --dtype bfloat16": [*consolidate, "--dtype", "bfloat16"],
            "verl model_merger (bf16)": [
                args.verl_python,
                "-m",
                "verl.model_merger",
                "merge",
                "--backend",
                "fsdp",
                "--local_dir",
                src,
                "--target_dir",
                out,
            ],
        }
    elif case == "dcp_rank_local":
        model_floor = "floor: model byte ranges -> 1 file + fsync"
        ranges = json.dumps(ds_bench.master_ranges(src))
        floor = ["sh", "-c", 'mkdir "$0" && exec "$1" -c "$2" "$3" "$0/model.bin"']
        tools = {
            model_floor: [*floor, out, sys.executable, ds_bench.FLOOR, ranges],
            "ckpt consolidate": consolidate,
        }
    else:
        model_floor = "floor: cp -r dir + sync"
        tools = {
            model_floor: whole,
            "ckpt consolidate": consolidate,
            "transformers consolidate_distributed_checkpoint": [
                sys.executable,
                "-c",
                TRANSFORMERS_CONSOLIDATE,
                src,
                out,
            ],
        }
    floors = dict.fromkeys(tools, model_floor)
    if case != "hf_distributed":  # model only: nothing to resume training from, no reshard
        name = f"ckpt reshard --world-size {args.world_size}"
        tools["floor: cp -r dir + sync"] = whole
        tools[name] = reshard
        floors["floor: cp -r dir + sync"] = floors[name] = "floor: cp -r dir + sync"
    return tools, floors


def check_same(case: str, src: str, tools: dict[str, list[str]], out: str) -> str:
    """Run ckpt and the producer's merger once and compare their outputs bit-exactly."""
    pairs = {
        "verl": ("ckpt consolidate --dtype bfloat16", "verl model_merger (bf16)"),
        "hf_distributed": ("ckpt consolidate", "transformers consolidate_distributed_checkpoint"),
    }
    if case not in pairs:
        return "no merger of its own to compare with (torch's dcp.load(no_dist=True) reads half)"
    a, b = pairs[case]
    outs = []
    for name, tag in ((a, "-a"), (b, "-b")):
        cmd = [x if x != out else out + tag for x in tools[name]]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        outs.append(out + tag)
    done = subprocess.run(
        [sys.executable, "-c", ds_bench.COMPARE, *outs],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    for o in outs:
        ds_bench._remove(o)
    return f"{a} == {b} bit-exactly ({done.stdout.strip().splitlines()[-1]} tensors, same names)"


def bench_case(case: str, args: Any) -> str:
    src = os.path.join(args.workdir, case)
    out = os.path.join(args.workdir, "out")
    tools, floors = tools_for(case, src, out, args)
    ds_bench._remove(out)
    matched = check_same(case, src, tools, out)
    results: dict[str, list[ds_bench.Run]] = {k: [] for k in tools}
    for _ in range(args.repeat):
        for name, cmd in tools.items():
            ds_bench._remove(out)
            subprocess.run(["sync"], check=True)
            ds_bench.set_cache(src, args.cache)
            time.sleep(1)  # the previous tool's writeback settles before the next starts
            results[name].append(ds_bench.measure(cmd))
            ds_bench._remove(out)
    return _report(case, src, results, floors, matched, args)


def _report(
    case: str,
    src: str,
    results: dict[str, list[ds_bench.Run]],
    floors: dict[str, str],
    matched: str,
    args: Any,
) -> str:
    def ratio(name: str, base: str) -> float:
        """Median over rounds of the two tools' wall times in the same round."""
        pairs = zip(results[name], results[base], strict=True)
        return statistics.median(a[0] / b[0] for a, b in pairs)

    total = ds_bench._du(src)
    lines = [
        f"### {case}, 2 ranks: {total / 1e9:.2f} GB; median of {args.repeat} alternating rounds, "
        f"page cache {args.cache}",
        "",
        matched + ". Ratios are medians of the same-round ratios to the row's own floor.",
        "",
        "| tool | wall s (median) | min s | CPU s (median) | peak RSS MiB | x floor | floor |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, runs in results.items():
        lines.append(
            f"{ds_bench.row_head(name, runs)} | {ratio(name, floors[name]):.2f} | "
            f"{floors[name].removeprefix('floor: ')} |"
        )
    return "\n".join([*lines, "", ds_bench.each_round(results)])


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/ckbench-pr")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--world-size", type=int, default=4, help="ckpt reshard's target")
    ap.add_argument("--verl-python", default="/tmp/verlenv/bin/python")
    ap.add_argument("--cache", choices=["warm", "cold"], default="warm")
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoints")
    ap.add_argument("--produce", nargs=2, metavar=("CASE", "DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.produce:
        produce_rank(*args.produce)
        return
    os.makedirs(args.workdir, exist_ok=True)
    for case in args.cases:  # all generated first: a generation failure costs no timing
        python = args.verl_python if case == "verl" else sys.executable
        generate(case, os.path.join(args.workdir, case), python)
    os.environ["PYTHONPATH"] = REPO
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # see bench/deepspeed.py
    now = datetime.datetime.now(datetime.timezone.utc)
    print(
        f"{platform.node()}: {os.cpu_count()} CPUs, {platform.platform()}, python "
        f"{platform.python_version()}, {now:%Y-%m-%d %H:%M} UTC, load {os.getloadavg()[0]:.1f}\n"
    )
    for case in args.cases:
        print(bench_case(case, args), "\n", flush=True)
    if not args.keep:
        for case in args.cases:
            shutil.rmtree(os.path.join(args.workdir, case), ignore_errors=True)


if __name__ == "__main__":
    main()
