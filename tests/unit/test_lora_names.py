"""LoRA name rules and options (:mod:`ckptools.views.lora`): what is recognised, what is refused.
The end-to-end checks against peft itself are in tests/distributed/test_lora.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptools.errors import UsageError
from ckptools.verbs.consolidate import ConsolidateOptions
from ckptools.views import lora

_M = "base_model.model.model.layers.0.self_attn.q_proj"


def _shapes(r: int = 4, rb: int = 4) -> dict[str, tuple[int, ...]]:
    return {
        f"{_M}.base_layer.weight": (16, 16),
        f"{_M}.lora_A.default.weight": (r, 16),
        f"{_M}.lora_B.default.weight": (16, rb),
        "base_model.model.model.layers.0.self_attn.k_proj.weight": (8, 16),
        f"{_M}.lora_A.other.weight": (2, 16),
        f"{_M}.lora_B.other.weight": (16, 2),
    }


def test_scan_finds_adapters_ranks_and_base() -> None:
    found = lora.scan(_shapes(), _shapes())
    assert found is not None and found.adapters == ["default", "other"]
    (d,) = found.of("default")
    assert (d.rank, d.base) == (4, f"{_M}.base_layer.weight")
    assert found.target_modules("other") == ["q_proj"]
    assert found.to_dict()["adapters"]["other"]["rank_per_module"] == {_M[17:]: 2}
    assert lora.scan(["a.weight"], {"a.weight": (2, 2)}) is None


def test_scan_refuses_half_adapters_and_bad_shapes() -> None:
    shapes = _shapes()
    del shapes[f"{_M}.lora_B.default.weight"]
    with pytest.raises(UsageError, match="lora_A only"):
        lora.scan(shapes, shapes)
    bad = _shapes(rb=3)
    with pytest.raises(UsageError, match=r"not \[r, in\] and \[out, r\]"):
        lora.scan(bad, bad)


def test_adapter_config_needs_alpha_and_checks_r(tmp_path: Path) -> None:
    found = lora.scan(_shapes(), _shapes())
    assert found is not None
    with pytest.raises(UsageError, match="--lora-alpha"):
        lora.adapter_config(found, "default", lora_alpha=None, config_file=None, model_config=None)
    cfg = lora.adapter_config(
        found, "default", lora_alpha=8, config_file=None,
        model_config={"architectures": ["LlamaForCausalLM"], "_name_or_path": "tiny"},
    )  # fmt: skip
    assert (cfg["r"], cfg["lora_alpha"], cfg["task_type"]) == (4, 8, "CAUSAL_LM")
    assert cfg["base_model_name_or_path"] == "tiny" and cfg["inference_mode"] is True
    wrong = tmp_path / "adapter_config.json"
    wrong.write_text('{"peft_type": "LORA", "r": 8, "lora_alpha": 16}')
    with pytest.raises(UsageError, match="r=8 but lora_A has 4 rows"):
        lora.adapter_config(found, "default", lora_alpha=None, config_file=str(wrong),
                            model_config=None)  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"adapter": True, "merge_lora": True}, "choose one"),
        ({"lora_alpha": 8.0}, "need --adapter or --merge-lora"),
        ({"merge_lora": True, "dtype": "bfloat16"}, "drop --dtype"),
    ],
)
def test_lora_options_validated_once(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        ConsolidateOptions(**kwargs)  # type: ignore[arg-type]
