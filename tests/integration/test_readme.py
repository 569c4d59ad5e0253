"""README.md's console examples, run on real checkpoints and compared with what they print.

Every ```console block of the README is a script: each ``$ ckpt ...`` line is run (as
``python -m ckptools``, this tree on ``PYTHONPATH``) in one temporary directory, in README
order, and what it prints (stdout, then stderr) must be the lines below it. The directory holds
what the real producers wrote, under the names the README uses:

* ``checkpoints/step-100``: FSDP2 on 2 gloo ranks saved with ``dcp.save``, the model's
  ``config.json`` in ``checkpoints/`` as a training script keeps it beside its saves;
* ``model.pt``: ``torch.save`` of a trained model's state dict;
* ``ds_run``: DeepSpeed ZeRO-2 ``save_checkpoint`` of a tiny transformers Llama on 2 ranks
  (``latest``, ``global_step2/``, ``config.json``);
* ``verl/global_step_100/actor``: verl's FSDP2 per-rank files (``fixtures/verl/fsdp2_ws2``,
  written by verl itself);
* ``lora/step-100``: a peft LoRA Llama trained under FSDP2 on 2 ranks, ``dcp.save``, its
  ``config.json`` in ``lora/``.

The only elisions a README example may use: a line ``...`` stands for any lines (none
included), and in a line ``<time>`` stands for a duration (``0.03 s``), ``<memory>`` for a size
(``24.5 MiB``); ``<time> (<memory>/s)`` is a duration and its rate, which a run under 0.05 s
leaves out. An example whose output shows an ``error:`` line (or a ``--json`` error object)
must fail with exit code 1 or 2, every other one succeed (0, or 3 for a diff). Commands in
```bash blocks are not run: they need what a test cannot have here (the Hub, S3, torchrun on
many ranks, a model to download).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import Produced

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
VERL_FIXTURE = ROOT / "fixtures" / "verl" / "fsdp2_ws2"

#: the explicit elisions inside a line, and what each stands for
PLACEHOLDERS = {
    # a duration and its rate: a run under 0.05 s prints no rate (it would be start-up noise)
    "<time> (<memory>/s)": r"\d+(\.\d+)? s( \(\d+(\.\d+)? (B|KiB|MiB|GiB)/s\))?",
    "<time>": r"\d+(\.\d+)? s",
    "<memory>": r"\d+(\.\d+)? (B|KiB|MiB|GiB)",
}


@dataclass(frozen=True)
class Example:
    """One ``$ ckpt ...`` line of a console block and the lines the README shows below it."""

    line: int
    args: tuple[str, ...]
    expected: tuple[str, ...]


def console_examples(text: str) -> list[Example]:
    """The ``$ ckpt`` commands of every ```console block of ``text``, in order."""
    examples: list[Example] = []
    in_block = False
    current: tuple[int, tuple[str, ...]] | None = None
    expected: list[str] = []

    def close() -> None:
        nonlocal current
        if current is not None:
            examples.append(Example(current[0], current[1], tuple(expected)))
        current = None
        expected.clear()

    for number, line in enumerate(text.splitlines(), start=1):
        if not in_block:
            in_block = line.strip() == "```console"
            continue
        if line.strip() == "```":
            close()
            in_block = False
        elif line.startswith("$ "):
            close()
            words = line[2:].split()
            assert words[0] == "ckpt", f"README.md:{number}: a console example runs ckpt only"
            current = (number, tuple(words[1:]))
        else:
            assert current is not None, f"README.md:{number}: output before any '$ ckpt' line"
            expected.append(line)
    assert not in_block, "README.md: a ```console block is not closed"
    return examples


def _line_pattern(expected: str) -> re.Pattern[str]:
    parts = re.split("(" + "|".join(map(re.escape, PLACEHOLDERS)) + ")", expected)
    return re.compile("".join(PLACEHOLDERS.get(p, re.escape(p)) for p in parts))


def matches(expected: tuple[str, ...], actual: list[str]) -> bool:
    """Whether ``actual`` is ``expected`` with its elisions filled in."""
    if not expected:
        return not actual
    head, rest = expected[0], expected[1:]
    if head == "...":
        return any(matches(rest, actual[i:]) for i in range(len(actual) + 1))
    if not actual or not _line_pattern(head).fullmatch(actual[0]):
        return False
    return matches(rest, actual[1:])


def _copy_zero_run(zero_dir: Path, run: Path) -> None:
    """DeepSpeed's run directory as ``save_checkpoint`` left it, without the truths the
    producing ranks added beside it."""
    run.mkdir()
    for name in ("latest", "config.json"):
        shutil.copy2(zero_dir / name, run / name)
    shutil.copytree(zero_dir / "global_step2", run / "global_step2")


