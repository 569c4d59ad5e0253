"""Stream transforms of stored items, and the one place that says how each is decoded.

A DCP writer given storage extensions (torch's ``FileSystemWriter(path, _extensions=
[ZStandard()])``) passes every item's bytes through them and records, per item, its
``transform_descriptors`` (``"stream.zstd/1"``): the ``.distcp`` byte range then holds the
transformed stream, not a ``torch.save`` archive. The DCP producer copies the descriptors once,
at read, onto the item's :class:`~ckptools.core.manifest.Chunk` or
:class:`~ckptools.core.manifest.ObjectEntry` (``transforms``, in torch's order: the first undoes
first). From then on they are data: :func:`decoder` maps an item's transforms to the function
that undoes them, or to the one-line refusal; every reader of stored bytes
(:func:`ckptools.engine.reader.resolve_chunk`, :func:`~ckptools.engine.reader.read_object`)
asks it, and every verb asks :func:`require_decodable` first, over the items it will read,
before any output exists (cheap validation before heavy I/O).

Decoding a transform is one entry of :data:`DECODERS`, which no module here fills: a family
declares ``DECODERS = ((name, module),)`` as data in its package's ``__init__`` and
:mod:`ckptools.producers.base` registers each (:func:`admit`), importing the module only when an
item stored with that transform is met. A decoder maps a stream to a stream; how far it may
inflate (never beyond the size the item can legitimately have, so that a small frame inflating
to gigabytes is refused in bounded memory), where the decoded bytes go and how they are read is
the engine's one reader of decoded items (:func:`ckptools.engine.reader.decoded_item`).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from typing import IO

from ckptools.core.manifest import Chunk, Manifest
from ckptools.errors import UnsupportedCheckpointError
from ckptools.io import storage

#: Undoes one transform: the stored stream in, the stream it was made from out (torch's
#: ``StreamTransformExtension.transform_from``).
Decoder = Callable[[IO[bytes]], IO[bytes]]

#: A transform's name (a descriptor up to its ``/``, e.g. ``"stream.zstd"``) -> for a version
#: (after the ``/``), its decoder, or None when that version is not read (:func:`admit`).
#: A decoder raises ValueError for a stream it cannot decode (damaged bytes).
DECODERS: dict[str, Callable[[str], Decoder | None]] = {}


class MissingDecoderError(Exception):
    """What a :data:`DECODERS` entry raises when the package that decodes its transform is not
    installed: its message is what to do (``pip install '...'``), put after the item's name."""


def admit(declared: Iterable[tuple[str, Callable[[str], Decoder | None]]]) -> None:
    """Register each ``(transform name, decoder for a version)`` of the families' ``DECODERS``
    (:mod:`ckptools.producers.base` calls it once, at import)."""
    for name, make in declared:
        DECODERS.setdefault(name, make)


_TRANSFORMS = operator.itemgetter(Chunk._fields.index("transforms"))


def decoder(transforms: tuple[str, ...], *, path: str, entry: str) -> Decoder | None:
    """The function that undoes ``transforms`` (an item's stored stream -> its ``torch.save``
    archive), or None for an item stored as it is.

    Args:
        transforms: the item's transforms, as the chunk or object entry holds them.
        path: the file holding the item, for the message.
        entry: what the item is, for the message: ``"tensor 'model.w'"``.

    Raises:
        UnsupportedCheckpointError: a transform no decoder reads; one line naming the file, the
            entry and the transform.
    """
    if not transforms:
        return None
    steps: list[Decoder] = []
    for transform in transforms:
        name, _, version = transform.partition("/")
        make = DECODERS.get(name)
        try:
            step = make(version) if make is not None else None
        except MissingDecoderError as e:
            raise UnsupportedCheckpointError(
                f"{path}: {entry} is stored with the DCP transform {transform!r}: {e}", path=path
            ) from e
        if step is None:
            raise UnsupportedCheckpointError(
                f"{path}: {entry} is stored with the DCP transform {transform!r}, which ckptools "
                "does not decode yet",
                path=path,
            )
        steps.append(step)

    def undo(stream: IO[bytes]) -> IO[bytes]:
        for step in steps:  # torch records the outermost transform first
            stream = step(stream)
        return stream

    return undo


def require_decodable(
    manifest: Manifest,
    tensors: Iterable[str] | None = None,
    objects: Iterable[str] | None = None,
) -> None:
    """Refuse (:func:`decoder`'s error) when an item of ``tensors`` or ``objects`` (FQNs of
    ``manifest``; None: all of them) is stored with a transform ckptools does not decode.

    Reads nothing: the transforms are on the chunks, looked at in C (``map`` of an item
    getter: ~60 ms at 1.16M chunks on the 2-core dev box, a Python loop over them ~2x); each
    distinct set of transforms is resolved once.
    """
    seen: set[tuple[str, ...]] = set()
    for fqn in manifest.tensors if tensors is None else tensors:
        chunks = manifest.tensors[fqn].chunks
        if not any(map(_TRANSFORMS, chunks)):
            continue
        for c in chunks:
            if c.transforms and c.transforms not in seen:
                where = storage.join(manifest.data_dir(), c.file)
                decoder(c.transforms, path=where, entry=f"tensor {fqn!r}")
                seen.add(c.transforms)
    for fqn in manifest.objects if objects is None else objects:
        o = manifest.objects[fqn]
        if o.transforms and o.transforms not in seen and o.file is not None:
            where = storage.join(manifest.data_dir(), o.file)
            decoder(o.transforms, path=where, entry=f"object {fqn!r}")
            seen.add(o.transforms)


def encodings(manifest: Manifest) -> dict[tuple[str, ...], int]:
    """Items (chunks and objects) per set of transforms, for ``inspect``; empty for a
    checkpoint stored as it is."""
    out: dict[tuple[str, ...], int] = {}
    for t in manifest.tensors.values():
        for c in t.chunks:
            if c.transforms:
                out[c.transforms] = out.get(c.transforms, 0) + 1
    for o in manifest.objects.values():
        if o.transforms:
            out[o.transforms] = out.get(o.transforms, 0) + 1
    return out


def decodes(transforms: tuple[str, ...]) -> bool:
    """Whether ckptools reads items stored with ``transforms``."""
    return missing(transforms) is None


def missing(transforms: tuple[str, ...]) -> str | None:
    """Why ckptools does not read items stored with ``transforms``: what to install (a
    decoder's :class:`MissingDecoderError`), or that it does not decode them; None when it does.
    """
    for transform in transforms:
        name, _, version = transform.partition("/")
        make = DECODERS.get(name)
        try:
            if make is None or make(version) is None:
                return "ckptools does not decode it yet"
        except MissingDecoderError as e:
            return str(e)
    return None
