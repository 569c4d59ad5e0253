"""io.memory.populate: one system call faults in the pages a read is about to fill."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from ckptools.io import memory

MiB = 1 << 20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_populate_faults_in_fresh_memory_and_keeps_written_bytes() -> None:
    fresh = torch.empty(64 * MiB, dtype=torch.uint8)  # allocated, no page touched yet
    before = _rss()
    assert memory.populate(fresh.data_ptr(), fresh.numel())
    assert _rss() - before >= 60 * MiB  # the pages exist now, before any write

    written = torch.arange(16 * MiB, dtype=torch.int32).view(torch.uint8)
    expected = written.clone()
    assert memory.populate(written.data_ptr() + 1, written.numel() - 1)  # unaligned ends
    assert torch.equal(written, expected)  # a hint: contents never change


def test_small_or_empty_ranges_are_left_alone() -> None:
    buf = torch.empty(MiB - 1, dtype=torch.uint8)
    assert not memory.populate(buf.data_ptr(), buf.numel())
    assert not memory.populate(buf.data_ptr(), 0)
