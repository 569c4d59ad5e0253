"""Training hooks with an s3:// root (moto on loopback + s3fs), in one process.

Truth: the live model and optimizer state that was saved, compared bit for bit after a restore
into fresh objects; the objects on the server, listed with s3fs itself. A writer that loses data
(the unflushed-stream failure of remote DCP writers) must never produce a committed checkpoint.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import ckptools
from ckptools import _compat
from ckptools.cli.main import cli
from ckptools.errors import CkptError, IncompleteCheckpointError
from ckptools.training import manager as manager_module
from ckptools.training import store
from tests.support.s3 import objects


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(8, 16)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def test_manager_on_s3_saves_restores_and_prunes(s3_bucket: str) -> None:
    root = f"{s3_bucket}/run"
    model, opt = _model()
    with ckptools.CheckpointManager(root, keep_last=2) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, model, opt, extra={"step": step}, metrics={"loss": 1.0 / step})
        assert mgr.steps() == [20, 30]
        assert mgr.latest() == f"{root}/step-30"
        held = objects(root)
        assert not any(k.startswith("step-10/") for k in held)
        for step in (20, 30):
            assert f"step-{step}/.ckptools-complete" in held
            assert f"step-{step}/.metadata" in held
            assert f"step-{step}/.ckptools-checksums.json" in held
        assert not any(k.endswith(".ckptools-writing") for k in held)
        fresh, fresh_opt = _fresh()
        restored = mgr.restore(fresh, fresh_opt)
    assert restored is not None and restored[0] == 30 and restored[1] == {"step": 30}
    _assert_same(model.state_dict(), fresh.state_dict())
    _assert_same(opt.state_dict(), fresh_opt.state_dict())
    assert ckptools.verify(f"{root}/step-30").ok

    runner = CliRunner()
    listed = runner.invoke(cli, ["list", root, "--json"])
    assert listed.exit_code == 0, listed.output
    rows = json.loads(listed.output)
    rows = rows["checkpoints"] if isinstance(rows, dict) else rows
    assert [(r["step"], r["complete"]) for r in rows] == [(20, True), (30, True)]
    pruned = runner.invoke(cli, ["prune", root, "--keep-last", "1", "--json"])
    assert pruned.exit_code == 0, pruned.output
    assert [c.step for c in store.list_checkpoints(root)] == [30]
    assert not any(k.startswith("step-20/") for k in objects(root))


def test_save_and_load_on_s3(s3_bucket: str) -> None:
    model, opt = _model()
    path = f"{s3_bucket}/plain"
    ckptools.save(path, model, opt, extra={"epoch": 2})
    assert {".metadata", "__0_0.distcp"} <= set(objects(path))
    fresh, fresh_opt = _fresh()
    extra = ckptools.load(path, fresh, fresh_opt)
    assert extra == {"epoch": 2}
    _assert_same(model.state_dict(), fresh.state_dict())
    _assert_same(opt.state_dict(), fresh_opt.state_dict())


def test_save_and_load_take_storage_options(
    s3_bucket: str, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # only the options name the server: a save that dropped them would go nowhere (once
    # fsspec's cached client, made when the endpoint was still in the environment, is gone)
    import s3fs

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    s3fs.S3FileSystem.clear_instance_cache()
    options = {"endpoint_url": s3_endpoint}
    model, opt = _model()
    path = f"{s3_bucket}/with-options"
    ckptools.save(path, model, opt, extra={"epoch": 3}, storage_options=options)
    fresh, fresh_opt = _fresh()
    assert ckptools.load(path, fresh, fresh_opt, storage_options=options) == {"epoch": 3}
    _assert_same(model.state_dict(), fresh.state_dict())
    monkeypatch.undo()
    assert {".metadata", "__0_0.distcp"} <= set(objects(path))


class _LossyStream(io.RawIOBase):
    """What an unflushed remote stream does: reports every byte written, uploads only the first
    ``keep``. torch's bookkeeping (``tell``) sees the full length, the object is short."""

    def __init__(self, raw: Any, keep: int) -> None:
        self.raw = raw
        self.keep = keep
        self.pos = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = memoryview(b).cast("B")
        room = max(0, self.keep - self.pos)
        if room:
            self.raw.write(data[:room])
        self.pos += len(data)
        return len(data)

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass

    def fileno(self) -> int:
        raise io.UnsupportedOperation("fileno")

    def close(self) -> None:
        self.raw.close()
        super().close()


