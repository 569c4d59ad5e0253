"""``ckptools.load_pretrained`` into FSDP2, FSDP1 and plain models, with real gloo ranks.

Truth: ``transformers``' own ``from_pretrained`` of the same directory (the model's gathered
full state equal bit-exactly), and torch's own view of each rank's bytes: a counting reader
shows every rank read exactly its shard's bytes. Published models are written by
``transformers``' ``save_pretrained`` (several shards), never by hand.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.support.dist import run_ranks

pytestmark = pytest.mark.distributed

# Small enough that each tiny model lands in several shards.
_SHARD = "2KB"


def _config(kind: str, **overrides: Any) -> Any:
    """A tiny transformers config: ``llama`` (untied), ``llama-tied`` (``llama-base``: its base
    ``LlamaModel``), ``bert`` (``bert-old``: published with ``position_ids``), or the MoE
    models ``qwen3_moe`` and ``mixtral``."""
    if kind in ("qwen3_moe", "mixtral"):
        from transformers import MixtralConfig, Qwen3MoeConfig

        moe = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 24,
               "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
               "head_dim": 8, "num_experts_per_tok": 2, "tie_word_embeddings": False}  # fmt: skip
        if kind == "mixtral":
            return MixtralConfig(**{**moe, "num_local_experts": 4, **overrides})
        return Qwen3MoeConfig(**{**moe, "num_experts": 4, "moe_intermediate_size": 8, **overrides})
    if kind.startswith("bert"):
        from transformers import BertConfig

        bert = {"vocab_size": 41, "hidden_size": 16, "num_hidden_layers": 2,
                "num_attention_heads": 4, "intermediate_size": 24,
                "max_position_embeddings": 32}  # fmt: skip
        return BertConfig(**{**bert, **overrides})
    from transformers import LlamaConfig

    llama = {"vocab_size": 37, "hidden_size": 16, "intermediate_size": 24,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 4, "max_position_embeddings": 64,
             "tie_word_embeddings": kind in ("llama-tied", "llama-base"),
             "attn_implementation": "eager"}  # fmt: skip
    return LlamaConfig(**{**llama, **overrides})


def _model_class(kind: str) -> Any:
    from transformers import (
        BertModel,
        LlamaForCausalLM,
        LlamaModel,
        MixtralForCausalLM,
        Qwen3MoeForCausalLM,
    )

    other = {"qwen3_moe": Qwen3MoeForCausalLM, "mixtral": MixtralForCausalLM,
             "llama-base": LlamaModel}  # fmt: skip
    return BertModel if kind.startswith("bert") else other.get(kind, LlamaForCausalLM)


def _publish(root: Path, kind: str, seed: int = 0, dtype: Any = None, **cfg: Any) -> str:
    """``save_pretrained`` of a randomly initialised tiny model, in several shards."""
    import torch

    torch.manual_seed(seed)
    model = _model_class(kind)(_config(kind, **cfg))
    if dtype is not None:
        model = model.to(dtype)
    out = str(root / f"{kind}-published")
    # bert-old: as the Hub's BERT files, which hold the buffer that is now non-persistent
    if kind == "bert-old":
        old = {**model.state_dict(), "embeddings.position_ids": model.embeddings.position_ids}
        model.save_pretrained(out, max_shard_size=_SHARD, state_dict=old)
    else:
        model.save_pretrained(out, max_shard_size=_SHARD)
    return out


def _blocks(model: Any) -> list[Any]:
    inner = getattr(model, "model", model)
    return list(inner.layers) if hasattr(inner, "layers") else list(model.encoder.layer)


def _build(
    kind: str, wrap: str, world_size: int, *, meta: bool = False, seed: int = 1, **cfg: Any
) -> Any:
    """A fresh model (other weights than the published one), wrapped as ``wrap`` says."""
    import torch

    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        model = _model_class(kind)(_config(kind, **cfg))
    if wrap == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for block in _blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif wrap == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        layer = type(_blocks(model)[0])
        model = FSDP(
            model, device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({layer})
        )
    if meta:
        model.to_empty(device="cpu")
    return model


def _full_state(model: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def _differences(kind: str, published: str, state: dict[str, Any]) -> list[str]:
    """Where ``state`` differs from ``from_pretrained`` of ``published`` (names, dtypes, bits)."""
    import torch

    expected = _model_class(kind).from_pretrained(published, dtype=torch.float32).state_dict()
    if sorted(expected) != sorted(state):
        return [f"keys differ: {sorted(set(expected) ^ set(state))}"]
    return [
        f"{k} differs"
        for k in expected
        if expected[k].dtype != state[k].dtype or not torch.equal(expected[k], state[k].cpu())
    ]


class _CountingReader:
    """Wraps a ckptools reader and adds up the tensor bytes it is asked for."""

    def __init__(self, inner: Any, counts: list[int]) -> None:
        self.inner, self.counts = inner, counts

    def readinto(self, rel: str, offset: int, buf: memoryview) -> None:
        self.counts.append(len(buf))
        self.inner.readinto(rel, offset, buf)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __enter__(self) -> _CountingReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.inner.close()


def _counting(counts: list[int]) -> None:
    from ckptools.io import storage

    opened = storage.open_reader
    storage.open_reader = lambda root: _CountingReader(opened(root), counts)  # type: ignore[assignment,return-value]


def _load_cases(
    rank: int, world_size: int, cases: list[tuple[str, str, str, bool]]
) -> list[tuple[str, list[str], Any, int]]:
    """Per case ``(kind, wrap, published dir, meta)``: load, gather, compare on rank 0.
    Returns per case the failures (rank 0), the result, and the bytes this rank read."""
    import torch.distributed as dist

    import ckptools

    counts: list[int] = []
    _counting(counts)
    out = []
    for kind, wrap, published, meta in cases:
        model = _build(kind, wrap, world_size, meta=meta)
        del counts[:]
        result = ckptools.load_pretrained(model, published)
        read = sum(counts)
        state = _full_state(model)
        failures = _differences(kind, published, state) if rank == 0 else []
        out.append((f"{kind}/{wrap}{'/meta' if meta else ''}", failures, result, read))
        dist.barrier()
    return out


def _tensor_bytes(published: str, skip: tuple[str, ...] = ()) -> int:
    from ckptools.producers.hf.safetensors import read_safetensors

    tensors = read_safetensors(published).tensors
    return sum(t.nbytes for k, t in tensors.items() if k not in skip)


def _check(results: list[list[tuple[str, list[str], Any, int]]], totals: list[int]) -> None:
    for i, total in enumerate(totals):
        name, failures, result, _ = results[0][i]
        assert failures == [], name
        assert tuple(result) == ([], []), (name, result)
        reads = [r[i][3] for r in results]
        if "fsdp2" in name:  # every byte read once, by the rank holding it (FSDP2: disjoint)
            assert sum(reads) == total and max(reads) < total, (name, reads, total)


@pytest.fixture(scope="module")
def shared_hub(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One Hub cache directory for the tests whose ranks read it: ranks that import
    huggingface_hub under another ``HF_HUB_CACHE`` need a zygote of their own (transformers,
    peft and accelerate imported again: ~7 s of CPU), so each test adds its repos under an
    organisation of its own (``_hub_cache(..., org=...)``) instead of a cache of its own."""
    return tmp_path_factory.mktemp("hub")


