"""Benchmark: ``ckpt consolidate --dtype bfloat16`` of an FP8 block-quantized model against
``cp -r`` of its files, in the same run, and (``--library``) against compressed-tensors' own
in-memory converter.

The source is synthetic weights in the real on-disk form llmcompressor's FP8_BLOCK writes
(compressed-tensors "float-quantized": ``weight`` F8_E4M3 + ``weight_scale`` bf16 blocks of
128x128, ``quantization_config`` in config.json), a Llama shape (hidden 2048, intermediate
5632, as many layers as ``--size-gb`` of FP8 weights asks), written with numpy (no NaN bytes).
Each command runs in a fresh child; wall time and the child's peak RSS (``wait4``) are
reported; ``cp -r`` is followed by ``sync`` of the copy in a second row (ckpt fsyncs its
output before its atomic rename).

``--library``: the converter users run today, in the compressed-tensors venv
(``fixtures/quantized/generate.py``'s): ``AutoModelForCausalLM.from_pretrained(src,
quantization_config=CompressedTensorsConfig(run_compressed=False))`` (decompressed in memory)
then ``save_pretrained``.

Usage::

    python bench/dequantize.py --size-gb 1.0 --repeat 3 [--baseline /tmp/old-tree]
        [--library /work/q-venv/bin/python] [--keep DIR]

``--baseline``: also time another tree's ``ckptools`` (``git archive`` of an older commit),
alternating with this one, for a before/after ratio in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HIDDEN, INTER, VOCAB, HEADS = 2048, 5632, 32000, 16
BLOCK = 128
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fp8(rng: Any, shape: tuple[int, int]) -> Any:
    import numpy as np

    q = rng.integers(0, 256, size=shape, dtype=np.uint8)
    q[(q & 0x7F) == 0x7F] = 0x3F  # no e4m3fn NaN
    return q


def _bf16(rng: Any, shape: tuple[int, ...], scale: float) -> Any:
    import numpy as np

    f = (rng.standard_normal(shape, dtype=np.float32) * scale).view(np.uint32)
    return (f >> 16).astype(np.uint16)


def write_model(path: str, size_gb: float) -> None:
    import numpy as np

    per_layer = 4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTER
    layers = max(1, math.ceil(size_gb * 2**30 / per_layer))
    rng = np.random.default_rng(0)
    os.makedirs(path, exist_ok=True)
    shapes = {}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in (
            ("self_attn.q_proj", (HIDDEN, HIDDEN)), ("self_attn.k_proj", (HIDDEN, HIDDEN)),
            ("self_attn.v_proj", (HIDDEN, HIDDEN)), ("self_attn.o_proj", (HIDDEN, HIDDEN)),
            ("mlp.gate_proj", (INTER, HIDDEN)), ("mlp.up_proj", (INTER, HIDDEN)),
            ("mlp.down_proj", (HIDDEN, INTER)),
        ):  # fmt: skip
            shapes[p + name + ".weight"] = ("F8_E4M3", shape)
            blocks = (math.ceil(shape[0] / BLOCK), math.ceil(shape[1] / BLOCK))
            shapes[p + name + ".weight_scale"] = ("BF16", blocks)
        shapes[p + "input_layernorm.weight"] = ("BF16", (HIDDEN,))
        shapes[p + "post_attention_layernorm.weight"] = ("BF16", (HIDDEN,))
    shapes["model.embed_tokens.weight"] = ("BF16", (VOCAB, HIDDEN))
    shapes["model.norm.weight"] = ("BF16", (HIDDEN,))
    shapes["lm_head.weight"] = ("BF16", (VOCAB, HIDDEN))
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    order = sorted(shapes, key=lambda n: (shapes[n][0] != "BF16", n))
    for name in order:
        dtype, shape = shapes[name]
        n = math.prod(shape) * (2 if dtype == "BF16" else 1)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for name in order:
            dtype, shape = shapes[name]
            if dtype == "F8_E4M3":
                f.write(_fp8(rng, shape).tobytes())
            elif name.endswith("weight_scale"):  # positive scales of a trained model's size
                s = np.abs(rng.standard_normal(shape, dtype=np.float32)) * 1e-3 + 1e-4
                f.write((s.view(np.uint32) >> 16).astype(np.uint16).tobytes())
            else:
                f.write(_bf16(rng, shape, 0.02).tobytes())
    weights = {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128],
               "symmetric": True, "dynamic": False}  # fmt: skip
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_hidden_layers": layers, "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS, "vocab_size": VOCAB, "torch_dtype": "bfloat16",
        "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
        "quantization_config": {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "format": "float-quantized"}},
        },
    }  # fmt: skip
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def timed(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, int]:
    """Wall seconds and the child's peak RSS in bytes."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if status != 0:
        raise SystemExit(
            f"{cmd[:4]} failed: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}"
        )
    return wall, usage.ru_maxrss * 1024