@pytest.fixture(scope="module")
def workdir(
    produced: Callable[..., Produced],
    cached_output: Callable[..., Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Path:
    from tests.support import deepspeed_producers as ds
    from tests.support.producers import hf_config_dict

    if not ds.deepspeed_available():
        pytest.skip("the README's DeepSpeed example needs deepspeed")
    work = tmp_path_factory.mktemp("readme")
    fsdp2 = produced("fsdp2", world_size=2)
    shutil.copytree(fsdp2.path, work / "checkpoints" / "step-100")
    # what a training script keeps beside its saves for consolidate to find
    (work / "checkpoints" / "config.json").write_text(json.dumps(hf_config_dict(), indent=2))
    shutil.copy2(produced("torch_save").path, work / "model.pt")
    zero = cached_output(
        "readme-zero2-llama",
        [Path(ds.__file__)],
        lambda d: ds.produce_zero(str(d), 2, [(2, "fp32")], model_kind="llama"),
    )
    _copy_zero_run(Path(ds.case_dir(str(zero), 2, "fp32")), work / "ds_run")
    shutil.copytree(VERL_FIXTURE, work / "verl" / "global_step_100" / "actor")
    _peft_run(cached_output, work / "lora")
    return work


def _peft_run(cached_output: Callable[..., Path], run: Path) -> None:
    """A peft LoRA Llama trained a step under FSDP2 on 2 ranks and saved with ``dcp.save``
    (test_lora.py's producer), its base model's ``config.json`` beside the save."""
    pytest.importorskip("peft")
    import ckptools
    from tests.distributed import test_lora
    from tests.support.dist import run_ranks

    # the producer also calls ckptools.save_pretrained: any change to ckptools rebuilds it
    package = sorted(Path(ckptools.__file__).parent.rglob("*.py"))
    root = cached_output(
        "readme-lora-fsdp2",
        [Path(test_lora.__file__), *package],
        lambda d: run_ranks(test_lora._train_save, 2, str(d), False, "float32", "dcp", timeout=300),
    )
    shutil.copytree(root / "src", run / "step-100")
    shutil.copy2(root / "base_config" / "config.json", run / "config.json")


def run_ckpt(args: tuple[str, ...], cwd: Path) -> tuple[int, list[str]]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), CKPTOOLS_NO_PROGRESS="1", COLUMNS="100")
    done = subprocess.run(
        [sys.executable, "-m", "ckptools", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done.returncode, (done.stdout + done.stderr).splitlines()


def test_the_parser_reads_commands_outputs_and_elisions() -> None:
    text = "x\n```console\n$ ckpt a b\nout <time>\n...\n$ ckpt c\n```\n```bash\nckpt d\n```\n"
    assert console_examples(text) == [
        Example(3, ("a", "b"), ("out <time>", "...")),
        Example(6, ("c",), ()),
    ]
    assert matches(("out <time>", "..."), ["out 0.03 s", "more", "lines"])
    assert not matches(("out <time>",), ["out 0.03 s", "more"])
    assert not matches(("in <memory>",), ["in 3 apples"])
    # a rate is left out of a run too short to have one
    for line in ("1 KiB in 0.04 s", "1 KiB in 0.30 s (3.3 KiB/s)"):
        assert matches(("1 KiB in <time> (<memory>/s)",), [line])
    assert not matches(("1 KiB in <time> (<memory>/s)",), ["1 KiB in 0.30 s (fast)"])


def test_the_readmes_format_names_are_every_layouts() -> None:
    # a hand-kept list: it named 11 of the 17 layouts --format takes
    from ckptools.producers.base import layouts

    text = README.read_text()
    start = text.index("* `--format NAME` forces a layout:")
    listed = re.findall(r"`([a-z0-9_]+)`", text[start : text.index("\n\n", start)])
    assert sorted(listed) == sorted(layout.name for layout in layouts())


@pytest.mark.distributed  # the FSDP2 and DeepSpeed producers run on gloo ranks (made once, cached)
@pytest.mark.deepspeed
def test_every_console_example_of_the_readme_prints_what_it_shows(workdir: Path) -> None:
    examples = console_examples(README.read_text())
    assert len(examples) >= 8  # one per family at least: the parser found the blocks
    for example in examples:
        code, actual = run_ckpt(example.args, workdir)
        shown = "\n".join(actual)
        where = f"README.md:{example.line}: $ ckpt {' '.join(example.args)}"
        # an example of a wrong turn shows its error; every other one must succeed (3: a diff)
        shows_error = any(
            line.startswith("error: ") or '"error": ' in line for line in example.expected
        )
        assert code in ((1, 2) if shows_error else (0, 3)), f"{where} exited {code}:\n{shown}"
        assert matches(example.expected, actual), (
            f"{where} printed:\n{shown}\n--- README shows:\n" + "\n".join(example.expected)
        )
    # what the examples exported is what they promise: a model directory from_pretrained loads,
    # every weight in place (no missing or unexpected key)
    from transformers import AutoModelForCausalLM

    for name in ("hf_model", "hf_ds", "hf_verl", "hf_pt", "merged"):
        _, info = AutoModelForCausalLM.from_pretrained(workdir / name, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (name, info)
