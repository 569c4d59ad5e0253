"""Hostile pickles and sizes are decoded within bounds (issue 19, items 4 and 5).

Every case starts from a real checkpoint (``dcp.save`` or ``torch.save``), then replaces what a
stranger controls: the DCP ``.metadata`` pickle, the ``data.pkl`` of a ``torch.save`` file, the
sizes in the metadata, the ``--world-size`` asked for. Each command runs as a subprocess (``python
-m ckptools``) that must end within 30 s and 1 GiB of resident memory with one ``error:`` line
naming the file and the limit, and leave the source as it was.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pickle
import resource
import select
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptools.errors import DecodingLimitError
from ckptools.formats import safe_pickle
from ckptools.io import tunables
from ckptools.producers.dcp.layout import read_dcp

TIMEOUT_S = 30
MAX_RSS_BYTES = 1 << 30

# The address space of each command is capped (well above the 1 GiB asserted) so a regression
# cannot take the machine down with it.
_AS_CAP = 6 << 30


def _ckpt(*args: str) -> tuple[int, str, int, float]:
    """(exit code, output, peak RSS in bytes, seconds) of ``ckpt args`` run as a child of this
    process, its peak RSS read from ``wait4``'s rusage of it alone."""
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    t0 = time.monotonic()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        # its own session, so a command that runs past the limit is killed with anything it
        # started (a hashing loop in C would otherwise outlive the test and hold a core)
        child = subprocess.Popen(
            [sys.executable, "-m", "ckptools", *args],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            env=env,
            start_new_session=True,
        )
        try:
            with contextlib.suppress(ProcessLookupError):  # a child that has already exited
                resource.prlimit(child.pid, resource.RLIMIT_AS, (_AS_CAP, _AS_CAP))
            exited = os.pidfd_open(child.pid)
            try:
                ready, _, _ = select.select([exited], [], [], TIMEOUT_S)
            finally:
                os.close(exited)
        except BaseException:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            raise
        if not ready:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            pytest.fail(f"ckpt {' '.join(args)} ran past {TIMEOUT_S} s")
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        seconds = time.monotonic() - t0
        out.seek(0)
        err.seek(0)
        text = (out.read() + err.read()).decode()
    return child.returncode, text.strip(), usage.ru_maxrss * 1024, seconds


def _one_line_error(*args: str, exit_code: int = 1) -> str:
    code, text, rss, seconds = _ckpt(*args)
    assert code == exit_code, text
    assert text.startswith("error: ") and "\n" not in text, text
    assert "Traceback" not in text
    assert rss < MAX_RSS_BYTES, f"ckpt {args[0]} peaked at {rss >> 20} MiB"
    assert seconds < TIMEOUT_S
    return text


def _digest(root: Path) -> dict[str, str]:
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _verify_problem(src: Path) -> str:
    """``verify`` reports an unreadable checkpoint as a problem (exit 3) or a one-line error."""
    code, text, rss, seconds = _ckpt("verify", str(src))
    assert code in (1, 3), text
    assert "Traceback" not in text and rss < MAX_RSS_BYTES and seconds < TIMEOUT_S
    if code == 1:
        assert text.startswith("error: ") and "\n" not in text, text
        return text
    problems = [line.strip() for line in text.splitlines() if line.strip().startswith("[")]
    assert len(problems) == 1, text
    return problems[0]


def _all_verbs(src: Path, tmp_path: Path, *, dcp_only: bool = True) -> list[str]:
    """The one-line errors of inspect, verify, consolidate and (DCP) reshard on ``src``; none
    writes an output or changes the source."""
    before = _digest(src)
    msgs = [
        _one_line_error("inspect", str(src)),
        _verify_problem(src),
        _one_line_error("consolidate", str(src), str(tmp_path / "hf")),
    ]
    if dcp_only:
        msgs.append(_one_line_error("reshard", str(src), str(tmp_path / "re"), "--world-size", "2"))
    assert _digest(src) == before
    assert not (tmp_path / "hf").exists() and not (tmp_path / "re").exists()
    return msgs


# --------------------------------------------------------------------------------------------------
# Hostile values
# --------------------------------------------------------------------------------------------------


def _dag_dict(levels: int) -> dict[str, Any]:
    """A few hundred bytes pickled; 2**levels leaves when walked as a tree."""
    d: dict[str, Any] = {"leaf": 1}
    for _ in range(levels):
        d = {"a": d, "b": d}
    return d