_LIBRARY = """
import sys, torch
from transformers import AutoModelForCausalLM
from transformers.utils.quantization_config import CompressedTensorsConfig
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16,
    quantization_config=CompressedTensorsConfig(run_compressed=False))
m.save_pretrained(sys.argv[2])
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--library", default=None, help="python of a venv with compressed-tensors")
    ap.add_argument("--keep", default=None)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each command (medians)")
    ap.add_argument("--baseline", default=None, help="another tree whose ckptools to time too")
    args = ap.parse_args()
    work = args.keep or tempfile.mkdtemp(prefix="bench-dequant-")
    src = os.path.join(work, "fp8")
    if not os.path.exists(os.path.join(src, "config.json")):
        # in a child: the timed children are forked from this process, and a child's peak
        # RSS starts at its parent's
        gen = f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); " \
              f"import dequantize; dequantize.write_model({src!r}, {args.size_gb})"  # fmt: skip
        subprocess.run([sys.executable, "-c", gen], check=True)
    size = sum(os.path.getsize(os.path.join(src, n)) for n in os.listdir(src))
    env = {**os.environ, "PYTHONPATH": REPO}
    commands = [
        ("cp -r", ["cp", "-r", src, os.path.join(work, "cp")], None),
        ("cp -r + sync", ["sh", "-c", f"cp -r {src} {work}/cps && sync {work}/cps/*"], None),
        ("ckpt consolidate --dtype bfloat16",
         [sys.executable, "-P", "-m", "ckptools", "consolidate", src, os.path.join(work, "ckpt"),
          "--dtype", "bfloat16", "--quiet"], env),
    ]  # fmt: skip
    if args.baseline:  # the same command with another tree's ckptools, in the same run
        base_env = {**os.environ, "PYTHONPATH": args.baseline}
        cmd = [*commands[2][1][:-4], os.path.join(work, "base"), "--dtype", "bfloat16", "--quiet"]
        commands.append((f"ckpt consolidate --dtype bfloat16 ({args.baseline})", cmd, base_env))
    runs: dict[str, list[tuple[float, int]]] = {name: [] for name, _, _ in commands}
    for _ in range(args.repeat):
        for name, cmd, cmd_env in commands:
            for out in ("cp", "cps", "ckpt", "base"):
                shutil.rmtree(os.path.join(work, out), ignore_errors=True)
            subprocess.run(["sync"], check=True)
            runs[name].append(timed(cmd, cmd_env))
    rows = [
        (name, statistics.median(w for w, _ in got), max(r for _, r in got), got)
        for name, got in runs.items()
    ]
    if args.library:
        wall, rss = timed([args.library, "-c", _LIBRARY, src, os.path.join(work, "lib")])
        rows.append(
            (
                "compressed-tensors from_pretrained(run_compressed=False) + save_pretrained",
                wall,
                rss,
                [(wall, rss)],
            )
        )
    base = rows[0][1]
    print(f"source: {size / 2**30:.2f} GiB ({src})")
    print("| command | wall s (median) | runs | vs cp -r | vs cp -r + sync | peak RSS MiB |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for name, wall, rss, got in rows:
        print(
            f"| {name} | {wall:.2f} | {[round(w, 2) for w, _ in got]} | {wall / base:.2f}x | "
            f"{wall / rows[1][1]:.2f}x | {rss / 2**20:.0f} |"
        )
    if args.library:
        out = os.path.join(work, "ckpt", "model.safetensors")
        lib = [
            os.path.join(work, "lib", n)
            for n in os.listdir(os.path.join(work, "lib"))
            if n.endswith(".safetensors")
        ]
        print(
            f"ckpt output {os.path.getsize(out)} bytes; "
            f"library's {sum(map(os.path.getsize, lib))} bytes"
        )
    if not args.keep:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
