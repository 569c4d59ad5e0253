"""Chunk encodings as data: a DCP item written through a storage extension (torch's own
``FileSystemWriter(path, _extensions=[ZStandard()])``) carries its transforms on its chunk from
the read on (:mod:`ckptools.formats.stream_transforms`). zstd items are decoded (the
``compressed`` family's decoder, bounded, once per item) and read by every verb as usual
(test_zstd_dcp.py); every verb refuses a transform ckptools does not decode in the same one line,
naming the file, the tensor and the transform, before any output exists; ``inspect`` shows the
encoding. A plain DCP is unaffected.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import IO, Any, cast

import pytest
import torch
from click.testing import CliRunner
from torch.distributed.checkpoint._extension import StreamTransformExtension

import ckptools
from ckptools.cli.main import cli
from ckptools.errors import UnsupportedCheckpointError
from ckptools.formats import stream_transforms


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4)
    state: dict[str, Any] = {f"model.{k}": v for k, v in model.state_dict().items()}
    state["step"] = 7
    return state


class _Xor(StreamTransformExtension):
    """A stream transform of torch's extension API that ckptools does not know (``test.xor/1``):
    each byte XORed with 0x5A."""

    @staticmethod
    def registry_name() -> str:
        return "test.xor"

    @staticmethod
    def from_descriptor(version: str) -> _Xor:
        return _Xor()

    def get_descriptor(self) -> str:
        return "test.xor/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        class Writer(io.RawIOBase):
            def writable(self) -> bool:
                return True

            def write(self, b: Any) -> int:
                data = bytes(memoryview(b).cast("B"))
                output.write(bytes(x ^ 0x5A for x in data))
                return len(data)

            def flush(self) -> None:
                output.flush()

        return cast(IO[bytes], Writer())

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return io.BytesIO(bytes(x ^ 0x5A for x in input.read()))


def _save(path: Path, *, zstd: bool) -> Path:
    """``zstd``: through a transform ckptools does not decode (named ``zstd`` in the tests that
    were written before the zstd decoder; ``test.xor/1`` since)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    extensions = [_Xor()] if zstd else None
    writer = FileSystemWriter(str(path), _extensions=extensions)
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(_state(), storage_writer=writer, no_dist=True)
    return path


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(zstd DCP, plain DCP) of the same state, written by torch's own writer."""
    root = tmp_path_factory.mktemp("encodings")
    return _save(root / "zstd", zstd=True), _save(root / "plain", zstd=False)


def _digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _refusal(zstd: Path) -> str:
    return (
        f"error: {zstd}/__0_0.distcp: tensor 'model.weight' is stored with the DCP transform "
        "'test.xor/1', which ckptools does not decode yet"
    )


@pytest.mark.parametrize(
    "verb",
    [
        "consolidate",
        "consolidate --dry-run",
        "reshard",
        "verify",
        "verify --quick",
        "diff",
        "diff-reversed",
    ],
)
def test_every_verb_refuses_the_transform_in_one_line_writing_nothing(
    saves: tuple[Path, Path], tmp_path: Path, verb: str
) -> None:
    zstd, plain = saves
    out = tmp_path / "out"
    args = {
        "consolidate": ["consolidate", str(zstd), str(out)],
        "consolidate --dry-run": ["consolidate", str(zstd), str(out), "--dry-run"],
        "reshard": ["reshard", str(zstd), str(out), "--world-size", "2"],
        "verify": ["verify", str(zstd)],
        "verify --quick": ["verify", str(zstd), "--quick"],
        "diff": ["diff", str(zstd), str(plain)],
        "diff-reversed": ["diff", str(plain), str(zstd)],
    }[verb]
    before = _digest(zstd)
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1, (result.output, result.exception)
    # the same line from every verb, not "not a torch.save archive or is cut short"
    assert result.output.strip() == _refusal(zstd)
    assert list(tmp_path.iterdir()) == []  # no OUT, no OUT.tmp-*
    assert _digest(zstd) == before


def test_library_reads_refuse_the_same_way(saves: tuple[Path, Path]) -> None:
    """Reading bytes outside the verbs (read_tensor, read_object) meets the same decision."""
    zstd, _ = saves
    manifest = ckptools.read_manifest(str(zstd))
    assert {c.transforms for t in manifest.tensors.values() for c in t.chunks} == {("test.xor/1",)}
    assert manifest.objects["step"].transforms == ("test.xor/1",)
    with pytest.raises(UnsupportedCheckpointError) as e:
        ckptools.read_tensor(manifest, "model.bias")
    assert str(e.value) == _refusal(zstd).removeprefix("error: ").replace("weight", "bias")
    with pytest.raises(UnsupportedCheckpointError, match=r"object 'step' is stored with the DCP "
                       r"transform 'test.xor/1'"):  # fmt: skip
        ckptools.read_object(manifest, "step")


