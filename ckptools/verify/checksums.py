"""The ckptools checksum manifest: a fast hash per stored chunk and per file of a checkpoint.

A checkpoint's own integrity data has a blind spot: the CRC-32 that ``torch.save`` stores for each
zip record travels *with* the record, so a DCP item moved to another item's place (two chunks of
the same size whose bytes were swapped by a faulty copy or conversion) still carries valid CRCs,
and safetensors files carry no checksum at all. The checksum manifest records, beside the
checkpoint, what each chunk's bytes hashed to when it was known good, keyed by (FQN, chunk
offsets), so :func:`ckptools.verify` can tell that a chunk's bytes are no longer its own.

The file (``.ckptools-checksums.json`` inside a checkpoint directory, or
``<file>.ckptools-checksums.json`` beside a single-file checkpoint) holds::

    {"format": "ckptools-checksums", "version": 1, "algorithm": "xxh3-128",
     "files":   {"__0_0.distcp": {"size": 1234, "digest": "<hex>"}},
     "chunks":  {"model.w": [{"offsets": [0, 0], "file": "__0_0.distcp", "offset": 0,
                              "length": 1500, "digest": "<hex>"}]},
     "objects": {"extra.step": {"file": ..., "offset": ..., "length": ..., "digest": ...}}}

A chunk's digest is XXH3-128 of its stored bytes (for a DCP item, the whole ``torch.save``
archive at its byte range). A file's digest is XXH3-128 of the file's bytes *with each recorded
chunk replaced by its 16-byte digest* (chunks chosen in file order, skipping any that overlap an
earlier one): every byte of the file still influences it, yet each byte is hashed once, so writing
and checking checksums costs one hash pass over the data, not two.

``ckpt checksum PATH`` (:func:`write_checksums`) writes the file atomically after checking the
checkpoint's structure and CRCs, so it never records the hashes of already-damaged data: it runs
the structure check and the content scan itself (the scan returns the digests as data);
:func:`compare_checksums` is how :func:`ckptools.verify` holds a checkpoint against the file.

Example:
    >>> from ckptools.verify.checksums import write_checksums
    >>> sums = write_checksums("checkpoints/step-1000")  # doctest: +SKIP
    >>> sums.path  # doctest: +SKIP
    'checkpoints/step-1000/.ckptools-checksums.json'
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptools.core.manifest import Manifest
from ckptools.engine import collective
from ckptools.errors import CorruptCheckpointError
from ckptools.io import storage, tunables
from ckptools.verify import scan
from ckptools.verify.digests import ALGORITHM, Digests, FileSum, ItemKey, ItemSum
from ckptools.verify.report import Finding
from ckptools.verify.structure import Item, check_structure, read

CHECKSUM_FILE = ".ckptools-checksums.json"
FORMAT_NAME = "ckptools-checksums"
FORMAT_VERSION = 1
#: the most bytes of a checksum manifest read: one record per stored chunk (a 405B model at
#: 1,024 ranks, 1.2 million chunks, writes ~100 MiB)
CHECKSUMS_LIMIT = 1 << 30


def checksum_path(manifest: Manifest) -> str:
    """Where the checksum manifest of ``manifest``'s checkpoint lives."""
    if storage.isdir(manifest.root):
        return storage.join(manifest.root, CHECKSUM_FILE)
    return manifest.root + CHECKSUM_FILE


@dataclass(frozen=True)
class Checksums:
    """A checksum manifest in memory (see the module docstring for the file format)."""

    path: str
    items: Mapping[ItemKey, ItemSum]
    files: Mapping[str, FileSum]
    algorithm: str = ALGORITHM
    created: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        chunks: dict[str, list[dict[str, Any]]] = {}
        objects: dict[str, dict[str, Any]] = {}
        for (fqn, offsets), s in self.items.items():
            rec = {"file": s.file, "offset": s.offset, "length": s.length, "digest": s.digest}
            if offsets is None:
                objects[fqn] = rec
            else:
                chunks.setdefault(fqn, []).append({"offsets": list(offsets), **rec})
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "algorithm": self.algorithm,
            "created": self.created,
            **dict(self.extra),
            "files": {k: {"size": v.size, "digest": v.digest} for k, v in self.files.items()},
            "chunks": chunks,
            "objects": objects,
        }


