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
checkpoint's structure and CRCs, so it never records the hashes of already-damaged data.

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
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import xxhash

from ckptools import collective
from ckptools.core.manifest import Manifest
from ckptools.errors import CorruptCheckpointError
from ckptools.io import storage

CHECKSUM_FILE = ".ckptools-checksums.json"
FORMAT_NAME = "ckptools-checksums"
FORMAT_VERSION = 1
#: XXH3-128 (the ``xxhash`` package): ~20 GB/s per core, against ~0.9 GB/s for BLAKE2b, so a
#: manifest costs a save or a verify almost nothing beyond reading the bytes. It detects
#: corruption and swapped data; it is not a defence against a deliberate forger.
ALGORITHM = "xxh3-128"
#: 16 bytes: collisions among a checkpoint's millions of chunks stay out of reach (2^-64 by the
#: birthday bound at 2^32 chunks), and the digest stays small in the JSON.
DIGEST_BYTES = 16

#: An item key: (FQN, chunk offsets) for a tensor chunk, (FQN, None) for a DCP object.
ItemKey = tuple[str, tuple[int, ...] | None]


def new_hasher() -> Any:
    """The hash every digest in the manifest uses."""
    return xxhash.xxh3_128()


def checksum_path(manifest: Manifest) -> str:
    """Where the checksum manifest of ``manifest``'s checkpoint lives."""
    if storage.isdir(manifest.root):
        return storage.join(manifest.root, CHECKSUM_FILE)
    return manifest.root + CHECKSUM_FILE


@dataclass(frozen=True)
class ItemSum:
    file: str
    offset: int
    length: int
    digest: str


@dataclass(frozen=True)
class FileSum:
    size: int
    digest: str


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
        data = json.loads(storage.read_bytes(path))
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
    if storage.is_url(sums.path):
        text = json.dumps(sums.to_json(), indent=1, sort_keys=False) + "\n"
        storage.write_bytes(sums.path, text.encode())
        return
    directory = os.path.dirname(os.path.abspath(sums.path))
    tmp = os.path.join(directory, f".{os.path.basename(sums.path)}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "w") as f:
            json.dump(sums.to_json(), f, indent=1, sort_keys=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, sums.path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    from ckptools.verify import verify

    report = verify(
        path, format=format, workers=workers, quiet=quiet, distributed=distributed,
        _collect_digests=True,
    )  # fmt: skip
    problems = [f for f in report.findings if f.kind != "checksum"]
    if problems:
        raise CorruptCheckpointError(
            f"{path}: not writing checksums of a damaged checkpoint: {problems[0].message} "
            f"({len(problems)} problem(s); run `ckpt verify {path}` to see them all)",
            path=problems[0].file,
            fqn=problems[0].fqn,
            rank=problems[0].rank,
        )
    assert report.digests is not None
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    sums = Checksums(
        path=report.checksum_file or path,
        items=report.digests.items,
        files=report.digests.files,
        created=now,
        extra={"layout": report.layout},
    )
    collective.current(distributed).from_root(lambda: save_checksums(sums), "checksum")
    return sums