def test_inspect_shows_the_encoding(saves: tuple[Path, Path]) -> None:
    zstd, _ = saves
    text = CliRunner().invoke(cli, ["inspect", str(zstd)])
    assert text.exit_code == 0, text.output
    assert (
        "  encoding: 3 item(s) stored with the DCP transform test.xor/1 "
        "(ckptools does not decode it yet)"
    ) in text.output.splitlines()
    assert "model.weight" in text.output
    as_json = CliRunner().invoke(cli, ["inspect", str(zstd), "--json", "--values"])
    assert as_json.exit_code == 0, as_json.output
    report = json.loads(as_json.output)
    assert report["encodings"] == [
        {
            "transforms": ["test.xor/1"],
            "items": 3,
            "decoded": False,
            "missing": "ckptools does not decode it yet",
        }
    ]
    (step,) = report["objects"]
    assert "is stored with the DCP transform 'test.xor/1'" in step["value"]["error"]


def test_a_plain_dcp_is_unaffected(saves: tuple[Path, Path], tmp_path: Path) -> None:
    _, plain = saves
    manifest = ckptools.read_manifest(str(plain))
    assert all(not c.transforms for t in manifest.tensors.values() for c in t.chunks)
    state = _state()
    assert torch.equal(ckptools.read_tensor(manifest, "model.weight"), state["model.weight"])
    runner = CliRunner()
    for args in (
        ["inspect", str(plain)],
        ["verify", str(plain)],
        ["diff", str(plain), str(plain)],
        ["consolidate", str(plain), str(tmp_path / "hf"), "--weights-only"],
        ["reshard", str(plain), str(tmp_path / "dcp2"), "--world-size", "2"],
    ):
        result = runner.invoke(cli, args)
        assert result.exit_code == 0, (args, result.output)
        assert "  encoding:" not in result.output
    from safetensors.torch import load_file

    out = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert torch.equal(out["model.weight"], state["model.weight"])
    report = json.loads(runner.invoke(cli, ["inspect", str(plain), "--json"]).output)
    assert report["encodings"] == []


def test_a_decoder_plugs_in_at_one_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """A transform with an entry in DECODERS resolves to a decoder applying the steps in
    torch's order (the outermost, recorded first, undone first); an unknown version refuses."""
    seen: list[str] = []

    def make(tag: str) -> Any:
        def version(v: str) -> stream_transforms.Decoder | None:
            if v != "1":
                return None

            def step(stream: IO[bytes]) -> IO[bytes]:
                seen.append(tag)
                return io.BytesIO(stream.read() + tag.encode())

            return step

        return version

    monkeypatch.setitem(stream_transforms.DECODERS, "a", make("a"))
    monkeypatch.setitem(stream_transforms.DECODERS, "b", make("b"))
    decode = stream_transforms.decoder(("b/1", "a/1"), path="f", entry="tensor 'w'")
    assert decode is not None
    assert decode(io.BytesIO(b"x")).read() == b"xba" and seen == ["b", "a"]
    assert stream_transforms.decoder((), path="f", entry="tensor 'w'") is None
    assert stream_transforms.decodes(("a/1",)) and not stream_transforms.decodes(("a/2",))
    with pytest.raises(UnsupportedCheckpointError, match=r"^f: tensor 'w' is stored with the "
                       r"DCP transform 'a/2', which ckptools does not decode yet$"):  # fmt: skip
        stream_transforms.decoder(("b/1", "a/2"), path="f", entry="tensor 'w'")


def _save_rank_local_zstd(rank: int, world_size: int, out: str) -> None:
    """Every rank saves its own copy of the same replicated state, through zstd, without global
    metadata: ``__<rank>.metadata`` each (dcp.save ``use_collectives=False``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard

    writer = FileSystemWriter(out, _extensions=[ZStandard()])
    dcp.save(_state(), storage_writer=writer, use_collectives=False)


@pytest.mark.distributed
def test_rank_local_replicas_through_zstd_are_decoded_and_read(tmp_path: Path) -> None:
    """A rank-local save's replicated copies are compared when the manifest is read: copies
    inside a transformed stream are not (that reads archives); ``inspect`` shows the encoding
    instead of calling the item damaged, and the verbs decode the items and read them."""
    from safetensors.torch import load_file

    from tests.support.dist import run_ranks

    src = tmp_path / "rank_local"
    run_ranks(_save_rank_local_zstd, 2, str(src), timeout=120)
    assert sorted(p.name for p in src.iterdir()) == [
        "__0.metadata", "__0_0.distcp", "__1.metadata", "__1_0.distcp",
    ]  # fmt: skip
    shown = CliRunner().invoke(cli, ["inspect", str(src)])
    assert shown.exit_code == 0, shown.output
    assert "stored with the DCP transform stream.zstd/1 (decoded when read)" in shown.output
    out = tmp_path / "out"
    for args in (["consolidate", str(src), str(out), "--weights-only"], ["verify", str(src)]):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, result.output
    written = load_file(str(out / "model.safetensors"))
    state = _state()
    assert all(torch.equal(written[k], state[k]) for k in ("model.weight", "model.bias"))
