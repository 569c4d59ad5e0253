"""zstd-compressed DCP items: torch's ``ZStandard`` storage extension (``stream.zstd/1``).

torch's writer (``FileSystemWriter(path, _extensions=[ZStandard()])``) passes each item's
``torch.save`` archive through ``zstandard.ZstdCompressor().stream_writer``: one zstd frame per
item, its content size not recorded. :func:`decoder` undoes it with the ``zstandard`` package
(the optional extra ``ckptools[zstd]``) as a stream: the engine reads it a block at a time and
stops at the size the item can legitimately have (:func:`ckptools.engine.reader.decoded_item`),
so a frame that inflates without end is refused in bounded memory.
"""

from __future__ import annotations

import io
from typing import IO, Any

from ckptools.formats.stream_transforms import Decoder, MissingDecoderError

#: what to run when ``zstandard`` is missing (the message ends with it)
INSTALL_HINT = "pip install 'ckptools[zstd]'"


class _Decoded(io.RawIOBase):
    """A zstd stream reader whose errors are ValueError (what a decoder raises for bytes it
    cannot decode) and whose end is checked: a frame cut short is an error, not an early end."""

    def __init__(self, reader: Any, error: type[Exception]) -> None:
        self._reader = reader
        self._error = error

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        try:
            return int(self._reader.readinto(b))
        except self._error as e:
            raise ValueError(f"zstd: {e}") from e


def decoder(version: str) -> Decoder | None:
    """The decoder of ``stream.zstd/<version>``, or None for a version torch does not write
    (torch reads major version 1)."""
    if version.partition(".")[0] != "1":
        return None
    try:
        import zstandard
    except ImportError as e:
        raise MissingDecoderError(INSTALL_HINT) from e

    def undo(stream: IO[bytes]) -> IO[bytes]:
        reader = zstandard.ZstdDecompressor().stream_reader(stream, read_across_frames=False)
        return io.BufferedReader(_Decoded(reader, zstandard.ZstdError))

    return undo
