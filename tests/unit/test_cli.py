"""The CLI surface: help, exit codes, shared options, output, and that --help never imports
torch."""

from __future__ import annotations

import dataclasses
import errno
import importlib
import json
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from ckptools.cli.main import cli
from ckptools.cli.render import emit
from ckptools.errors import CkptError


def test_help_lists_commands() -> None:
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0
    assert "inspect" in result.output


def test_help_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from ckptools.cli.main import cli\n"
        "try:\n"
        "    cli.main(args=['inspect', '--help'], prog_name='ckpt')\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("NO-TORCH")


def test_missing_path_is_one_line_exit_1(tmp_path: object) -> None:
    result = CliRunner().invoke(cli, ["inspect", "/nonexistent/ckpt"])
    assert result.exit_code == 1
    assert result.output.strip() == "error: /nonexistent/ckpt: no such file or directory"


def test_unknown_directory_lists_each_layouts_reason_under_debug(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("lr 3e-4\n")
    result = CliRunner().invoke(cli, ["inspect", str(tmp_path)])
    assert result.exit_code == 1
    assert len(result.output.splitlines()) == 1 and "--debug lists" in result.output
    result = CliRunner().invoke(cli, ["inspect", str(tmp_path), "--debug"])
    for name in ("dcp", "safetensors", "torch_save", "accelerate", "trainer", "lightning"):
        assert f"  {name}: " in result.stderr


def test_disk_full_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", "/data/out/model.safetensors")

    monkeypatch.setattr("ckptools.verbs.inspection.inspect", full)
    result = CliRunner().invoke(cli, ["inspect", "x"])
    assert result.exit_code == 1
    assert result.output.strip() == (
        "error: /data/out/model.safetensors: No space left on device; nothing was written"
    )


def test_output_under_a_file_is_one_line(tmp_path: Path) -> None:
    # OUT's parent is a regular file: the environment's problem, not a bug (no traceback).
    (tmp_path / "file").write_bytes(b"")
    fixture = Path(__file__).resolve().parents[2] / "fixtures" / "fsdp2_ws2"
    result = CliRunner().invoke(cli, ["consolidate", str(fixture), str(tmp_path / "file" / "out")])
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert result.output.count("\n") == 1
    assert f"{tmp_path / 'file'} is not a directory" in result.output


def test_exit_codes_have_one_home() -> None:
    from ckptools.cli import exit_codes

    assert (exit_codes.EXIT_OK, exit_codes.EXIT_ERROR) == (0, 1)
    assert (exit_codes.EXIT_USAGE, exit_codes.EXIT_DIFFERENCES) == (2, 3)


def _commands() -> list[click.Command]:
    return [cli.commands[name] for name in sorted(cli.commands)]


def test_shared_options_have_the_librarys_defaults() -> None:
    # --workers unset is None in every command: the library resolves it (argument >
    # CKPTOOLS_WORKERS > tunables.DEFAULT_WORKERS), so the CLI holds no second default.
    seen = set()
    for command in _commands():
        for param in command.params:
            if param.name == "workers":
                seen.add(command.name)
                assert param.default is None, command.name
                assert "CKPTOOLS_WORKERS" in (getattr(param, "help", None) or ""), command.name
            if param.name == "quiet":
                assert sorted(param.opts) == ["--quiet", "-q"], command.name
    assert {"consolidate", "reshard", "shard", "verify", "checksum"} <= seen


@pytest.mark.parametrize(
    ("args", "target"),
    [
        (["consolidate", "src", "out"], "ckptools.verbs.consolidate.consolidate"),
        (["reshard", "src", "out", "--world-size", "2"], "ckptools.verbs.reshard.reshard"),
        (["shard", "src", "out", "--world-size", "2"], "ckptools.verbs.reshard.shard"),
        (["verify", "src"], "ckptools.verify.verify"),
        (["checksum", "src"], "ckptools.verify.checksums.write_checksums"),
    ],
)
def test_options_pass_through_unchanged(
    monkeypatch: pytest.MonkeyPatch, args: list[str], target: str
) -> None:
    seen: dict[str, object] = {}

    def record(*a: object, **kwargs: object) -> None:
        seen.update(kwargs)
        raise CkptError("recorded")

    module, name = target.rsplit(".", 1)
    # by module object: ckptools.consolidate etc. are also the public functions' names
    monkeypatch.setattr(importlib.import_module(module), name, record)
    result = CliRunner().invoke(cli, [*args, "--json"])
    assert result.exit_code == 1 and "recorded" in result.output
    assert seen["workers"] is None
    assert seen["quiet"] is True  # --json implies --quiet: no bar inside the JSON
    assert seen["format"] is None and seen["storage_options"] is None


def test_emit_prints_json_or_text_on_the_reporting_rank(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    @dataclasses.dataclass(frozen=True)
    class Result:
        n: int

        def to_dict(self) -> dict[str, int]:
            return {"n": self.n}

    def text(d: dict[str, object]) -> str:
        return f"n is {d['n']}"

    monkeypatch.delenv("RANK", raising=False)
    emit(Result(3), True, text)
    assert json.loads(capsys.readouterr().out) == {"n": 3}
    emit({"n": 4}, False, text)
    assert capsys.readouterr().out == "n is 4\n"
    monkeypatch.setenv("RANK", "1")  # a non-zero rank under torchrun stays silent
    emit(Result(5), True, text)
    emit(Result(5), False, text)
    assert capsys.readouterr().out == ""


def test_debug_is_accepted_after_the_command() -> None:
    result = CliRunner().invoke(cli, ["inspect", "/nonexistent/ckpt", "--debug"])
    # --debug took effect: the error propagates with its traceback instead of one line
    assert isinstance(result.exception, CkptError)
    assert "No such option" not in result.output


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["inspect", "/nonexistent/ckpt", "--json"], 1, "/nonexistent/ckpt: no such file"),
        (["inspect", "--json"], 2, "Missing argument 'PATH'"),
        (["consolidate", "/nonexistent/ckpt", "out", "--json", "--max-shard-size", "x"], 2, "x"),
    ],
)
def test_json_errors_are_one_json_object_on_stdout(args: list[str], code: int, says: str) -> None:
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == code
    obj = json.loads(result.stdout)
    assert obj["exit_code"] == code and says in obj["error"]
    assert result.stderr == ""


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (
            ["inspect", "x", "--format", "nope"],
            "Invalid value for '--format': 'nope' is not one of",
        ),
        (["consolidate", "src"], "Missing argument 'OUT'"),
        (["reshard", "src", "out"], "Missing option '--world-size'"),
        (["nosuch"], "No such command 'nosuch'"),
    ],
)
def test_usage_mistakes_are_one_line_naming_the_help(args: list[str], says: str) -> None:
    # click's own usage errors were three lines (usage, "Try ...", the error)
    result = CliRunner().invoke(cli, args, prog_name="ckpt")
    assert result.exit_code == 2
    (line,) = result.stderr.splitlines()
    command = " ".join(["ckpt", *args[:1]]) if args[0] != "nosuch" else "ckpt"
    assert line.startswith(f"error: {says}") and line.endswith(f"; see `{command} --help`")


