"""Megatron's ground truth (``fixtures/megatron/<case>.truth.pt``) under the Hugging Face model's
names, mapped here from the documented layout (per query group: its q heads, then k, then v;
fc1: gate rows then up rows; the padded vocabulary cut), independently of ckptools."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from click.testing import CliRunner, Result

from ckptools.cli.main import cli

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "megatron"
#: the Megatron runs of MoE models (tests/integration/test_megatron_moe.py) and of multi-latent
#: attention (tests/integration/test_megatron_mla.py); the others are dense
#: (tests/integration/test_megatron.py)
MOE_CASES = (
    "mixtral_ep1",
    "mixtral_ep2",
    "mixtral_ep2_fully_reshardable",
    "mixtral_tp2_ep2_bf16",
    "qwen3_moe_ep2",
    "mixtral_pp2_ep2",
)
MLA_CASES = ("deepseek_v3_ep2", "mla_dense_tp2", "deepseek_v3_ep2_bf16")


def truth(case: str, where: Path = FIXTURES) -> dict[str, Any]:
    """The ground truth of the fixture ``case`` (``<case>.truth.pt`` in ``where``)."""
    out: dict[str, Any] = torch.load(where / f"{case}.truth.pt", weights_only=True)
    return out


def invoke(*args: str) -> Result:
    """``ckpt ARGS`` in this process (an exception propagates: a traceback is a failure)."""
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def ok(*args: str) -> dict[str, Any]:
    """``ckpt ARGS --json`` (quiet where the verb writes), which must exit 0: its JSON."""
    quiet = ("-q",) if args[0] not in ("inspect", "list") else ()
    result = invoke(*args, "--json", *quiet)
    assert result.exit_code == 0, result.output
    out: dict[str, Any] = json.loads(result.output)
    return out


def config_file(tmp_path: Path, case: str) -> Path:
    """The HF ``config.json`` the truth of ``case`` records, written under ``tmp_path``."""
    path = tmp_path / f"{case}-config.json"
    path.write_text(truth(case)["hf_config"])
    return path


def hf_truth(truth: dict[str, Any], section: str) -> dict[str, Any]:
    """The truth's per-layer Megatron tensors under the HF model's names."""
    cfg = truth["hf_config"]
    cfg = json.loads(cfg) if isinstance(cfg, str) else cfg
    heads, groups = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // heads
    vocab, q = cfg["vocab_size"], heads // groups
    out: dict[str, Any] = {}
    for name, t in truth[section].items():
        t = t.float()
        parts = name.split(".")
        if name == "embedding.word_embeddings.weight":
            out["model.embed_tokens.weight"] = t[:vocab]
        elif name == "output_layer.weight":
            out["lm_head.weight"] = t[:vocab]
        elif name == "decoder.final_layernorm.weight":
            out["model.norm.weight"] = t
        else:
            i, rest = parts[2], ".".join(parts[3:])
            pre = f"model.layers.{i}."
            if rest == "input_layernorm.weight":
                out[pre + rest] = t
            elif rest == "pre_mlp_layernorm.weight":
                out[pre + "post_attention_layernorm.weight"] = t
            elif rest.startswith("self_attention.linear_qkv."):
                kind = rest.rsplit(".", 1)[1]
                g = t.reshape(groups, q + 2, d, *t.shape[1:])
                out[pre + f"self_attn.q_proj.{kind}"] = g[:, :q].reshape(heads * d, *t.shape[1:])
                out[pre + f"self_attn.k_proj.{kind}"] = g[:, q].reshape(groups * d, *t.shape[1:])
                out[pre + f"self_attn.v_proj.{kind}"] = g[:, q + 1].reshape(
                    groups * d, *t.shape[1:]
                )
            elif rest == "self_attention.linear_proj.weight":
                out[pre + "self_attn.o_proj.weight"] = t
            elif rest == "mlp.linear_fc1.weight":
                half = t.shape[0] // 2
                out[pre + "mlp.gate_proj.weight"] = t[:half]
                out[pre + "mlp.up_proj.weight"] = t[half:]
            elif rest == "mlp.linear_fc2.weight":
                out[pre + "mlp.down_proj.weight"] = t
            else:
                raise AssertionError(f"no HF name for {name}")
    return {k: v.contiguous() for k, v in out.items()}


def hf_members(megatron: str) -> set[str]:
    """The HF parameters a Megatron parameter (a truth group member) becomes."""
    parts = megatron.split(".")
    table = {
        "embedding.word_embeddings.weight": ["model.embed_tokens.weight"],
        "output_layer.weight": ["lm_head.weight"],
        "decoder.final_layernorm.weight": ["model.norm.weight"],
    }
    if megatron in table:
        return set(table[megatron])
    i, rest = parts[2], ".".join(parts[3:])
    pre = f"model.layers.{i}."
    per = {
        "input_layernorm.weight": ["input_layernorm.weight"],
        "pre_mlp_layernorm.weight": ["post_attention_layernorm.weight"],
        "self_attention.linear_qkv.weight": [f"self_attn.{x}_proj.weight" for x in "qkv"],
        "self_attention.linear_qkv.bias": [f"self_attn.{x}_proj.bias" for x in "qkv"],
        "self_attention.linear_proj.weight": ["self_attn.o_proj.weight"],
        "mlp.linear_fc1.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
        "mlp.linear_fc2.weight": ["mlp.down_proj.weight"],
    }
    return {pre + x for x in per[rest]}


#: multi-latent attention's low-rank tensors and their norms (local spec: separate latent
#: norms) -> DeepseekV3's, restated here independently of ckptools
MLA_LOW_RANK = {
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
}


def hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files of the model directory ``directory``."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def logits(directory: Path, input_ids: torch.Tensor) -> torch.Tensor:
    """The fp32 logits ``from_pretrained(directory)`` computes for ``input_ids``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        out: torch.Tensor = model(input_ids).logits
    return out