def load_checksums(path: str) -> Checksums:
    """Read a checksum manifest file.

    Raises:
        CorruptCheckpointError: the file is not a checksum manifest ckptools can use.
    """
    try:
        data = storage.read_json(path, CHECKSUMS_LIMIT, what="checksum manifest")
        if data.get("format") != FORMAT_NAME or data.get("algorithm") != ALGORITHM:
            raise ValueError(f"format {data.get('format')!r}, algorithm {data.get('algorithm')!r}")
        if int(data.get("version", 0)) > FORMAT_VERSION:
            raise ValueError(f"version {data['version']} is newer than this ckptools reads")
        items: dict[ItemKey, ItemSum] = {}
        for fqn, recs in data["chunks"].items():
            for r in recs:
                key = (fqn, tuple(int(o) for o in r["offsets"]))
                items[key] = ItemSum(r["file"], int(r["offset"]), int(r["length"]), r["digest"])
        for fqn, r in data.get("objects", {}).items():
            items[(fqn, None)] = ItemSum(r["file"], int(r["offset"]), int(r["length"]), r["digest"])
        files = {k: FileSum(int(v["size"]), v["digest"]) for k, v in data["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptCheckpointError(
            f"{path}: not a usable ckptools checksum manifest ({type(e).__name__}: {e}); "
            "delete it or rewrite it with `ckpt checksum`",
            path=path,
        ) from e
    return Checksums(path, items, files, data["algorithm"], str(data.get("created", "")))


def save_checksums(sums: Checksums) -> None:
    """Write ``sums`` to ``sums.path`` atomically (temporary file, fsync, rename; on an object
    store one PUT, which appears whole or not at all)."""
    text = json.dumps(sums.to_json(), indent=1, sort_keys=False) + "\n"
    storage.write_atomic(sums.path, text.encode())


@storage.accepts_storage_options
def write_checksums(
    path: str,
    *,
    format: str | None = None,
    workers: int | None = None,
    quiet: bool = False,
    distributed: bool = False,
    storage_options: storage.StorageOptions | None = None,
) -> Checksums:
    """Hash every chunk and file of the checkpoint at ``path`` and write its checksum manifest.

    Reads every byte once. The checkpoint is checked first (structure and the CRC-32s
    ``torch.save`` stores), so hashes of damaged data are never recorded.

    Args:
        path: a checkpoint ckptools reads (directory or file).
        format: force a layout (as ``ckpt inspect --format``).
        workers: files read in parallel (default ``CKPTOOLS_WORKERS`` or up to 4).
        quiet: no progress bar.
        distributed: under torchrun, or called by every rank of an initialised process group:
            every rank hashes a share of the files (as :func:`ckptools.verify` does) and rank 0
            writes the manifest. Default: this process alone (what one rank of a training job
            calls).
        storage_options: fsspec options for URL paths (credentials, endpoint...), a mapping
            or its JSON text; see :func:`ckptools.io.storage.storage_options`.

    Returns:
        The written :class:`Checksums`; ``.path`` is where it went.

    Raises:
        CorruptCheckpointError: the checkpoint has problems; run ``ckpt verify`` to see them all.

    Example:
        >>> sums = write_checksums("checkpoints/step-1000")  # doctest: +SKIP
        >>> len(sums.items)  # doctest: +SKIP
        84
    """
    n_workers = tunables.workers(workers)
    block = scan.resolve_block_bytes()
    ranks = collective.current(distributed)
    manifest, findings = read(path, format)
    digests = None
    if manifest is not None:
        structure = check_structure(manifest)
        findings.extend(structure.findings)
        options = scan.ScanOptions(
            digests=True, block=block, workers=n_workers, quiet=quiet or not ranks.is_root
        )
        content = scan.scan_content(ranks, structure, options)
        findings.extend(content.findings)
        digests = content.digests
    if findings:
        first = findings[0]
        raise CorruptCheckpointError(
            f"{path}: not writing checksums of a damaged checkpoint: {first.message} "
            f"({len(findings)} problem(s); run `ckpt verify {path}` to see them all)",
            path=first.file,
            fqn=first.fqn,
            rank=first.rank,
        )
    assert manifest is not None and digests is not None  # no finding: read and scanned
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    sums = Checksums(
        path=checksum_path(manifest),
        items=digests.items,
        files=digests.files,
        created=now,
        extra={"layout": manifest.layout},
    )
    ranks.from_root(lambda: save_checksums(sums), "checksum")
    return sums


def load_for_verify(
    manifest: Manifest, sizes: Mapping[str, int], root: str
) -> tuple[Checksums | None, list[Finding]]:
    """The checksum manifest of ``manifest``'s checkpoint, if it has one, and the findings that
    need no data: the file is unusable, or a file's size differs from the recorded one."""
    path = checksum_path(manifest)
    if not storage.exists(path):
        return None, []
    try:
        sums = load_checksums(path)
    except CorruptCheckpointError as e:
        return None, [Finding("checksum", e.message, CHECKSUM_FILE)]
    return sums, [
        Finding(
            "checksum",
            f"{storage.join(root, rel)}: {sizes[rel]} bytes, but the checksum manifest recorded "
            f"{rec.size}",
            rel,
        )
        for rel, rec in sums.files.items()
        if rel in sizes and sizes[rel] != rec.size
    ]


def compare_checksums(sums: Checksums, digests: Digests, items: list[Item]) -> list[Finding]:
    """A finding for every item and file whose digest differs from ``sums``, or that one side
    records and the other does not (items not read, in missing or short files, are skipped:
    the structure check reports those)."""
    checked_files = set(digests.files)
    out: list[Finding] = []
    by_key = {i.key: i for i in items}
    item_files_bad: set[str] = set()
    for key, rec in sums.items.items():
        item = by_key.get(key)
        cur = digests.items.get(key)
        label = item.where() if item is not None else repr(key[0])
        chunk_at = key[1]
        if item is None:
            out.append(
                Finding(
                    "checksum",
                    f"{sums.path}: records {label}"
                    + (f" chunk at {list(chunk_at)}" if chunk_at else "")
                    + ", which the checkpoint no longer holds",
                    rec.file,
                    key[0],
                    None,
                    chunk_at,
                )
            )
            continue
        if cur is None:
            continue  # not read (its file is missing or short): reported already
        if (cur.file, cur.offset, cur.length) != (rec.file, rec.offset, rec.length):
            item_files_bad.add(cur.file)
            out.append(
                Finding(
                    "checksum",
                    f"{os.path.join(os.path.dirname(sums.path), cur.file)}: {label} is stored at "
                    f"bytes {cur.offset}..{cur.offset + cur.length} of {cur.file}, but the "
                    f"checksum manifest recorded {rec.offset}..{rec.offset + rec.length} of "
                    f"{rec.file}: the metadata changed since `ckpt checksum`",
                    cur.file,
                    key[0],
                    item.rank,
                    chunk_at,
                )
            )
        elif cur.digest != rec.digest:
            item_files_bad.add(cur.file)
            out.append(
                Finding(
                    "checksum",
                    f"{os.path.join(os.path.dirname(sums.path), cur.file)}: the bytes of {label} "
                    f"(bytes {cur.offset}..{cur.offset + cur.length}) do not match the checksum "
                    f"manifest ({cur.digest} != {rec.digest}): they changed since `ckpt "
                    "checksum`, or another chunk's bytes were put in their place",
                    cur.file,
                    key[0],
                    item.rank,
                    chunk_at,
                )
            )
    for key, item in by_key.items():
        if key not in sums.items and key in digests.items:
            out.append(
                Finding(
                    "checksum",
                    f"{sums.path}: has no checksum for {item.where()}; it was written for another "
                    "version of this checkpoint: rewrite it with `ckpt checksum`",
                    item.file,
                    item.fqn,
                    item.rank,
                    key[1],
                )
            )
    for rel, frec in sums.files.items():
        cur_file = digests.files.get(rel)
        if rel not in checked_files or rel in item_files_bad:
            continue  # missing or short files are reported by the structure check
        if cur_file is None:
            out.append(
                Finding("checksum", f"{sums.path}: records file {rel}, which is not read", rel)
            )
        elif cur_file.size != frec.size or cur_file.digest != frec.digest:
            out.append(
                Finding(
                    "checksum",
                    f"{os.path.join(os.path.dirname(sums.path), rel)}: file differs from the "
                    f"checksum manifest (size {cur_file.size} vs {frec.size}, digest "
                    f"{cur_file.digest} vs {frec.digest}) outside any chunk's bytes",
                    rel,
                )
            )
    return out