def test_fsdp2_fsdp1_two_ranks_equal_from_pretrained(
    tmp_path: Path, shared_hub: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dirs = {k: _publish(tmp_path, k) for k in ("llama", "llama-tied", "bert")}
    # the ranks inherit an offline Hub cache holding the tied model (rank 0 resolves it first)
    cache = _hub_cache(shared_hub, dirs["llama-tied"], org="org-fsdp1")
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cases = [
        ("llama", "fsdp2", dirs["llama"], False),
        ("llama-tied", "fsdp2", dirs["llama-tied"], False),
        ("bert", "fsdp2", dirs["bert"], False),
        ("llama-tied", "fsdp2", dirs["llama-tied"], True),
        ("llama", "fsdp1", dirs["llama"], False),
        ("llama-tied", "fsdp1", dirs["llama-tied"], False),
        ("llama-tied", "fsdp2", "org-fsdp1/tiny-llama", False),
    ]
    results = run_ranks(_load_cases, 2, cases, timeout=280.0)
    _check(results, [_tensor_bytes(dirs[c[0]]) for c in cases])


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_transformers_layouts_from_the_hub_cache_equal_from_pretrained(
    tmp_path: Path, shared_hub: Path, monkeypatch: pytest.MonkeyPatch, world_size: int
) -> None:
    """Qwen3-MoE and Mixtral as their ``save_pretrained`` writes them (per expert and half;
    Mixtral's ``block_sparse_moe``) into FSDP2 models holding the experts fused; a BERT
    whose files hold ``embeddings.position_ids`` (as the Hub's do; now a non-persistent
    buffer, which ``from_pretrained`` ignores); a ``LlamaModel`` from ``LlamaForCausalLM``
    files (``model.`` removed) and back (added; ``lm_head`` through the tie): all served by
    repo id from a Hub cache. Each rank reads only the runs of its own rows (3 ranks: 4
    experts split 2/2/0)."""
    published = {}
    org = f"org-layouts-{world_size}"
    for kind in ("qwen3_moe", "mixtral", "bert-old", "llama-tied", "llama-base"):
        published[kind] = _publish(tmp_path, kind)
        cache = _hub_cache(shared_hub, published[kind], kind, org=org)
    into = {"llama-tied": "llama-base", "llama-base": "llama-tied"}  # files -> model
    cases, totals = [], []
    for kind, directory in published.items():
        cases.append((into.get(kind, kind), "fsdp2", f"{org}/{kind}", kind == "mixtral"))
        totals.append(_tensor_bytes(directory, skip=("embeddings.position_ids",)))
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    results = run_ranks(_load_cases, world_size, cases, timeout=280.0)
    _check(results, totals)


@pytest.mark.slow
def test_fsdp2_uneven_three_ranks_equal_from_pretrained(tmp_path: Path) -> None:
    # vocab 37 / 41 and 8-row k/v projections over 3 ranks: uneven shards.
    dirs = {k: _publish(tmp_path, k) for k in ("llama", "llama-tied", "bert")}
    cases = [(k, "fsdp2", d, k == "llama") for k, d in dirs.items()]
    results = run_ranks(_load_cases, 3, cases, timeout=280.0)
    _check(results, [_tensor_bytes(c[2]) for c in cases])


def test_unsharded_equal_from_pretrained_and_cast(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    import ckptools

    for kind in ("llama", "llama-tied", "bert"):
        published = _publish(tmp_path, kind)
        model = _build(kind, "plain", 1)
        assert tuple(ckptools.load_pretrained(model, published)) == ([], [])
        assert _differences(kind, published, model.state_dict()) == [], kind
    # bfloat16 files into a float32 model: cast piece by piece through a buffer smaller than a
    # tensor, exactly as the widening cast of the whole tensor.
    source = _publish(tmp_path / "bf16", "llama", dtype=torch.bfloat16)
    model = _build("llama", "plain", 1)
    monkeypatch.setenv("CKPTOOLS_LOAD_BUFFER_BYTES", "100")
    ckptools.load_pretrained(model, source)
    assert _differences("llama", source, model.state_dict()) == []
    assert model.lm_head.weight.dtype == torch.float32


def test_strict_errors_name_file_and_tensor(tmp_path: Path) -> None:
    import torch

    import ckptools
    from ckptools.errors import UsageError

    published = _publish(tmp_path, "llama")
    wider = _publish(tmp_path / "wide", "llama", intermediate_size=32)
    shape = (
        r"/model-\d{5}-of-\d{5}\.safetensors: 'model\.layers\.0\.mlp\.gate_proj\.weight' has "
        r"shape \[32, 16\], the model's 'model\.layers\.0\.mlp\.gate_proj\.weight' has \[24, 16\]$"
    )
    with pytest.raises(UsageError, match=shape):
        ckptools.load_pretrained(_build("llama", "plain", 1), wider, strict=False)

    shallow = _build("llama", "plain", 1, num_hidden_layers=1)  # the files' layer 1 is extra
    extra = r"holds 'model\.layers\.1\.\S+' \(and 8 more\) that the model does not have; pass "
    with pytest.raises(UsageError, match=extra + "strict=False to ignore$"):
        ckptools.load_pretrained(shallow, published)
    result = ckptools.load_pretrained(shallow, published, strict=False)
    assert result.missing_keys == [] and len(result.unexpected_keys) == 9
    assert all(k.startswith("model.layers.1.") for k in result.unexpected_keys)

    # a file without the decoder's last norm: missing, and with strict=False the rest loads
    trimmed = tmp_path / "trimmed"
    shutil.copytree(published, trimmed)
    _drop_tensor(trimmed, "model.norm.weight")
    model = _build("llama", "plain", 1)
    missing = r"holds no tensor for the model's 'model\.norm\.weight'; pass strict=False"
    with pytest.raises(UsageError, match=missing):
        ckptools.load_pretrained(model, str(trimmed))
    before = model.model.norm.weight.clone()
    result = ckptools.load_pretrained(model, str(trimmed), strict=False)
    assert result.missing_keys == ["model.norm.weight"] and result.unexpected_keys == []
    assert torch.equal(model.model.norm.weight, before)
    ref = _model_class("llama").from_pretrained(published).state_dict()
    assert torch.equal(model.lm_head.weight, ref["lm_head.weight"])

    # integer buffer into a float parameter: refused in strict mode
    model = torch.nn.Linear(3, 2)
    ints = {"weight": torch.arange(6, dtype=torch.int32).reshape(2, 3), "bias": torch.ones(2)}
    from safetensors.torch import save_file

    os.makedirs(tmp_path / "ints")
    save_file(ints, str(tmp_path / "ints" / "model.safetensors"))
    refused = r"model\.safetensors: 'weight' is int32, the model's 'weight' is float32; pass strict"
    with pytest.raises(UsageError, match=refused):
        ckptools.load_pretrained(model, str(tmp_path / "ints"))
    ckptools.load_pretrained(model, str(tmp_path / "ints"), strict=False)
    assert torch.equal(model.weight, ints["weight"].float())


def _drop_tensor(directory: Path, fqn: str) -> None:
    """Rewrite the shard holding ``fqn`` without it (safetensors' own writer) and its index."""
    from safetensors.torch import load_file, save_file

    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = index["weight_map"].pop(fqn)
    tensors = load_file(str(directory / name))
    del tensors[fqn]
    save_file(tensors, str(directory / name), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))


def test_a_training_checkpoint_given_as_a_published_model_names_the_way(
    produced: Any, tmp_path: Path
) -> None:
    import ckptools
    from ckptools.errors import CheckpointNotFoundError

    src = produced("fsdp2", world_size=2).path  # a real dcp.save of FSDP2 ranks
    way = "it is a dcp training checkpoint; resume from it with ckptools.load"
    with pytest.raises(CheckpointNotFoundError, match=f"holds no safetensors tensors: {way}"):
        ckptools.load_pretrained(_build("llama", "plain", 1), str(src))


def test_meta_model_without_to_empty_is_refused(tmp_path: Path) -> None:
    import ckptools
    from ckptools.errors import UsageError

    published = _publish(tmp_path, "llama")
    import torch

    with torch.device("meta"):
        model = _model_class("llama")(_config("llama"))
    with pytest.raises(UsageError, match=r"is on the meta device: allocate the model first"):
        ckptools.load_pretrained(model, published)


def test_fsspec_url_and_hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``memory://`` copy (ranged reads through fsspec), and a repo id served from a Hub cache
    with ``HF_HUB_OFFLINE`` (no network): the cache layout huggingface_hub itself reads."""
    import fsspec
    import huggingface_hub.constants as hub_constants

    import ckptools
    from ckptools.errors import HubNotFoundError, UsageError

    published = _publish(tmp_path, "llama-tied")
    fs = fsspec.filesystem("memory")
    for name in os.listdir(published):
        fs.pipe(f"/lp-model/{name}", Path(published, name).read_bytes())
    model = _build("llama-tied", "plain", 1)
    assert tuple(ckptools.load_pretrained(model, "memory://lp-model")) == ([], [])
    assert _differences("llama-tied", published, model.state_dict()) == []

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", _hub_cache(tmp_path, published))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    model = _build("llama-tied", "plain", 1)
    assert tuple(ckptools.load_pretrained(model, "tiny-org/tiny-llama")) == ([], [])
    assert _differences("llama-tied", published, model.state_dict()) == []
    with pytest.raises(HubNotFoundError, match=r"^tiny-org/absent: not in the local Hub cache"):
        ckptools.load_pretrained(model, "tiny-org/absent")
    with pytest.raises(UsageError, match="revision= applies to a Hub repo id"):
        ckptools.load_pretrained(model, published, revision="main")


def _hub_cache(root: Path, published: str, name: str = "tiny-llama", org: str = "tiny-org") -> str:
    """A huggingface_hub cache (``root/hub``) holding ``published`` as ``<org>/<name>`` at
    ``main`` (the layout ``snapshot_download`` itself reads: ``refs/main`` names the
    snapshot)."""
    cache = root / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = cache / f"models--{org}--{name}" / "snapshots" / commit
    shutil.copytree(published, snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text(commit)
    return str(cache)


def _peak_extra(
    rank: int, world_size: int, published: str, big: dict[str, Any]
) -> tuple[int, int, int]:
    """Extra peak resident memory of the call on this rank (Linux ``VmHWM`` reset just before),
    this rank's shard bytes, and the full model's bytes."""
    import ckptools

    model = _build("llama", "fsdp2", world_size, **big)
    shard = sum(p.to_local().nbytes for p in model.parameters())
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak resident set to the current one
    before = _status("VmRSS")
    ckptools.load_pretrained(model, published)
    return _status("VmHWM") - before, shard, full


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(field)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_peak_memory_per_rank_is_far_below_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    big = {"vocab_size": 32768, "hidden_size": 256, "intermediate_size": 1024}
    monkeypatch.setenv("CKPTOOLS_LOAD_BUFFER_BYTES", str(4 * 2**20))  # the ranks inherit it
    # float32 files go straight into the parameters; bfloat16 ones through the buffer (a cast)
    for dtype in (None, torch.bfloat16):
        published = _publish(tmp_path / str(dtype), "llama", dtype=dtype, **big)
        results = run_ranks(_peak_extra, 2, published, big, timeout=200.0)
        for extra, shard, full in results:
            assert full > 60 * 2**20 and shard < full
            # one 4 MiB buffer when casting, none otherwise, plus the interpreter's noise
            assert extra < 12 * 2**20, (dtype, extra, shard, full)


class _Fused:
    """A conversion as issue 17's mapping will plug in: the published ``gate.weight`` and
    ``up.weight`` [I, H] are the in-memory ``gate_up.weight`` [2I, H], as two byte runs."""

    def __init__(self, gap: int = 0) -> None:
        self.gap = gap  # rows left uncovered: a broken conversion

    def __call__(self, manifest: Any) -> Any:
        from dataclasses import replace

        from ckptools.core.manifest import TensorEntry

        gate, up = manifest.tensors["gate.weight"], manifest.tensors["up.weight"]
        rows, cols = gate.shape
        chunks = (
            gate.chunks[0]._replace(offsets=(0, 0)),
            up.chunks[0]._replace(offsets=(rows + self.gap, 0)),
        )
        fused = TensorEntry("gate_up.weight", gate.dtype, (2 * rows + self.gap, cols), chunks)
        rest = {k: v for k, v in manifest.tensors.items() if k not in ("gate.weight", "up.weight")}
        return replace(manifest, tensors={"gate_up.weight": fused, **rest})


def _fused_model(gap: int = 0) -> Any:
    """A gated MLP holding its gate and up projections as one [2I, H] weight."""
    import torch
    import torch.nn.functional as F

    class FusedMLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up = torch.nn.Linear(6, 10 + gap, bias=False)
            self.down = torch.nn.Linear(5, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            out: torch.Tensor = self.down(F.silu(gate) * up)
            return out

    torch.manual_seed(1)
    return FusedMLP()


def _publish_unfused(root: Path) -> tuple[str, dict[str, Any]]:
    """The published form, written by the safetensors library."""
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    tensors = {
        "gate.weight": torch.randn(5, 6), "up.weight": torch.randn(5, 6),
        "down.weight": torch.randn(6, 5), "down.bias": torch.randn(6),
    }  # fmt: skip
    out = root / "unfused"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out), tensors


def _load_fused(rank: int, world_size: int, published: str) -> tuple[list[int], int]:
    """FSDP2 over ``world_size`` ranks: rows 0-9 split 4/4/2 at 3 ranks, across the two runs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import ckptools

    model = _fused_model()
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    counts: list[int] = []
    _counting(counts)
    assert tuple(ckptools.load_pretrained(model, published, conversion=_Fused())) == ([], [])
    return list(_full_state(model)["gate_up.weight"].flatten().tolist()), sum(counts)


def test_conversion_fills_a_fused_tensor_from_two_published_ones(tmp_path: Path) -> None:
    import torch

    import ckptools
    from ckptools.errors import UsageError

    published, tensors = _publish_unfused(tmp_path)
    fused = torch.cat([tensors["gate.weight"], tensors["up.weight"]])
    model = _fused_model()
    assert tuple(ckptools.load_pretrained(model, published, conversion=_Fused())) == ([], [])
    assert torch.equal(model.gate_up.weight, fused)
    assert torch.equal(model.down.bias, tensors["down.bias"])
    with pytest.raises(UsageError, match=r"pieces of 'gate_up\.weight' do not tile its shape"):
        ckptools.load_pretrained(_fused_model(gap=1), published, conversion=_Fused(gap=1))


def test_conversion_into_fsdp2_boxes_across_the_runs(tmp_path: Path) -> None:
    import torch

    published, tensors = _publish_unfused(tmp_path)
    fused = torch.cat([tensors["gate.weight"], tensors["up.weight"]])
    results = run_ranks(_load_fused, 3, published, timeout=120.0)
    for values, _ in results:
        assert torch.equal(torch.tensor(values).reshape(10, 6), fused)
    # each rank read its own rows only: 4, 4 and 2 rows of gate_up plus its share of down
    assert sum(r[1] for r in results) == sum(t.nbytes for t in tensors.values())
