"""zstd DCP: items written by torch's own ``FileSystemWriter(path, _extensions=[ZStandard()])``
are decoded (``ckptools.producers.compressed.zstd``, once per item, bounded, in memory or a private
spool) and read by every verb as usual: consolidate writes what the plain save gives, bit for
bit; reshard writes plain items that ``dcp.load`` reads at another world size; verify checks the
decoded archives' CRCs and finds a damaged compressed item; diff finds nothing against the plain
save; inspect shows the encoding. A frame that inflates past what its item can hold is refused in
bounded memory; without ``zstandard`` every verb says what to install, before any output exists.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import IO, Any, cast

import pytest
import torch
from click.testing import CliRunner

from ckptools.cli.main import cli
from tests.support.reference import assert_checkpoint_matches, load_reference

REPO = Path(__file__).resolve().parents[2]


def _ok(args: list[str]) -> str:
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, (args, result.output, result.exception)
    return result.output


def _transforms(root: Path) -> set[tuple[str, ...]]:
    import ckptools

    m = ckptools.read_manifest(str(root))
    return {c.transforms for t in m.tensors.values() for c in t.chunks} | {
        o.transforms for o in m.objects.values() if o.file is not None
    }


def test_single_process_save_of_every_dtype_reads_as_the_plain_save(
    produced: Any, tmp_path: Path
) -> None:
    """Every dtype, 0-dim, zero-size and non-contiguous tensors and non-tensor entries."""
    zstd, plain = produced("single", zstd=True), produced("single")
    assert _transforms(zstd.path) == {("stream.zstd/1",)}
    shown = _ok(["inspect", str(zstd.path)])
    assert "stored with the DCP transform stream.zstd/1 (decoded when read)" in shown
    _ok(["consolidate", str(zstd.path), str(tmp_path / "z"), "--weights-only"])
    _ok(["consolidate", str(plain.path), str(tmp_path / "p"), "--weights-only"])
    z, p = sorted((tmp_path / "z").iterdir()), sorted((tmp_path / "p").iterdir())
    assert [f.name for f in z] == [f.name for f in p]
    for a, b in zip(z, p, strict=True):
        if a.suffix == ".safetensors":
            assert a.read_bytes() == b.read_bytes(), a.name
    assert "identical" in _ok(["diff", str(zstd.path), str(plain.path)])
    assert "OK: no problems found" in _ok(["verify", str(zstd.path)])
    assert "OK: no problems found" in _ok(["verify", str(zstd.path), "--quick"])
    out = tmp_path / "resharded"
    _ok(["reshard", str(zstd.path), str(out), "--world-size", "3"])
    assert _transforms(out) == {()}  # plain items
    assert_checkpoint_matches(out, load_reference(zstd.ref_path))


@pytest.mark.distributed
def test_fsdp2_save_through_zstd_consolidates_and_reshards_bit_exactly(
    produced: Any, tmp_path: Path
) -> None:
    zstd = produced("fsdp2", world_size=2, zstd=True, optimizer=False)
    assert _transforms(zstd.path) == {("stream.zstd/1",)}
    ref = load_reference(zstd.ref_path)
    _ok(["consolidate", str(zstd.path), str(tmp_path / "hf"), "--weights-only"])
    from safetensors.torch import load_file

    written: dict[str, torch.Tensor] = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        written.update(load_file(str(f)))
    model = ref["model"]
    assert set(written) == {f"model.{k}" for k in model} or set(written) == set(model)
    for k, v in model.items():
        got = written.get(k, written.get(f"model.{k}"))
        assert got is not None and got.dtype == v.dtype and torch.equal(got, v), k
    out = tmp_path / "ws3"
    _ok(["reshard", str(zstd.path), str(out), "--world-size", "3"])
    assert_checkpoint_matches(out, ref)
    assert "OK: no problems found" in _ok(["verify", str(zstd.path)])


def _zstd_save(path: Path, state: dict[str, Any], extension: Any = None) -> Path:
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard

    writer = FileSystemWriter(str(path), _extensions=[extension or ZStandard()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=writer, no_dist=True)
    return path


def test_a_damaged_compressed_item_is_found_by_verify_in_one_line(tmp_path: Path) -> None:
    torch.manual_seed(0)
    src = _zstd_save(tmp_path / "z", {"model.w": torch.randn(256, 64)})
    data = bytearray((src / "__0_0.distcp").read_bytes())
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
    (src / "__0_0.distcp").write_bytes(bytes(data))
    result = CliRunner().invoke(cli, ["verify", str(src)])
    assert result.exit_code == 3, result.output  # problems found
    lines = [ln for ln in result.output.splitlines() if ln.strip().startswith("[")]
    assert len(lines) == 1, result.output
    assert "__0_0.distcp[decoded item at byte 0]: CRC-32 mismatch" in lines[0]
    assert "'model.w'" in lines[0]
    out = tmp_path / "out"
    refused = CliRunner().invoke(cli, ["consolidate", str(src), str(out), "--weights-only"])
    assert refused.exit_code == 1 and len(refused.output.strip().splitlines()) == 1
    assert "'model.w'" in refused.output and not out.exists()


class _Bomb:
    """torch's ZStandard extension (descriptor ``stream.zstd/1``) that, after the item's own
    archive, compresses ``extra`` zero bytes into the same frame: a small item that inflates
    to ``extra`` more bytes than its tensor can hold."""

    def __init__(self, extra: int) -> None:
        from torch.distributed.checkpoint._extension import ZStandard

        self.inner = ZStandard()
        self.extra = extra

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        writer = self.inner.transform_to(output)
        extra = self.extra

        class Writer(io.RawIOBase):
            def writable(self) -> bool:
                return True

            def write(self, b: Any) -> int:
                return int(writer.write(b))

            def flush(self) -> None:
                if not writer.closed:
                    writer.flush()

            def close(self) -> None:
                if not self.closed:
                    zeros = bytes(16 * 2**20)
                    for _ in range(extra // len(zeros)):
                        writer.write(zeros)
                    writer.close()
                super().close()

        return cast(IO[bytes], Writer())


def test_a_zstd_bomb_is_refused_in_bounded_memory(tmp_path: Path) -> None:
    src = _zstd_save(tmp_path / "bomb", {"model.w": torch.ones(4)}, _Bomb(2**30))
    assert (src / "__0_0.distcp").stat().st_size < 2**20  # 1 GiB of zeros in a small frame
    out = tmp_path / "out"
    code = (  # VmHWM: this process's peak (ru_maxrss keeps the forking parent's across exec)
        "import re, sys\n"
        "from ckptools.cli.main import main\n"
        "try:\n    main(sys.argv[1:])\n"
        "except SystemExit as e:\n"
        "    hwm = re.search(r'VmHWM:\\s*(\\d+)', open('/proc/self/status').read()).group(1)\n"
        "    print('rc', e.code, 'peak_kib', hwm)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, "consolidate", str(src), str(out), "--weights-only"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    rc_line = run.stdout.strip().splitlines()[-1].split()
    assert rc_line[:2] == ["rc", "1"], (run.stdout, run.stderr)
    assert int(rc_line[3]) < 100 * 1024, rc_line  # KiB: far below the 1 GiB the frame holds
    (line,) = run.stderr.strip().splitlines()
    assert line.startswith(f"error: {src}/__0_0.distcp: bytes ")
    assert line.endswith(
        "of tensor 'model.w' decode to more than 65552 bytes, more than the item can hold "
        "(stored with stream.zstd/1); the item is damaged or hostile, and decoding stopped there"
    )
    assert not out.exists()


def test_without_zstandard_every_verb_says_what_to_install(tmp_path: Path) -> None:
    torch.manual_seed(0)
    src = _zstd_save(tmp_path / "z", {"model.w": torch.randn(4, 4), "step": 3})
    out = tmp_path / "out"
    code = (
        "import sys\nsys.modules['zstandard'] = None  # as if not installed\n"
        "from ckptools.cli.main import main\nmain(sys.argv[1:])\n"
    )
    want = (
        f"error: {src}/__0_0.distcp: tensor 'model.w' is stored with the DCP transform "
        "'stream.zstd/1': pip install 'ckptools[zstd]'"
    )
    for args in (
        ["consolidate", str(src), str(out), "--weights-only"],
        ["reshard", str(src), str(out), "--world-size", "2"],
        ["verify", str(src)],
        ["verify", str(src), "--quick"],
        ["diff", str(src), str(src)],
    ):
        run = subprocess.run(
            [sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=REPO,
            timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        assert run.returncode == 1, (args, run.stdout, run.stderr)
        assert run.stderr.strip() == want, args
        assert not out.exists()
    run = subprocess.run(
        [sys.executable, "-c", code, "inspect", str(src), "--json"], capture_output=True,
        text=True, cwd=REPO, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    (enc,) = json.loads(run.stdout)["encodings"]
    assert enc["decoded"] is False and enc["missing"] == "pip install 'ckptools[zstd]'"


def test_items_are_decoded_in_memory_and_only_larger_ones_into_the_spool(
    produced: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An item of at most ``CKPTOOLS_DECODED_ITEM_MEMORY`` bytes is decoded into memory and
    written from there (no spool file: the spool doubled the bytes the disk took); a larger
    one goes to the spool; both write what the plain save gives, bit for bit."""
    from ckptools.io import spool

    zstd, plain = produced("single", zstd=True), produced("single")
    spools: list[str] = []
    made = spool.make_spool_dir

    def counted(prefix: str = "ckptools-spool-") -> str:
        spools.append(prefix)
        return made(prefix)

    monkeypatch.setattr(spool, "make_spool_dir", counted)
    _ok(["consolidate", str(plain.path), str(tmp_path / "p"), "--weights-only"])
    _ok(["consolidate", str(zstd.path), str(tmp_path / "m"), "--weights-only"])
    assert spools == []  # every item decoded in memory
    monkeypatch.setenv("CKPTOOLS_DECODED_ITEM_MEMORY", "1KB")
    _ok(["consolidate", str(zstd.path), str(tmp_path / "s"), "--weights-only"])
    assert spools == ["ckptools-decoded-"]  # the items past 1 KB went to the spool
    for name in ("m", "s"):
        for f in (tmp_path / "p").glob("*.safetensors"):
            assert (tmp_path / name / f.name).read_bytes() == f.read_bytes(), (name, f.name)