def _lossy_writer(path: str) -> Any:
    writer = _compat.fsspec_writer(path)
    original = writer.fs.create_stream

    @contextlib.contextmanager
    def create_stream(target: Any, mode: str) -> Iterator[Any]:
        with original(target, mode) as stream:
            lossy = "w" in mode and str(target).endswith(".distcp")
            yield _LossyStream(stream, keep=1000) if lossy else stream

    writer.fs.create_stream = create_stream
    return writer


def test_a_writer_that_loses_data_is_never_committed(
    s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = f"{s3_bucket}/run"
    model, opt = _model()
    mgr = ckptools.CheckpointManager(root, keep_last=3, checksums=False)
    mgr.save(1, model, opt)
    monkeypatch.setattr(manager_module, "storage_writer", _lossy_writer)
    with pytest.raises(CkptError, match="not all there"):
        mgr.save(2, model, opt)
    monkeypatch.undo()
    # the output protocol discards a failed save's staging location at once: no marker, and
    # nothing of step-2 left behind (a save killed outright is removed by the next manager)
    assert not any(k.startswith("step-2/") for k in objects(root))
    assert mgr.steps() == [1] and mgr.latest() == f"{root}/step-1"
    assert 2 not in {c.step for c in store.list_checkpoints(root)}
    mgr.close()
    assert any(k.startswith("step-1/") for k in objects(root))

    # ckptools.save checks the same thing on every rank
    monkeypatch.setattr("ckptools.training.state.storage_writer", _lossy_writer)
    with pytest.raises(IncompleteCheckpointError, match="not all there"):
        ckptools.save(f"{s3_bucket}/plain", model, opt)


def test_save_pretrained_to_s3_equals_consolidate(s3_bucket: str, tmp_path: Any) -> None:
    model, opt = _model()
    ckptools.save(str(tmp_path / "dcp"), model, opt)
    local = tmp_path / "hf"
    ckptools.consolidate(
        str(tmp_path / "dcp"), str(local), max_shard_size=2000, quiet=True, weights_only=True
    )
    out = f"{s3_bucket}/hf"
    result = ckptools.save_pretrained(model, out, max_shard_size=2000)
    names = sorted(p.name for p in local.iterdir())
    assert sorted(objects(out)) == names and len(result.files) > 1
    from tests.support.s3 import download

    got = tmp_path / "got"
    download(out, str(got))
    for name in names:
        assert (got / name).read_bytes() == (local / name).read_bytes(), name


def test_save_pretrained_to_s3_leaves_no_spool(
    s3_bucket: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The ranks of save_pretrained share a local spool for an object-store OUT; the output
    # protocol removes it, and its owner note, after the upload and after a failure alike.
    from ckptools.training import pretrained

    spool = tmp_path / "spool"
    monkeypatch.setenv("CKPTOOLS_SPOOL_DIR", str(spool))
    model, _ = _model()
    result = ckptools.save_pretrained(model, f"{s3_bucket}/hf-spool", max_shard_size=2000)
    assert len(result.files) > 1 and "model.safetensors.index.json" in objects(result.out)
    assert sorted(p.name for p in spool.iterdir()) == []

    def broken(*args: Any, **kwargs: Any) -> int:
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(pretrained, "_write_share", broken)
    with pytest.raises(OSError, match="injected"):
        ckptools.save_pretrained(model, f"{s3_bucket}/hf-failed", max_shard_size=2000)
    assert sorted(p.name for p in spool.iterdir()) == []
    assert objects(f"{s3_bucket}/hf-failed") == {}


def test_manager_storage_options_reach_background_saves(
    s3_bucket: str, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptools.io import storage

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # only the options name it
    root = f"{s3_bucket}/opts"
    model, opt = _model()
    mgr = ckptools.CheckpointManager(
        root, async_save=True, storage_options={"endpoint_url": s3_endpoint}
    )
    mgr.save(1, model, opt)  # committed on the background thread
    mgr.wait()
    assert mgr.steps() == [1]
    mgr.close()
    assert storage.options_for("s3") == {}
    monkeypatch.undo()
    assert "step-1/.ckptools-complete" in objects(root)