def _help_examples() -> list[tuple[str, str]]:
    """(where, example) for each command line shown in ``ckpt --help`` and each command's."""
    texts = {"ckpt": cli.get_help(click.Context(cli, info_name="ckpt"))}
    for name, command in cli.commands.items():
        texts[name] = command.get_help(click.Context(command, info_name=name))
    found = []
    for where, text in texts.items():
        for line in text.split("\nOptions:")[0].splitlines():
            # an example starts its line (``torchrun ... -m ckptools``), or the group's second
            # column; prose that quotes a command does neither
            for start in ("-m ckptools ", "ckpt "):
                at = line.find(start)
                lead = line[:at]
                if at < 0 or line[at + len(start) :].startswith(("COMMAND", "[OPTIONS]")):
                    continue
                if lead.strip() and not lead.endswith("   ") and "torchrun" not in lead:
                    continue
                found.append((where, line[at + len(start) :].split(" | ")[0].strip()))
                break
    return found


def test_help_names_every_family_the_readme_claims() -> None:
    text = cli.get_help(click.Context(cli, info_name="ckpt"))
    families = ["FSDP2", "accelerate", "Trainer", "Lightning", "torchtitan", "DeepSpeed"]
    families += ["verl", "transformers distributed", "PEFT", "safetensors", "torch.save"]
    families += ["Megatron-core torch_dist"]
    for family in families:
        assert family in text, family
    assert len(_help_examples()) > 30


@pytest.mark.parametrize(("where", "example"), _help_examples())
def test_every_help_example_parses(where: str, example: str) -> None:
    import shlex

    assert "   " not in example, "lines joined in the docstring (a backslash-newline?)"
    name, *args = shlex.split(example)
    command = cli.commands[name]
    # parsing the arguments checks every option exists, takes what it is given, and that
    # every required argument is there; the paths are placeholders, so nothing runs
    command.make_context(name, args, parent=click.Context(cli, info_name="ckpt"))


def test_list_of_a_directory_without_saves_says_what_it_looked_for(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["list", str(tmp_path)])
    assert result.exit_code == 0
    assert result.output.startswith(f"{tmp_path}: no saves (looked for a CheckpointManager's")


