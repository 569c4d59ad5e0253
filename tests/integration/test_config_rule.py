"""One rule for the model's ``config.json``, every verb: ``--config``, else beside the
checkpoint, then up to its run directory; used only where the model it names fits the tensors.

Producers: the tiny Llama FSDP2 job (``produced("fsdp2")``) and its config
(``hf_config_dict``), the every-dtype DCP (``produced("single")``), Megatron-core's own saves
(``fixtures/megatron/``) and transformers' ``save_pretrained``.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from click.testing import CliRunner
from safetensors.torch import load_file

import ckptools
from ckptools.cli.main import cli
from ckptools.errors import UsageError
from tests.conftest import Produced
from tests.support.producers import hf_config_dict

MEGATRON = Path(__file__).resolve().parents[2] / "fixtures" / "megatron"


def _invoke(*args: str) -> Any:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_a_config_beside_that_does_not_fit_is_named_and_not_copied(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    """A Llama config beside a checkpoint of other names would make ``from_pretrained`` build a
    random Llama (every weight missing): refused in one line naming it with the counts,
    --config and --weights-only, nothing written; with --weights-only the weights alone, the
    config named in a note and not copied; the same config given with --config is refused."""
    src = tmp_path / "ckpt"
    shutil.copytree(produced("single").path, src)
    (src / "config.json").write_text(json.dumps(hf_config_dict()))
    (src / "tokenizer.json").write_text("{}")
    out = tmp_path / "out"
    refused = _invoke("consolidate", str(src), str(out))
    assert refused.exit_code == 2, refused.output
    # one error line (a first run may say it checks the config's model, once, before it)
    [line] = [n for n in refused.output.splitlines() if n.startswith("error:")]
    assert str(src / "config.json") in line and "21 missing" in line, line
    assert "--config" in line and "--weights-only" in line, line
    assert list(tmp_path.glob("out*")) == []
    result = _invoke("consolidate", str(src), str(out), "--weights-only")
    assert result.exit_code == 0, result.output
    [note] = [line for line in result.output.splitlines() if "does not fit" in line]
    assert str(src / "config.json") in note and "--config" in note, note
    assert "21 missing" in note and "weights only" in note, note
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]

    given = _invoke("consolidate", str(src), str(tmp_path / "o2"), "--config",
                    str(src / "config.json"))  # fmt: skip
    assert given.exit_code == 2, given.output
    assert len(given.output.strip().splitlines()) == 1 and "does not fit" in given.output
    assert not (tmp_path / "o2").exists()


def test_no_config_is_refused_naming_config_and_weights_only(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    """The Llama FSDP2 job's DCP with no config.json beside it or above it: from_pretrained
    could not load OUT, so consolidate stops before writing anything, in one line naming
    --config and --weights-only (exit 2; neither OUT nor OUT.tmp-* exists). --weights-only
    writes the weights alone (exit 0, a note says so); --dry-run plans, saying it would stop;
    --select (a sub-tree, no model) needs no config."""
    src = tmp_path / "run" / "ckpt"
    shutil.copytree(produced("fsdp2", world_size=2).path, src)
    out = tmp_path / "out"
    refused = _invoke("consolidate", str(src), str(out))
    assert refused.exit_code == 2, refused.output
    # one error line (a first run may say it checks the config's model, once, before it)
    [line] = [n for n in refused.output.splitlines() if n.startswith("error:")]
    assert "no config.json" in line and str(src) in line, line
    assert "--config CONFIG.json" in line and "--weights-only" in line, line
    assert list(tmp_path.glob("out*")) == []
    with pytest.raises(UsageError, match="--weights-only"):
        ckptools.consolidate(str(src), str(out), quiet=True)
    assert list(tmp_path.glob("out*")) == []

    planned = _invoke("consolidate", str(src), str(out), "--dry-run")
    assert planned.exit_code == 0, planned.output
    assert "without --dry-run the run would stop here" in planned.output, planned.output
    assert list(tmp_path.glob("out*")) == []

    written = _invoke("consolidate", str(src), str(out), "--weights-only")
    assert written.exit_code == 0, written.output
    assert "weights only" in written.output and "from_pretrained" in written.output
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    reference = ckptools.consolidate(str(src), str(tmp_path / "lib"), weights_only=True, quiet=True)
    assert reference.config_files == ()
    ours, theirs = (
        load_file(out / "model.safetensors"),
        load_file(tmp_path / "lib" / "model.safetensors"),
    )
    assert ours.keys() == theirs.keys() and "lm_head.weight" in ours
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)

    selected = _invoke("consolidate", str(src), str(tmp_path / "sel"), "--select", "*", "-q")
    assert selected.exit_code == 0, selected.output


def test_key_names_the_model_so_the_config_rule_holds(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    """``--key model_state_dict`` names the model's own state dict in a torch.save training
    checkpoint: its export must load with from_pretrained as any other, so without a config it
    is refused as the plain export is (it once wrote the weights alone and exited 0, silently)."""
    weights = torch.load(produced("torch_save").path, weights_only=True)
    src = tmp_path / "run" / "train.pt"
    src.parent.mkdir()
    torch.save({"model_state_dict": weights, "epoch": 3}, src)
    refused = _invoke("consolidate", str(src), str(tmp_path / "out"), "--key", "model_state_dict")
    assert refused.exit_code == 2, refused.output
    assert "--weights-only" in refused.output and "--config" in refused.output, refused.output
    assert list(tmp_path.glob("out*")) == []
    written = _invoke(
        "consolidate", str(src), str(tmp_path / "out"), "--key", "model_state_dict",
        "--weights-only", "-q",
    )  # fmt: skip
    assert written.exit_code == 0, written.output
    assert load_file(tmp_path / "out" / "model.safetensors").keys() == weights.keys()


def test_a_config_that_fits_is_copied_and_loads(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    src = tmp_path / "ckpt"
    shutil.copytree(produced("fsdp2", world_size=2).path, src)
    (src / "config.json").write_text(json.dumps(hf_config_dict()))
    out = tmp_path / "out"
    result = _invoke("consolidate", str(src), str(out), "-q")
    assert result.exit_code == 0, result.output
    assert (out / "config.json").exists()
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(model.lm_head.weight, load_file(out / "model.safetensors")["lm_head.weight"])


def test_dtype_cast_is_stated_in_the_written_config(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    """``--dtype bfloat16``: the config says bfloat16 (as ``save_pretrained`` writes after
    ``model.to(torch.bfloat16)``), so ``from_pretrained(dtype="auto")`` loads bfloat16."""
    src = tmp_path / "ckpt"
    shutil.copytree(produced("fsdp2", world_size=2).path, src)
    (src / "config.json").write_text(json.dumps(hf_config_dict()))  # "torch_dtype": "float32"
    out = tmp_path / "out"
    result = _invoke("consolidate", str(src), str(out), "--dtype", "bfloat16", "-q")
    assert result.exit_code == 0, result.output
    written = json.loads((out / "config.json").read_text())
    assert written["torch_dtype"] == "bfloat16"
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}

    # transformers' own save of the model, cast: the key it writes says bfloat16 here too
    theirs = tmp_path / "theirs"
    model.save_pretrained(theirs)
    key = next(
        k for k in ("dtype", "torch_dtype") if k in json.loads((theirs / "config.json").read_text())
    )
    (src / "config.json").write_text(
        (theirs / "config.json").read_text().replace("bfloat16", "float32")
    )
    again = tmp_path / "again"
    assert _invoke("consolidate", str(src), str(again), "--dtype", "bfloat16", "-q").exit_code == 0
    assert json.loads((again / "config.json").read_text())[key] == "bfloat16"


def _save_hf(path: Path, hidden: int) -> None:
    cfg = transformers.Qwen3Config(
        hidden_size=hidden, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=100, max_position_embeddings=16,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(path)


def test_shard_to_megatron_output_is_read_back_without_config(tmp_path: Path) -> None:
    """``shard --to megatron`` keeps the HF model's config in the run directory: consolidate
    and diff of the run find it first, not the config of another model above the run (here the
    working directory's, hidden 48, against the run's hidden 64)."""
    work = tmp_path / "work"
    _save_hf(work, 48)  # another model's config.json in the directory above the run
    src = tmp_path / "hf"
    _save_hf(src, 64)
    run = work / "run"
    shard = _invoke("shard", str(src), str(run), "--to", "megatron", "-q")
    assert shard.exit_code == 0, shard.output
    for source in (run, run / "iter_0000001"):
        out = tmp_path / f"back-{source.name}"
        result = _invoke("consolidate", str(source), str(out), "-q")
        assert result.exit_code == 0, result.output
        ours, theirs = load_file(out / "model.safetensors"), load_file(src / "model.safetensors")
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[n], t) for n, t in theirs.items())
        assert json.loads((out / "config.json").read_text())["hidden_size"] == 64
        transformers.AutoModelForCausalLM.from_pretrained(out)  # the model these weights are
    diff = _invoke("diff", str(run), str(src))
    assert diff.exit_code == 0 and "identical" in diff.output, diff.output
    kept = json.loads((run / "config.json").read_text())
    assert kept == json.loads((src / "config.json").read_text())


@pytest.mark.parametrize("inside", [False, True])
def test_reshard_of_a_megatron_run_finds_the_config_consolidate_finds(
    tmp_path: Path, inside: bool
) -> None:
    """The HF config kept beside the run directory: ``consolidate`` found it; ``reshard``
    (of the run, or of its save) finds it by the same rule, without --config."""
    project = tmp_path / "project"
    shutil.copytree(MEGATRON / "tp2_pp1", project / "run")
    shutil.copy(MEGATRON / "hf_llama" / "config.json", project / "config.json")
    src = project / "run" / ("iter_0000010" if inside else "")
    assert _invoke("consolidate", str(src), str(tmp_path / "hf"), "-q").exit_code == 0
    result = _invoke("reshard", str(src), str(tmp_path / "dcp"), "--world-size", "2", "-q")
    assert result.exit_code == 0, result.output
    back = _invoke("consolidate", str(tmp_path / "dcp"), str(tmp_path / "hf2"), "-q",
                   "--config", str(project / "config.json"))  # fmt: skip
    assert back.exit_code == 0, back.output
    a, b = (
        load_file(tmp_path / "hf" / "model.safetensors"),
        load_file(tmp_path / "hf2" / "model.safetensors"),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_a_config_above_a_megatron_run_that_does_not_fit_is_refused(tmp_path: Path) -> None:
    """Megatron's mapping needs the config: one found above the run whose model has other
    sizes (hidden 48 against the run's 64, the same heads and vocabulary) is refused in one
    line naming it and --config, rather than copied beside weights it cannot load."""
    work = tmp_path / "work"
    _save_hf(work, 48)
    src = tmp_path / "hf"
    _save_hf(src, 64)
    run = work / "run"
    assert _invoke("shard", str(src), str(run), "--to", "megatron", "-q").exit_code == 0
    (run / "config.json").unlink(missing_ok=True)  # a run written by Megatron itself keeps none
    out = tmp_path / "out"
    result = _invoke("consolidate", str(run), str(out))
    assert result.exit_code == 2, result.output
    [line] = [n for n in result.output.splitlines() if n.startswith("error:")]
    assert str(work / "config.json") in line and "--config" in line, line
    assert "39 of another shape" in line, line
    assert not out.exists()
    resharded = _invoke("reshard", str(run), str(out), "--world-size", "2")
    assert resharded.exit_code == 2 and "39 of another shape" in resharded.output, resharded.output
    assert not out.exists()
    fixed = _invoke("consolidate", str(run), str(out), "--config", str(src), "-q")
    assert fixed.exit_code == 0, fixed.output