def _dag_list(levels: int) -> list[Any]:
    v: list[Any] = [1]
    for _ in range(levels):
        v = [v, v]
    return v


def _deep_list_pickle(depth: int) -> bytes:
    """``[[[...]]]`` nested ``depth`` deep (opcodes: EMPTY_LIST x depth, APPEND x depth - 1)."""
    return b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."


def _bytearray_pickle(size: int) -> bytes:
    """``bytearray(size)``: GLOBAL, LONG1 size, TUPLE1, REDUCE."""
    raw = size.to_bytes((size.bit_length() + 8) // 8, "little", signed=True)
    return b"\x80\x02cbuiltins\nbytearray\n\x8a" + bytes([len(raw)]) + raw + b"\x85R."


def _copies_pickle(elements: int, copies: int) -> bytes:
    """A list of ``elements`` Nones, memoised, then ``set(list)`` rebuilt ``copies`` times: a
    few bytes per copy, ``elements`` objects each."""
    out = bytearray(b"\x80\x02cbuiltins\nset\nq\x00](")
    out += b"N" * elements
    out += b"eq\x01("  # APPENDS, BINPUT 1, MARK
    out += b"h\x00h\x01\x85R" * copies  # set(list)
    out += b"l."  # LIST of the sets
    return bytes(out)


# --------------------------------------------------------------------------------------------------
# Real checkpoints, then damaged
# --------------------------------------------------------------------------------------------------


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"layer.weight": torch.randn(8, 4, generator=g), "layer.bias": torch.randn(4)}


@pytest.fixture
def dcp_ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "src"
    dcp.save({"model": _tensors(), "extra": {"step": 3}}, checkpoint_id=str(path))
    return path


def _edit_metadata(ckpt: Path, edit: Any) -> None:
    """Load ``.metadata`` with torch's own classes, let ``edit`` change it, pickle it back (the
    pickler's memo keeps shared references shared: a DAG stays a few hundred bytes)."""
    path = ckpt / ".metadata"
    with open(path, "rb") as f:
        md = pickle.load(f)
    edit(md)
    path.write_bytes(pickle.dumps(md, protocol=2))


def _replace_data_pkl(file: Path, data: bytes) -> None:
    """Rewrite a ``torch.save`` zip with its ``data.pkl`` record replaced (stored, like torch)."""
    with zipfile.ZipFile(file) as z:
        records = [(i.filename, z.read(i.filename)) for i in z.infolist()]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, body in records:
            z.writestr(name, data if name.endswith("/data.pkl") else body)
    file.write_bytes(buf.getvalue())


@pytest.fixture
def pt_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.pt"
    torch.save(_tensors(), path)
    return path


# --------------------------------------------------------------------------------------------------
# Item 4: pickles
# --------------------------------------------------------------------------------------------------


def test_dag_in_torch_save_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    torch.save({**_tensors(), "extra": _dag_dict(60)}, path)
    assert path.stat().st_size < 1 << 20
    for msg in _all_verbs(path, tmp_path, dcp_only=False):
        assert path.name in msg and tunables.MAX_PICKLE_OBJECTS_ENV in msg


def test_dag_in_data_pkl_of_list_is_refused(pt_file: Path, tmp_path: Path) -> None:
    _replace_data_pkl(pt_file, pickle.dumps({"x": _dag_list(60)}, protocol=2))
    msg = _one_line_error("inspect", str(pt_file))
    assert str(pt_file) in msg and tunables.MAX_PICKLE_OBJECTS_ENV in msg


def test_dag_in_dcp_metadata_fields_is_harmless(dcp_ckpt: Path, tmp_path: Path) -> None:
    # planner_data and storage_meta are shown to the user: a DAG there is dropped, not expanded
    def edit(md: Any) -> None:
        md.planner_data["model.layer.weight"] = (_dag_list(60),)
        md.storage_meta.save_id = _dag_list(60)

    _edit_metadata(dcp_ckpt, edit)
    code, text, rss, _ = _ckpt("inspect", str(dcp_ckpt), "--json")
    assert code == 0, text
    assert rss < MAX_RSS_BYTES


def _replace_object_item(ckpt: Path, fqn: str, value: Any) -> None:
    """Append ``torch.save(value)`` to rank 0's file and point ``fqn``'s storage entry at it."""
    buf = io.BytesIO()
    torch.save(value, buf)
    blob = buf.getvalue()
    data_file = ckpt / "__0_0.distcp"
    offset = data_file.stat().st_size
    with open(data_file, "ab") as f:
        f.write(blob)

    def edit(md: Any) -> None:
        for index, info in md.storage_data.items():
            if index.fqn == fqn:
                info.offset, info.length = offset, len(blob)

    _edit_metadata(ckpt, edit)


