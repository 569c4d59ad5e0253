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
from tests.conftest import Produced

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
    model.save_pretrained(str(out / "peft_adapter"))  # peft's own adapter directory: a truth


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


def test_an_adapter_export_is_pushed_as_an_adapter(peft_src: Path, tmp_path: Path) -> None:
    # adapter_config.json, not config.json: PeftModel.from_pretrained loads it, so push takes it
    # without --weights-only (it said "from_pretrained cannot load the repository")
    out = tmp_path / "adapter"
    code, text = _cli(["consolidate", str(peft_src), str(out), "--adapter", "--lora-alpha", "16"])
    assert code == 0, text
    code, text = _cli(["push", str(out), "me/adapter", "--dry-run", "--json"])
    assert code == 0, text
    assert not any("from_pretrained" in n for n in json.loads(text)["notes"]), text


@pytest.mark.parametrize("flags", [["--merge-lora", "--lora-alpha", "16"], ["--adapter"]])
def test_peft_adapter_directory_is_named_as_the_adapter_alone(
    peft_src: Path, tmp_path: Path, flags: list[str]
) -> None:
    """peft's own ``save_pretrained`` directory given to ``--merge-lora`` / ``--adapter`` was
    told it holds "no LoRA adapter"; it holds the adapter alone (no base weights), and the
    line says so and how to merge it."""
    adapter = peft_src.parent / "peft_adapter"
    out = tmp_path / "out"
    code, text = _cli(["consolidate", str(adapter), str(out), *flags])
    assert code == EXIT_USAGE, text
    assert text.count("\n") == 1, text
    assert "no LoRA adapter" not in text, text
    assert "PeftModel.save_pretrained" in text and "merge_and_unload" in text, text
    assert not out.exists()


def _damaged_copy(src: Path, dst: Path, fqn: str) -> tuple[str, int]:
    """``src`` copied to ``dst`` with one bit flipped inside a stored record of ``fqn`` (not
    its CRC): the file name and the byte flipped."""
    import shutil

    from ckptools.engine.reader import resolve_chunk
    from ckptools.io.storage import LocalReader
    from ckptools.producers import read_manifest
    from tests.support import producers

    shutil.copytree(src, dst)
    tensor = read_manifest(str(dst)).tensors[fqn]
    with LocalReader(str(dst)) as reader:
        raw = resolve_chunk(reader, tensor, tensor.chunks[0])
    assert raw.crc32 is not None  # a DCP item stores its record's CRC-32
    at = raw.offset + raw.length // 2
    producers.flip_bit(dst / raw.file, at, 3)
    return raw.file, at


def test_diff_reports_a_damaged_record_as_verify_and_consolidate_do(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    """One flipped bit in a DCP item: verify and consolidate report the damage naming file and
    tensor; diff reported "1 element(s) differ". It now fails the same way, either side."""
    from ckptools.errors import CorruptCheckpointError
    from tests.integration.test_diff import _safetensors_of_reference

    p = produced("single")
    _safetensors_of_reference(p, tmp_path / "st")
    fqn = "model.nested.deeper.w"  # as the DCP stores it
    damaged = tmp_path / "damaged"
    file, _ = _damaged_copy(p.path, damaged, fqn)
    with pytest.raises(CorruptCheckpointError) as consolidated:
        ckptools.consolidate(str(damaged), str(tmp_path / "hf"), quiet=True, weights_only=True)
    for a, b in ((damaged, tmp_path / "st"), (tmp_path / "st", damaged)):
        with pytest.raises(CorruptCheckpointError) as caught:
            ckptools.diff(str(a), str(b))
        e = caught.value
        assert e.fqn == fqn and e.path == consolidated.value.path == f"{damaged}/{file}"
        # the same record, the same stored and computed CRCs, as consolidate names them
        same = str(consolidated.value).split(": the file is damaged")[0]
        assert str(e).startswith(same), (str(e), same)
    code, text = _cli(["diff", str(damaged), str(tmp_path / "st")])
    assert code == 1 and text.count("\n") == 1, text
    assert f"{damaged}/{file}" in text and repr(fqn) in text and "CRC-32" in text, text
    assert "differ" not in text
    # verify --against keeps its report: the damage is a finding, once
    for against, at in ((tmp_path / "st", damaged), (damaged, tmp_path / "st")):
        report = ckptools.verify(str(at), against=str(against), quiet=True)
        assert not report.ok and report.diff is None
        crc = [f for f in report.findings if f.kind == "crc"]
        assert len(crc) == 1 and crc[0].fqn in (fqn, None), report.findings


def test_diff_of_a_peft_model_and_its_adapter_export_compares_the_adapter(
    peft_src: Path, tmp_path: Path
) -> None:
    """A PEFT checkpoint against its adapter (peft's own ``save_pretrained``, or
    ``consolidate --adapter``) was "DIFFERENT: 37 tensors (missing 29, unexpected 8)": the
    adapter is now compared under peft's names, either way round, with a note."""
    from safetensors.torch import load_file, save_file

    peft_adapter = peft_src.parent / "peft_adapter"
    exported = tmp_path / "adapter"
    ckptools.consolidate(str(peft_src), str(exported), adapter=True, lora_alpha=_ALPHA)
    for other in (peft_adapter, exported):
        for a, b, side in ((peft_src, other, "A"), (other, peft_src, "B")):
            report = ckptools.diff(str(a), str(b))
            assert report.identical, [t.describe() for t in report.differences]
            assert len(report.tensors) == 8 and all(t.status == "equal" for t in report.tensors)
            [note] = report.notes
            assert note.startswith(f"{side}: a PEFT-wrapped model") and "adapter" in note
    code, text = _cli(["diff", str(peft_src), str(exported)])
    assert code == 0 and "identical: 8 tensors" in text and "LoRA 'default'" in text, text
    # the values are compared: one changed element of lora_B is named
    changed = load_file(str(peft_adapter / "adapter_model.safetensors"))
    name = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    changed[name][2, 1] += 1.0
    (tmp_path / "changed").mkdir()
    save_file(changed, str(tmp_path / "changed" / "adapter_model.safetensors"))
    report = ckptools.diff(str(peft_src), str(tmp_path / "changed"))
    [d] = report.differences
    assert (d.name, d.status, d.mismatched, d.first_index) == (name, "different", 1, (2, 1))


def test_diff_of_a_peft_model_and_its_merged_export_says_how_to_compare(
    peft_src: Path, tmp_path: Path
) -> None:
    """Against the merged model the names cannot meet (the merge is a computation): the
    difference stays, and a note says A is a LoRA adapter and how to compare it."""
    merged = tmp_path / "merged"
    ckptools.consolidate(str(peft_src), str(merged), merge_lora=True, lora_alpha=_ALPHA)
    report = ckptools.diff(str(peft_src), str(merged))
    assert not report.identical
    [note] = report.notes
    assert note.startswith("A: a PEFT-wrapped model (LoRA 'default' on q_proj, v_proj)")
    assert f"ckpt consolidate {peft_src} OUT --merge-lora" in note and "--adapter" in note
    code, text = _cli(["diff", str(peft_src), str(merged)])
    assert code == 3 and "note: A: a PEFT-wrapped model" in text and "--merge-lora" in text
    # and compared as the note says, the merge is what the merged export holds
    again = tmp_path / "again"
    ckptools.consolidate(str(peft_src), str(again), merge_lora=True, lora_alpha=_ALPHA)
    assert ckptools.diff(str(again), str(merged)).identical
