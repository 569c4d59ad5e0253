"""The scan passes over batches of DCP metadata records at C speed (issue 27) and still refuses
what the opcode-by-opcode scan refuses: on real FSDP2 ``.metadata`` files, with hostile pieces
placed *after* the batches, where they depend on the memo being counted exactly."""

from __future__ import annotations

import pickletools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckptools.errors import DecodingLimitError
from ckptools.formats import pickle_budget, pickle_patterns, pickle_scan
from ckptools.producers.dcp.layout import read_dcp


def _metadata(produced: Callable[..., Any]) -> bytes:
    # 2 ranks: every sharded tensor's chunk list and the storage index are MARK batches
    ckpt = Path(produced("fsdp2", world_size=2, optimizer=True).path)
    return (ckpt / ".metadata").read_bytes()


def _scan(data: bytes, *, bulk: bool) -> tuple[int, int]:
    return pickle_scan._scan(data, pickle_budget.DecodeBudget("x/.metadata", len(data)), bulk=bulk)


def _memo_count(data: bytes) -> int:
    """The unpickler's memo count at STOP, from the standard library's own opcode reader."""
    return sum(1 for op, _, _ in pickletools.genops(data) if op.name == "MEMOIZE")


def _before_stop(data: bytes, piece: bytes) -> bytes:
    """``piece`` (a statement that leaves the stack as it found it) just before STOP."""
    assert data.endswith(b".")
    return data[:-1] + piece + b"."


def _shared_tuple_by_memoize(levels: int, first: int) -> bytes:
    """t = (t, t) nested ``levels`` deep from (), each level MEMOIZEd (index = the memo's count,
    ``first`` for the first) and read back by LONG_BINGET of that computed index: only a scan
    that counted every MEMOIZE before it reads the right weights."""
    out = b")\x94"
    for k in range(first, first + levels):
        get = b"j" + k.to_bytes(4, "little")
        out += b"0" + get + get + b"\x86\x94"
    return out


def test_real_metadata_is_passed_over_and_counted_exactly(produced: Callable[..., Any]) -> None:
    data = _metadata(produced)
    memo, skipped = _scan(data, bulk=True)
    assert skipped > len(data) // 2  # the records are most of the file, and were skipped
    assert _scan(data, bulk=False) == (memo, 0)
    assert memo == _memo_count(data)


def test_manifest_is_the_same_with_and_without_the_record_path(
    produced: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = str(produced("fsdp2", world_size=2, optimizer=True).path)
    fast = read_dcp(ckpt)
    monkeypatch.setattr(pickle_patterns, "records", lambda: None)
    assert read_dcp(ckpt) == fast


def test_shared_tuple_after_the_batches_is_refused(produced: Callable[..., Any]) -> None:
    data = _metadata(produced)
    n = _memo_count(data)
    # 14 levels: 2**15 nodes, past the 10,000 a key may hash; a memo count off by one would
    # read levels apart (2**8 nodes) or an entry not yet written, and let it through
    hostile = _before_stop(data, b"}" + _shared_tuple_by_memoize(14, n) + b"K\x01s0")
    with pytest.raises(DecodingLimitError, match="would hash more than 10000 nodes"):
        _scan(hostile, bulk=True)
    with pytest.raises(DecodingLimitError, match="would hash more than 10000 nodes"):
        pickle_scan.scan(hostile, pickle_budget.DecodeBudget("x/.metadata", len(hostile)))


def test_memo_index_chosen_after_the_batches_is_scanned_again(
    produced: Callable[..., Any],
) -> None:
    data = _metadata(produced)
    small = _before_stop(data, b"Nq\x050")  # BINPUT 5: legal, and rescanned opcode by opcode
    pickle_scan.scan(small, pickle_budget.DecodeBudget("x/.metadata", len(small)))
    huge = _before_stop(data, b"Nr" + (100_000_000).to_bytes(4, "little") + b"0")
    with pytest.raises(DecodingLimitError, match="memo index 100000000"):
        pickle_scan.scan(huge, pickle_budget.DecodeBudget("x/.metadata", len(huge)))


def test_records_holding_shared_tuples_are_not_passed_over(tmp_path: Path) -> None:
    """A batch of torch's own records whose fields hold a shared tuple (a DAG) is not a batch
    the grammar admits: scanned opcode by opcode, and the DAG hashed as a key is refused."""
    import pickle

    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    dag: Any = ()
    for _ in range(14):
        dag = (dag, dag)
    records = [ChunkStorageMetadata(dag, torch.Size([1, 2])) for _ in range(3)]
    data = pickle.dumps((records, {dag: 1}), protocol=4)
    with pytest.raises(DecodingLimitError, match="would hash more than 10000 nodes"):
        pickle_scan.scan(data, pickle_budget.DecodeBudget(str(tmp_path / ".metadata"), len(data)))
    # and the same batch without the DAG is passed over
    plain = [ChunkStorageMetadata(torch.Size([i, 0]), torch.Size([1, 2])) for i in range(3)]
    assert _scan(pickle.dumps(plain, protocol=4), bulk=True)[1] > 0


def test_frames_anywhere_in_a_batch_are_passed_over(produced: Callable[..., Any]) -> None:
    """A FRAME may fall between any two opcodes (the C unpickler reads it as a no-op wherever it
    is): between two records, inside one, before the APPENDS. The batches are still passed over
    and the memo still counted exactly."""
    import pickle

    data = _metadata(produced)
    starts = [pos for _, _, pos in pickletools.genops(data)][1:-1]  # after PROTO, before STOP
    framed = bytearray()
    last = 0
    for k, pos in enumerate(starts):
        if k % 7 == 3:
            framed += data[last:pos] + b"\x95" + bytes(8)  # an empty frame
            last = pos
    framed += data[last:]
    memo, skipped = _scan(bytes(framed), bulk=True)
    assert skipped > len(framed) // 2
    assert memo == _memo_count(bytes(framed)) == _memo_count(data)
    assert pickle.loads(bytes(framed)) is not None
