"""``diff`` and the LoRA / ``--key`` options on a real PEFT checkpoint, as a user meets them.

The producer: a tiny Llama (built from a config, nothing downloaded) wrapped by peft's
``get_peft_model`` (LoRA on q_proj and v_proj, ``lora_B`` made non-zero as training makes it),
saved with ``dcp.save`` of its ``state_dict()`` under ``model``, the model's ``config.json``
beside it.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckptools
from ckptools.cli.exit_codes import EXIT_USAGE
from ckptools.cli.main import cli
from ckptools.errors import UsageError

_ALPHA = 16.0
_Cached = Callable[[str, Sequence[Path], Callable[[Path], None]], Path]


def _cli(args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(cli, args)
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.output


def _peft_dcp(out: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    lora = LoraConfig(
        r=4, lora_alpha=_ALPHA, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
    )
    model = get_peft_model(LlamaForCausalLM(cfg), lora)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero; a trained adapter is not
            torch.nn.init.normal_(p)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(out / "src"), no_dist=True)
    config = model.base_model.model.config
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(str(out / "src"))


@pytest.fixture(scope="module")
def peft_src(cached_output: _Cached) -> Path:
    if importlib.util.find_spec("peft") is None:
        pytest.skip("needs peft")
    return cached_output("peft-llama-dcp", [Path(__file__)], _peft_dcp) / "src"


@pytest.mark.parametrize("alpha", ["0", "-1", "nan"])
def test_non_positive_lora_alpha_is_a_usage_error(
    peft_src: Path, tmp_path: Path, alpha: str
) -> None:
    """Alpha 0 merged nothing ("LoRA merged into 4 weights", the base model written as the
    merge); a negative one subtracts the adapter. Refused in one line, by the library too."""
    out = tmp_path / "merged"
    code, text = _cli(["consolidate", str(peft_src), str(out), "--merge-lora",
                       "--lora-alpha", alpha])  # fmt: skip
    assert code == EXIT_USAGE, text
    assert text.count("\n") == 1 and "--lora-alpha" in text and "positive" in text, text
    assert not out.exists()
    with pytest.raises(UsageError, match="--lora-alpha"):
        ckptools.consolidate(str(peft_src), str(out), adapter=True, lora_alpha=float(alpha))
    given = tmp_path / "adapter_config.json"  # the same alpha from a config file
    given.write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": float(alpha)}))
    code, text = _cli(["consolidate", str(peft_src), str(out), "--merge-lora",
                       "--adapter-config", str(given)])  # fmt: skip
    assert code == EXIT_USAGE and "lora_alpha" in text and "positive" in text, text
    assert not out.exists()


def test_a_key_that_holds_nothing_names_key(peft_src: Path, tmp_path: Path) -> None:
    code, text = _cli(["consolidate", str(peft_src), str(tmp_path / "o"), "--key", "nokey"])
    assert code == EXIT_USAGE, text
    assert "--key 'nokey'" in text and "--select" not in text, text
    code, text = _cli(["consolidate", str(peft_src), str(tmp_path / "o"), "--key", "a",
                       "--select", "b"])  # fmt: skip
    assert code == EXIT_USAGE and "--key" in text and "--select" in text, text
    with pytest.raises(UsageError, match="--key 'nokey'"):
        ckptools.consolidate(str(peft_src), str(tmp_path / "o"), key="nokey")


def test_adapter_export_lists_both_files_it_wrote(peft_src: Path, tmp_path: Path) -> None:
    out = tmp_path / "adapter"
    code, text = _cli(["consolidate", str(peft_src), str(out), "--adapter",
                       "--lora-alpha", "16"])  # fmt: skip
    assert code == 0, text
    written = sorted(p.name for p in out.iterdir())
    assert written == ["adapter_config.json", "adapter_model.safetensors"]
    [line] = [ln for ln in text.splitlines() if ln.strip().startswith("wrote:")]
    assert all(name in line for name in written), text
    code, text = _cli(["consolidate", str(peft_src), str(out), "--adapter", "--lora-alpha",
                       "16", "--json", "--overwrite"])  # fmt: skip
    assert code == 0 and json.loads(text)["config_files"] == ["adapter_config.json"], text