def test_dag_in_dcp_object_item_is_refused(dcp_ckpt: Path, tmp_path: Path) -> None:
    _replace_object_item(dcp_ckpt, "extra.step", _dag_list(60))
    before = _digest(dcp_ckpt)
    code, text, rss, seconds = _ckpt("inspect", str(dcp_ckpt), "--values", "--json")
    assert code == 0, text
    assert rss < MAX_RSS_BYTES and seconds < TIMEOUT_S
    (entry,) = (o for o in json.loads(text)["objects"] if o["fqn"] == "extra.step")
    value = entry["value"]
    assert "__0_0.distcp" in value["error"] and tunables.MAX_PICKLE_OBJECTS_ENV in value["error"]
    assert _digest(dcp_ckpt) == before


def test_huge_bytearray_is_refused(pt_file: Path, tmp_path: Path) -> None:
    _replace_data_pkl(pt_file, _bytearray_pickle(3 << 30))
    for msg in _all_verbs(pt_file, tmp_path, dcp_only=False):
        assert pt_file.name in msg and "bytearray" in msg and str(3 << 30) in msg


def test_repeated_copies_are_counted(pt_file: Path, tmp_path: Path) -> None:
    # 500k copies of a 100k-element set: 5e10 objects from a 2.6 MB pickle
    _replace_data_pkl(pt_file, _copies_pickle(100_000, 500_000))
    msg = _one_line_error("inspect", str(pt_file))
    assert str(pt_file) in msg and tunables.MAX_PICKLE_OBJECTS_ENV in msg


def test_deep_nesting_in_data_pkl(pt_file: Path, tmp_path: Path) -> None:
    _replace_data_pkl(pt_file, _deep_list_pickle(100_000))
    for msg in _all_verbs(pt_file, tmp_path, dcp_only=False):
        assert pt_file.name in msg and tunables.MAX_PICKLE_DEPTH_ENV in msg


def test_deep_nesting_as_dcp_metadata(dcp_ckpt: Path, tmp_path: Path) -> None:
    (dcp_ckpt / ".metadata").write_bytes(_deep_list_pickle(100_000))
    for msg in _all_verbs(dcp_ckpt, tmp_path):
        assert ".metadata" in msg and "not DCP metadata" in msg


def test_bytearray_in_dcp_metadata_is_not_allowed(dcp_ckpt: Path, tmp_path: Path) -> None:
    (dcp_ckpt / ".metadata").write_bytes(_bytearray_pickle(3 << 30))
    msg = _one_line_error("inspect", str(dcp_ckpt))
    assert ".metadata" in msg and "builtins.bytearray" in msg


# --------------------------------------------------------------------------------------------------
# Inside the C unpickler: memo size, hashing, argument tuples
# --------------------------------------------------------------------------------------------------
#
# Each hostile piece is spliced into a real pickle right after its PROTO opcode, as a statement
# that leaves the stack as it found it, so everything else the file holds is torch's own.


def _splice(pickle_bytes: bytes, piece: bytes) -> bytes:
    assert pickle_bytes[0] == 0x80  # PROTO n
    return pickle_bytes[:2] + piece + pickle_bytes[2:]


def _memo_piece(index: int, text: bool) -> bytes:
    """``None`` stored at memo ``index`` (LONG_BINPUT, or the text PUT), then popped."""
    if text:
        return b"Np%d\n0" % index
    return b"Nr" + index.to_bytes(4, "little") + b"0"


def _shared_tuple(levels: int, first_memo: int) -> bytes:
    """Pushes t = (t, t) nested ``levels`` deep from (), each level a memo GET of the one below
    (memo entries ``first_memo``..): ~8 bytes a level, 2**levels nodes as a tree."""
    out = b")q" + bytes([first_memo])
    for k in range(first_memo, first_memo + levels):
        out += b"0h" + bytes([k]) + b"h" + bytes([k]) + b"\x86q" + bytes([k + 1])
    return out