def test_items_let_go_past_the_memory_bound_are_decoded_again_when_read(
    produced: Any,
) -> None:
    """The items held in memory take at most ``DecodedFiles.memory`` bytes: decoding one more
    lets the least recently used go (its memory freed), and reading that one again decodes it
    again, to the same bytes."""
    import ckptools
    from ckptools.engine.reader import resolve_chunk
    from ckptools.io.storage import open_reader

    zstd, plain = produced("single", zstd=True), produced("single")
    m, p = ckptools.read_manifest(str(zstd.path)), ckptools.read_manifest(str(plain.path))
    big = sorted(
        (t for t in m.tensors.values() if t.chunks and t.chunks[0].numel > 1),
        key=lambda t: t.fqn,
    )[:3]
    assert len(big) == 3
    with open_reader(str(zstd.path)) as reader, open_reader(str(plain.path)) as ref:
        reader.decoded.memory = 1  # one item held at a time
        raws = [resolve_chunk(reader, t, t.chunks[0]) for t in big]
        assert all(reader.decoded.in_memory(r.file) for r in raws)
        decoded = reader.decoded._held  # what is held now
        assert list(decoded) == [raws[-1].file]
        for t, raw in zip(big, raws, strict=True):  # the first two are decoded again
            want = resolve_chunk(ref, p.tensors[t.fqn], p.tensors[t.fqn].chunks[0])
            assert reader.read(raw.file, raw.offset, raw.length) == ref.read(
                want.file, want.offset, want.length
            ), t.fqn
            assert reader.crc32(raw.file, raw.offset, raw.length) == raw.crc32
            assert list(decoded) == [raw.file]
