"""Start-up (issue 27, goal 5): what a small DCP consolidate leaves out until it needs it.

These tests pin structure, never time: which modules a run imports, and that a small pickle is
checked without compiling the scan's regular expressions, with the same verdicts either way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ckptools.errors import DecodingLimitError
from ckptools.formats import pickle_patterns, pickle_scan, safe_pickle
from ckptools.producers import base, registry

REPO = str(Path(__file__).resolve().parents[2])

#: run in a fresh ``python -P``: the CLI's consolidate, then what it imported and compiled
_CONSOLIDATE = """
import json, sys
from ckptools.cli.main import main
try:
    main(["consolidate", sys.argv[1], sys.argv[2], "-q", "--weights-only"])
except SystemExit as e:
    assert not e.code, e.code
from ckptools.formats import pickle_patterns
print(json.dumps({
    "modules": sorted(m for m in sys.modules if m.startswith(("ckptools", "torch"))),
    "patterns": pickle_patterns._unshared.cache_info().currsize
    + pickle_patterns.records.cache_info().currsize,
}))
"""
#: the layout modules detecting a DCP directory imports: those tried before "dcp" and theirs
#: the producers' modules a DCP's detection reaches (the packages, and before DCP's own
#: modules the wrappers' and Megatron's probes); every family's package (its ``__init__``:
#: the names it declares, read by the config search's numbered-save test), none of their readers;
#: ``probing`` is the directory probe dcp_rank_local's layout shares, as small as ``base``, and
#: ``run_dirs`` the run-directory listing base's detection uses
_DCP_LAYOUTS = {
    "base", "probing", "registry", "numbered", "part_files", "run_dirs", "dcp", "dcp.wrappers",
    "dcp.rank_local", "dcp.layout", "megatron", "megatron.layout", "megatron.nemo", "deepspeed",
    "fsdp1", "hf",
    "compressed", "orbax", "orbax.layout", "fsdp1.local_state",
}  # fmt: skip


def test_a_small_dcp_consolidate_imports_only_what_it_uses(tmp_path: Path) -> None:
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    src = str(tmp_path / "ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": {"w": torch.ones(4, 8)}}, checkpoint_id=src, no_dist=True)
    env = {**os.environ, "PYTHONPATH": REPO}
    run = subprocess.run(
        [sys.executable, "-P", "-c", _CONSOLIDATE, src, str(tmp_path / "out")],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    found = json.loads(run.stdout.splitlines()[-1])
    modules = set(found["modules"])
    layouts = {m.removeprefix("ckptools.producers.") for m in modules if "producers." in m}
    assert layouts <= _DCP_LAYOUTS, sorted(layouts - _DCP_LAYOUTS)  # no verl, deepspeed, saves...
    assert not {"torch", "ckptools.engine.converted", "ckptools.plan.conversions"} & modules
    assert found["patterns"] == 0  # its one small .metadata scanned without them
    assert (tmp_path / "out" / "model.safetensors").is_file()


#: run in a fresh ``python -P``: the CLI with sys.argv[1:], then the heavy modules it imported
_VERB = """
import json, sys
from ckptools.cli.main import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    assert not e.code, e.code
heavy = ("torch", "transformers", "peft", "numpy")
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in heavy)))
"""
FIXTURES = Path(REPO) / "fixtures"


def heavy_imports(tmp_path: Path, *argv: str) -> set[str]:
    """What ``ckpt argv...`` imported of torch, transformers, peft and numpy: a fresh process
    with an empty user cache, as a new user's first run."""
    env = {**os.environ, "PYTHONPATH": REPO, "CKPTOOLS_CACHE_DIR": str(tmp_path / "cache")}
    run = subprocess.run(
        [sys.executable, "-P", "-c", _VERB, *argv],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    return set(json.loads(run.stdout.splitlines()[-1]))


def test_a_strided_dcp_is_copied_and_compared_without_torch(tmp_path: Path) -> None:
    # fixtures/dcp_single: dcp.save of non-contiguous (transposed, sliced) tensors, stored as is
    src = str(FIXTURES / "dcp_single")
    out = tmp_path / "out"
    assert heavy_imports(tmp_path, "consolidate", src, str(out), "-q", "--weights-only") == set()
    assert heavy_imports(tmp_path, "diff", src, src) == set()
    assert heavy_imports(tmp_path, "verify", src) == set()
    assert heavy_imports(tmp_path, "inspect", src) == set()
    # the same values as torch's as_strided(...).contiguous() (the fixture's reference)
    import torch
    from safetensors.torch import load_file

    reference = torch.load(FIXTURES / "dcp_single.reference.pt", weights_only=True)["model"]
    got = load_file(str(out / "model.safetensors"))
    for name in ("strided", "transposed"):  # stored non-contiguous in the fixture's .distcp
        want = reference[name].contiguous()
        assert torch.equal(got[name].view(torch.uint8), want.view(torch.uint8)), name


def test_detection_order_is_the_layouts_priority() -> None:
    every = base.layouts()  # imports every layout module
    assert [x.name for x in sorted(every, key=lambda x: x.priority)] == list(registry.MODULES)
    for layout in every:
        assert type(layout).__module__ == f"ckptools.producers.{registry.MODULES[layout.name]}"


def test_the_registry_knows_the_layouts_with_views() -> None:
    """``registry.VIEWED`` (what ``ckptools.load`` probes to leave a producer's names to its
    views) is exactly the layouts with a ``Layout.views``."""
    from ckptools.producers import registry

    with_views = tuple(x.name for x in base.layouts() if x.views is not None)
    assert with_views == registry.VIEWED and with_views  # megatron's at least


#: run in a fresh ``python -P``: ``ckptools.load``'s choice between ``dcp.load`` and reading
#: through the producer, for each path given, and the layout modules imported before and after
_LOAD_CHOICE = """
import json, sys
from ckptools.training import state
before = sorted(m for m in sys.modules if m.startswith("ckptools.producers."))
chosen = [state._written_by_dcp(p) for p in sys.argv[1:]]
after = sorted(m for m in sys.modules if m.startswith("ckptools.producers."))
print(json.dumps({"before": before, "chosen": chosen, "after": after}))
"""


def test_load_leaves_a_producers_own_names_to_its_views_asking_the_registry() -> None:
    """``ckptools.load`` reads a DCP with ``dcp.load`` but a run whose layout has its own views
    (a Megatron run, a save of it) through them; importing ``training.state`` probes nothing,
    and asking imports only the layouts with views or refusing by name, no other family's
    modules."""
    megatron = FIXTURES / "megatron" / "tp2_pp1"
    paths = [FIXTURES / "dcp_single", megatron, megatron / "iter_0000010"]
    run = subprocess.run(
        [sys.executable, "-P", "-c", _LOAD_CHOICE, *map(str, paths)],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": REPO}, check=True,
    )  # fmt: skip
    found = json.loads(run.stdout.splitlines()[-1])
    assert found["chosen"] == [True, False, False]
    assert "ckptools.producers.megatron.layout" not in found["before"]
    new = {m.removeprefix("ckptools.producers.") for m in found["after"]} - {
        m.removeprefix("ckptools.producers.") for m in found["before"]
    }
    # (the family packages' __init__ modules are plain data the registry read already); the
    # layouts a family recognises only to refuse are asked too (registry.REFUSED)
    refusing = {registry.MODULES[name] for name in registry.REFUSED}
    assert new == {"megatron.layout", "megatron.nemo", *refusing}, sorted(new)


def _loads(data: bytes) -> Any:
    return safe_pickle.restricted_loads(data, safe_pickle.ARCHIVE_GLOBALS, source="x.pkl")


def _shared_tuple(levels: int) -> bytes:
    out = b")q\x00"
    for k in range(levels):
        out += b"0h" + bytes([k]) + b"h" + bytes([k]) + b"\x86q" + bytes([k + 1])
    return out


@pytest.mark.parametrize("patterns", [False, True], ids=["scanned-exactly", "patterns"])
def test_verdicts_are_the_same_with_and_without_the_patterns(
    patterns: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # before 256 KiB of pickles a process scans opcode by opcode, after it compiles the patterns
    spent = pickle_scan._EXACT_BYTES_BEFORE_PATTERNS if patterns else 0
    monkeypatch.setattr(pickle_scan, "_exact_bytes", spent)
    # a memo index past the pickle's end but below 2**16: known_safe lets it through unscanned,
    # and so does the exact scan's path (the scan alone would refuse it)
    assert _loads(b"\x80\x02Nr\x00\x10\x00\x00.") is None
    with pytest.raises(DecodingLimitError, match="memo index 100000000"):
        _loads(b"\x80\x02Nr\x00\xe1\xf5\x05.")
    with pytest.raises(DecodingLimitError, match="would hash more than 10000 nodes"):
        _loads(b"\x80\x02}" + _shared_tuple(14) + b"K\x01s.")
    key: tuple[Any, ...] = ()
    for _ in range(3):
        key = (key, key)
    assert _loads(b"\x80\x02}" + _shared_tuple(3) + b"K\x01s.") == {key: 1}


def test_a_big_pickle_uses_the_patterns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pickle_scan, "_exact_bytes", 0)
    used = []
    real = pickle_patterns.known_safe
    monkeypatch.setattr(pickle_patterns, "known_safe", lambda d: used.append(len(d)) or real(d))
    small = safe_pickle.restricted_loads(b"\x80\x02]q\x00.", {}, source="s")
    assert small == [] and not used  # scanned exactly, known_safe never asked
    n = pickle_scan._EXACT_BYTES_BEFORE_PATTERNS
    data = b"\x80\x02X" + n.to_bytes(4, "little") + b"a" * n + b"."
    assert len(_loads(data)) == n
    assert used == [len(data)]  # past the allowance: the C-speed check, as before
    assert pickle_scan._exact_bytes == pickle_scan._EXACT_BYTES_BEFORE_PATTERNS


def test_a_mid_sized_dcp_metadata_is_scanned_without_the_patterns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DCP ``.metadata`` of 1,000 small tensors (~200 KB, what a 1 GB Mixtral run's is of the
    same order: 96 KB) is followed opcode by opcode: faster than compiling the patterns first
    (issue 38's start-up; the first setting, 64 KiB, compiled them for it)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from ckptools.producers.base import read_manifest

    src = tmp_path / "ckpt"
    state = {f"model.layers.{i}.w{j}": torch.ones(2, 2) for i in range(200) for j in range(5)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(src), no_dist=True)
    assert 150_000 < (src / ".metadata").stat().st_size < pickle_scan._EXACT_BYTES_BEFORE_PATTERNS
    monkeypatch.setattr(pickle_scan, "_exact_bytes", 0)
    used = []
    real = pickle_patterns.known_safe
    monkeypatch.setattr(pickle_patterns, "known_safe", lambda d: used.append(len(d)) or real(d))
    manifest = read_manifest(str(src))
    assert len(manifest.tensors) == 1000 and not used