def _hash_piece(use: str) -> bytes:
    """A 40-level shared tuple hashed as a dict key, a set element, or two equal keys."""
    if use == "dict key":
        return b"}" + _shared_tuple(40, 200) + b"K\x01s0"
    if use == "frozenset element":  # MARK t FROZENSET (protocol 4)
        return b"(" + _shared_tuple(40, 200) + b"\x91" + b"0"
    # two tuples of equal structure built apart (hash equal, so compared as trees)
    first, second = _shared_tuple(30, 100), _shared_tuple(30, 140)
    return b"}(" + first + b"K\x01" + second + b"K\x02u0"


def _args_piece(global_line: bytes, n_args: int, calls: int, arg: bytes = b"N") -> bytes:
    """A memoised tuple of ``n_args`` arguments passed to ``global_line``'s callable ``calls``
    times (REDUCE each, result popped): ``n_args * calls`` copies for a *args callable."""
    out = b"(" + arg * n_args + b"tq\xf0c" + global_line + b"q\xf1"
    return out + b"h\xf1h\xf0R0" * calls


@pytest.mark.parametrize("text", [False, True], ids=["LONG_BINPUT", "PUT"])
def test_huge_memo_index_in_dcp_metadata(dcp_ckpt: Path, tmp_path: Path, text: bool) -> None:
    # 8 bytes that made the unpickler allocate and zero 1.6 GB of memo
    path = dcp_ckpt / ".metadata"
    path.write_bytes(_splice(path.read_bytes(), _memo_piece(100_000_000, text)))
    for msg in _all_verbs(dcp_ckpt, tmp_path):
        assert ".metadata" in msg and "memo index 100000000" in msg, msg


def test_huge_memo_index_in_data_pkl(pt_file: Path, tmp_path: Path) -> None:
    with zipfile.ZipFile(pt_file) as z:
        (name,) = (n for n in z.namelist() if n.endswith("/data.pkl"))
        original = z.read(name)
    _replace_data_pkl(pt_file, _splice(original, _memo_piece(100_000_000, text=False)))
    for msg in _all_verbs(pt_file, tmp_path, dcp_only=False):
        assert pt_file.name in msg and "memo index 100000000" in msg, msg


@pytest.mark.parametrize("use", ["dict key", "frozenset element", "equal keys"])
def test_shared_tuple_hashed_in_dcp_metadata(dcp_ckpt: Path, tmp_path: Path, use: str) -> None:
    # < 1 KB that hashed 2**40 nodes (or compared two 2**30-node trees): it never ended
    path = dcp_ckpt / ".metadata"
    path.write_bytes(_splice(path.read_bytes(), _hash_piece(use)))
    assert path.stat().st_size < 1 << 20
    for msg in _all_verbs(dcp_ckpt, tmp_path):
        assert ".metadata" in msg and "refusing to decode" in msg, msg


def test_shared_tuple_key_in_data_pkl(pt_file: Path, tmp_path: Path) -> None:
    with zipfile.ZipFile(pt_file) as z:
        (name,) = (n for n in z.namelist() if n.endswith("/data.pkl"))
        original = z.read(name)
    _replace_data_pkl(pt_file, _splice(original, _hash_piece("dict key")))
    for msg in _all_verbs(pt_file, tmp_path, dcp_only=False):
        assert pt_file.name in msg and tunables.MAX_PICKLE_OBJECTS_ENV in msg, msg


def test_deep_key_in_data_pkl(pt_file: Path, tmp_path: Path) -> None:
    # a key nested 900,000 tuples deep: hashing it recursed past the C stack (a crash)
    with zipfile.ZipFile(pt_file) as z:
        (name,) = (n for n in z.namelist() if n.endswith("/data.pkl"))
        original = z.read(name)
    piece = b"}N" + b"\x85" * 900_000 + b"K\x01s0"
    _replace_data_pkl(pt_file, _splice(original, piece))
    msg = _one_line_error("inspect", str(pt_file))
    assert pt_file.name in msg and "would hash more than 10000 nodes" in msg, msg


def test_big_argument_tuple_to_a_record_class(dcp_ckpt: Path, tmp_path: Path) -> None:
    # 200k arguments passed 100k times (700 KB): 2e10 copies when the class took *args
    path = dcp_ckpt / ".metadata"
    line = b"torch.distributed.checkpoint.metadata\nMetadataIndex\n"
    path.write_bytes(_splice(path.read_bytes(), _args_piece(line, 200_000, 100_000)))
    assert path.stat().st_size < 1 << 20
    for msg in _all_verbs(dcp_ckpt, tmp_path):
        assert ".metadata" in msg and "200001 were given" in msg, msg