def test_list_of_a_directory_of_checkpoints_names_them(tmp_path: Path) -> None:
    """Checkpoints side by side, none numbered (``dcp.save`` twice): not "no saves" but the
    checkpoints, and the command that looks at one."""
    import shutil

    fixture = Path(__file__).resolve().parents[2] / "fixtures" / "dcp_single"
    for name in ("a", "b"):
        shutil.copytree(fixture, tmp_path / name)
    result = CliRunner().invoke(cli, ["list", str(tmp_path)])
    assert result.exit_code == 0 and result.output.count("\n") == 1, result.output
    assert result.output.strip() == (
        f"{tmp_path}: no numbered saves here; it holds 2 checkpoint(s): a (dcp), b (dcp): "
        f"`ckpt inspect {tmp_path}/a`"
    )


#: the command whose ``--help`` shows each place a producer's package fills (its ``HELP``)
_HELP_PLACES = {
    "reads": "ckpt", "refuses": "ckpt", "consolidate --masters": "consolidate",
    "consolidate examples": "consolidate",
    "shard --world-size": "shard", "shard --to": "shard", "shard examples": "shard",
    "shard --make-vocab-size-divisible-by": "shard", "list saves": "list", "--iteration": "inspect",
    "consolidate --dtype": "consolidate",
}  # fmt: skip


def test_a_producers_words_in_the_help_are_its_packages(tmp_path: Path) -> None:
    """Issue 37: what ``--help`` (and ``list``'s empty answer) says of one producer is written
    by that producer's package (``HELP``, read through the registry), each where it goes."""
    from ckptools.producers.registry import declared

    said = declared("HELP")
    assert {place for place, _ in said} == set(_HELP_PLACES)  # each place filled, none unknown
    texts = {"ckpt": cli.get_help(click.Context(cli, info_name="ckpt"))}
    for name, command in cli.commands.items():
        texts[name] = command.get_help(click.Context(command, info_name=name))
    empty = CliRunner().invoke(cli, ["list", str(tmp_path)]).output
    for place, text in said:
        if place in ("reads", "refuses"):  # a row of a table: the family, an example or why
            text = " ".join(text)
        elif place == "list saves":  # the family, an example save's name
            assert f", {text[0]} {text[1]}, " in empty, text
            text = f"{text[0]} ({text[1]})"
        assert " ".join(text.split()) in " ".join(texts[_HELP_PLACES[place]].split()), place


def test_format_choices_are_every_registered_layout() -> None:
    """``--format`` lists every layout ckptools detects (a new family is forced by name too)."""
    import ckptools.producers  # noqa: F401  (registers the layouts)
    from ckptools.cli.options import FORMAT_NAMES
    from ckptools.producers.base import layouts

    assert sorted(FORMAT_NAMES) == sorted(layout.name for layout in layouts())


_LIBRARY_NOISE = """
import logging, sys
from ckptools.cli.main import cli
try:
    cli.main(sys.argv[1:-1] + ["list", sys.argv[-1]], standalone_mode=False)
except Exception:
    pass
logging.getLogger("torchao").warning("Failed to load _C_cutlass_90a.abi3.so")
logging.getLogger("ckptools.verbs").warning("ckptools' own warning")
logging.getLogger("transformers").error("a library's error")
"""


@pytest.mark.parametrize("debug", [False, True])
def test_libraries_warnings_are_shown_only_under_debug(tmp_path: Path, debug: bool) -> None:
    """torchao (imported by transformers whenever it is installed) logs warnings at import that
    are none of the user's business; the CLI keeps its own and every error, and --debug shows
    everything."""
    args = ["--debug"] if debug else []
    proc = subprocess.run(
        [sys.executable, "-c", _LIBRARY_NOISE, *args, str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert "ckptools' own warning" in proc.stderr
    assert "a library's error" in proc.stderr
    assert ("Failed to load" in proc.stderr) is debug, proc.stderr


def test_prune_of_a_run_of_dcp_saves_per_step_is_refused(tmp_path: Path) -> None:
    """``dcp.save`` per step (torchtitan's, a script's ``step-N``): no CheckpointManager commit
    marker, so ``prune`` refuses naming them rather than reporting "deleted 0"."""
    import shutil

    fixture = Path(__file__).resolve().parents[2] / "fixtures" / "dcp_single"
    for step in (1, 2):
        shutil.copytree(fixture, tmp_path / f"step-{step}")
    result = CliRunner().invoke(cli, ["prune", str(tmp_path), "--keep-last", "1"])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert "holds 2 dcp save(s) (step-1, ...), not a CheckpointManager's" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-2"]