def assert_same_model(got: Path, want: Path) -> None:
    """The model directory ``got`` holds ``want``'s tensors bit for bit, dtypes included, and
    computes the same logits."""
    ours, theirs = hf_tensors(got), hf_tensors(want)
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name
    ids = torch.tensor([[1, 17, 42, 99, 3, 64, 8]])
    assert torch.equal(logits(got, ids), logits(want, ids))


def model_entries(inspected: dict[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``ckpt inspect --json``'s model tensors (no optimizer, plain or chained): dtype, shape."""
    return {
        t["fqn"]: (t["dtype"], tuple(t["shape"]))
        for t in inspected["tensors"]
        if not t["fqn"].startswith(("optimizer.", "chained_"))
    }


def saved_by_transformers(
    config: Any, state: dict[str, torch.Tensor], dtype: torch.dtype, out: Path
) -> dict[str, torch.Tensor]:
    """What transformers' ``save_pretrained`` writes (into ``out``) for the model of ``config``
    built in ``dtype`` holding ``state`` (its in-memory names, every parameter given)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    model.save_pretrained(out)
    return hf_tensors(out)


#: the Python of a venv with megatron-core 0.19.2 (fixtures/megatron/make_venv.sh); the tests
#: that load ckptools' output into real Megatron run only where there is one
MEGATRON_PYTHON = os.environ.get("CKPTOOLS_MEGATRON_PYTHON", "/work/megatron-venv/bin/python")


def _megatron_venv(tmp_path: Path) -> Path:
    """A file naming what the Megatron venv runs: its interpreter and every installed
    distribution (``name-version.dist-info``), for the check's cache key."""
    prefix = Path(MEGATRON_PYTHON).resolve().parents[1]
    dists = sorted(p.name for p in prefix.glob("lib/python*/site-packages/*.dist-info"))
    listing = tmp_path / "megatron-venv.txt"
    listing.write_text("\n".join([str(Path(MEGATRON_PYTHON).resolve()), *dists]) + "\n")
    return listing


def _metadata_without_ids(metadata: Path, tmp_path: Path) -> Path:
    """A copy of a DCP ``.metadata`` without the random ``save_id`` / ``load_id`` every save
    draws (as torch's writer does), which name the save and change nothing a loader reads."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(metadata.parent)).read_metadata()
    if md.storage_meta is not None:
        md.storage_meta = dataclasses.replace(md.storage_meta, save_id="", load_id="")
    out = tmp_path / f"{metadata.parent.name}.metadata"
    out.write_bytes(pickle.dumps(md))
    return out


def megatron_check_load(
    cached_output: Callable[[str, Sequence[Path], Callable[[Path], None]], Path],
    tmp_path: Path,
    *,
    key: str,
    run: Path,
    hf: Path,
    command: Sequence[str],
) -> str:
    """What ``fixtures/megatron/generate.py COMMAND --ckpt RUN --hf HF`` printed under torchrun
    (2 ranks) in the Megatron venv: real Megatron-core loading what ``shard --to megatron``
    wrote into ``run``. A failed check fails the test (and is never kept); a passing verdict is
    kept across sessions under ``key`` and every byte shard wrote, the HF model, generate.py
    and the venv's installed distributions: a re-run whose shard wrote the same bytes reads the
    verdict Megatron gave on them, and a single changed byte runs Megatron again."""
    written = [p for p in sorted(run.rglob("*")) if p.is_file() and p.name != ".metadata"]
    written += [_metadata_without_ids(p, tmp_path) for p in sorted(run.rglob(".metadata"))]
    sources = [*written, *sorted(p for p in hf.rglob("*") if p.is_file()),
               FIXTURES / "generate.py", _megatron_venv(tmp_path)]  # fmt: skip

    def check_load(entry: Path) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        env.pop("PYTHONPATH", None)
        done = subprocess.run(
            [MEGATRON_PYTHON, "-m", "torch.distributed.run", "--nproc-per-node=2",
             f"--master-port={29300 + os.getpid() % 600}", str(FIXTURES / "generate.py"),
             command[0], "--ckpt", str(run), "--hf", str(hf), *command[1:]],
            capture_output=True, text=True, env=env, timeout=600, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        (entry / "check-load.log").write_text(done.stdout + done.stderr)

    return (cached_output(key, sources, check_load) / "check-load.log").read_text()


def assert_diff_finds(src: Path, out: Path, name: str, at: tuple[int, ...]) -> list[str]:
    """``ckpt diff SRC OUT`` calls a run identical to its export ``out`` (a one-file model
    directory), then, once element ``at`` of ``name`` is changed in ``out``, that tensor alone
    different (exit 3). Returns the first diff's notes."""
    from safetensors.torch import load_file, save_file

    result = invoke("diff", str(src), str(out), "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["identical"], report
    weights = load_file(out / "model.safetensors")
    weights[name][at] += 1.0
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    result = invoke("diff", str(src), str(out), "--json")
    assert result.exit_code == 3, result.output
    changed = [t["name"] for t in json.loads(result.output)["tensors"] if t["status"] != "equal"]
    assert changed == [name]
    notes: list[str] = report["notes"]
    return notes