def test_big_argument_tuple_to_a_path(dcp_ckpt: Path, tmp_path: Path) -> None:
    # pathlib takes any number of parts: 100k parts (a memoised string each) joined 100k times
    path = dcp_ckpt / ".metadata"
    piece = b"X\x04\x00\x00\x00partq\xef0" + _args_piece(
        b"pathlib\nPosixPath\n", 100_000, 100_000, b"h\xef"
    )
    path.write_bytes(_splice(path.read_bytes(), piece))
    assert path.stat().st_size < 1 << 20
    msg = _one_line_error("inspect", str(dcp_ckpt))
    assert ".metadata" in msg and tunables.MAX_PICKLE_OBJECTS_ENV in msg, msg


def test_big_argument_tuple_in_data_pkl(pt_file: Path, tmp_path: Path) -> None:
    # OrderedDict's builder (on torch.save's weights_only allowlist) took *args and copied them
    with zipfile.ZipFile(pt_file) as z:
        (name,) = (n for n in z.namelist() if n.endswith("/data.pkl"))
        original = z.read(name)
    piece = _args_piece(b"collections\nOrderedDict\n", 200_000, 100_000)
    _replace_data_pkl(pt_file, _splice(original, piece))
    assert pt_file.stat().st_size < 1 << 20
    msg = _one_line_error("inspect", str(pt_file))
    assert pt_file.name in msg and "200000 were given" in msg, msg


# --------------------------------------------------------------------------------------------------
# Item 5: sizes
# --------------------------------------------------------------------------------------------------


def test_huge_world_size_is_refused_at_once(dcp_ckpt: Path, tmp_path: Path) -> None:
    t0 = time.monotonic()
    msg = _one_line_error(
        "reshard", str(dcp_ckpt), str(tmp_path / "re"), "--world-size", "1000000000", exit_code=2
    )
    assert time.monotonic() - t0 < 10
    assert "1000000000" in msg and tunables.MAX_WORLD_SIZE_ENV in msg
    assert not (tmp_path / "re").exists()


@pytest.mark.parametrize("field", ["sizes", "offsets", "shape"])
def test_negative_sizes_in_metadata(dcp_ckpt: Path, tmp_path: Path, field: str) -> None:
    def edit(md: Any) -> None:
        item = md.state_dict_metadata["model.layer.weight"]
        if field == "shape":
            item.size = torch.Size([-8, 4])
        else:
            setattr(item.chunks[0], field, torch.Size([-1, 4]))

    _edit_metadata(dcp_ckpt, edit)
    for msg in _all_verbs(dcp_ckpt, tmp_path):
        assert ".metadata" in msg and "model.layer.weight" in msg, msg


def test_shape_beyond_int64_in_metadata(dcp_ckpt: Path, tmp_path: Path) -> None:
    def edit(md: Any) -> None:
        md.state_dict_metadata["model.layer.weight"].size = torch.Size([2**40, 2**40])

    _edit_metadata(dcp_ckpt, edit)
    msg = _one_line_error("inspect", str(dcp_ckpt))
    assert "model.layer.weight" in msg and "more elements" in msg


# --------------------------------------------------------------------------------------------------
# Legitimate inputs stay within the budgets
# --------------------------------------------------------------------------------------------------


def test_big_legitimate_metadata_still_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.support.producers import big_many_tensors_metadata

    path = big_many_tensors_metadata(tmp_path / "big", 1000, 64, sized_files=True)
    # the floor at its smallest: the per-byte budget alone must admit a real 7.7 MiB metadata
    monkeypatch.setenv(tunables.MAX_PICKLE_OBJECTS_ENV, "1")
    manifest = read_dcp(str(path))
    assert sum(len(t.chunks) for t in manifest.tensors.values()) > 50_000
    data = (Path(path) / ".metadata").read_bytes()
    # walked as a tree too, it fits the per-byte budget
    safe_pickle.restricted_loads(data, safe_pickle.METADATA_GLOBALS, source="m", walk=True)


def test_state_dict_with_shared_tensors_loads(tmp_path: Path) -> None:
    # tied weights and a shared sub-dict are legitimate sharing, well within budget
    t = _tensors()
    sub = {"w": t["layer.weight"]}
    path = tmp_path / "tied.pt"
    torch.save({"a": sub, "b": sub, "tied": t["layer.weight"]}, path)
    code, text, rss, _ = _ckpt("inspect", str(path))
    assert code == 0, text
    assert rss < MAX_RSS_BYTES
    assert "a.w" in text and "b.w" in text and "tied" in text


def test_budget_tunables_raise_the_limits(pt_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.save({**_tensors(), "extra": _dag_dict(12)}, pt_file)  # 4k leaves
    monkeypatch.setenv(tunables.MAX_PICKLE_OBJECTS_ENV, "1000")
    from ckptools.producers.hf.torch_save import read_torch_save

    with pytest.raises(DecodingLimitError, match=tunables.MAX_PICKLE_OBJECTS_ENV):
        read_torch_save(str(pt_file))
    monkeypatch.setenv(tunables.MAX_PICKLE_OBJECTS_ENV, "100000")
    assert len(read_torch_save(str(pt_file)).objects) == 2**12


def test_world_size_tunable(
    dcp_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ckptools
    from ckptools.errors import UsageError

    monkeypatch.setenv(tunables.MAX_WORLD_SIZE_ENV, "2")
    with pytest.raises(UsageError, match=tunables.MAX_WORLD_SIZE_ENV):
        ckptools.reshard(str(dcp_ckpt), str(tmp_path / "o"), world_size=3, dry_run=True)
    ckptools.reshard(str(dcp_ckpt), str(tmp_path / "o"), world_size=2, dry_run=True)


def test_expanded_view_declaring_64_gib_over_4_bytes_is_refused(tmp_path: Path) -> None:
    # issue 25, item 21: torch.save keeps an expanded view as it is, stride 0 over 4 bytes of
    # storage; writing it out would first allocate the 64 GiB it declares.
    path = tmp_path / "model.pt"
    torch.save({"w": torch.zeros(1).expand(2**34), "b": torch.ones(3)}, path)
    assert path.stat().st_size < 4096
    msgs = _all_verbs(path, tmp_path, dcp_only=False)
    msgs.append(_one_line_error("shard", str(path), str(tmp_path / "sh"), "--world-size", "2"))
    assert not (tmp_path / "sh").exists()
    for msg in msgs:
        assert str(path) in msg and "'w'" in msg and "64.0 GiB" in msg and "over 4 bytes" in msg
        assert "t.contiguous()" in msg


def test_small_expanded_view_is_written_out_whole(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    import ckptools

    path = tmp_path / "model.pt"
    state = {"w": torch.arange(3.0).expand(4, 3), "position_ids": torch.arange(5).expand(1, 5)}
    torch.save(state, path)
    ckptools.consolidate(str(path), str(tmp_path / "hf"), quiet=True, weights_only=True)
    out = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(out) == set(state)
    for k, v in state.items():
        assert torch.equal(out[k], v.contiguous()), k


def test_dcp_item_holding_an_expanded_view_is_refused(
    dcp_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the same view as a DCP item: the metadata declares 2**34 elements of 'model.layer.bias'
    # (one chunk, tiling it) and the item torch.save's them over 4 bytes. The 64 GiB it declares
    # would otherwise meet the free-space check first on a disk with less free (this machine's
    # free space decided which refusal came: the item's is the one under test)
    monkeypatch.setenv("CKPTOOLS_SPACE_CHECK", "0")
    buf = io.BytesIO()
    torch.save(torch.zeros(1).expand(2**34), buf)
    data_file = dcp_ckpt / "__0_0.distcp"
    offset = data_file.stat().st_size
    with open(data_file, "ab") as f:
        f.write(buf.getvalue())

    def edit(md: Any) -> None:
        md.state_dict_metadata["model.layer.bias"].size = torch.Size([2**34])
        [chunk] = md.state_dict_metadata["model.layer.bias"].chunks
        chunk.sizes = torch.Size([2**34])
        for index, info in md.storage_data.items():
            if index.fqn == "model.layer.bias":
                info.offset, info.length = offset, len(buf.getvalue())

    _edit_metadata(dcp_ckpt, edit)
    before = _digest(dcp_ckpt)
    for args in (
        ("consolidate", str(dcp_ckpt), str(tmp_path / "hf"), "--weights-only"),
        ("reshard", str(dcp_ckpt), str(tmp_path / "re"), "--world-size", "2"),
    ):
        msg = _one_line_error(*args)
        assert "__0_0.distcp" in msg and "'model.layer.bias'" in msg and "64.0 GiB" in msg, msg
    assert _digest(dcp_ckpt) == before
    assert not (tmp_path / "hf").exists() and not (tmp_path / "re").exists()
