"""The saves of ckptools' own CheckpointManager, as a reader sees them: a ``step-N/`` directory is
complete when its commit marker parses and every file it records is there at its size.

The manager (:mod:`ckptools.training.store`) writes the marker; reading a run and ``ckpt list``
judge a save by it, here, below both.
"""

from __future__ import annotations

from typing import Any

from ckptools.errors import CkptError
from ckptools.io import storage

#: the commit marker, written last into a save's directory
MARKER_NAME = ".ckptools-complete"
#: what the marker's ``format`` says, and the ``version`` of its fields
MARKER_FORMAT = "ckptools-checkpoint"
MARKER_VERSION = 1


def read_marker(directory: str) -> tuple[dict[str, Any] | None, str]:
    """The marker of ``directory`` if it is complete, else ``(None, why not)``.

    Complete means: the marker parses, names this format, and every file it records exists with
    the recorded size (a few ``stat`` calls; byte-level checks are ``ckpt verify``'s job).
    """
    path = storage.join(directory, MARKER_NAME)
    try:
        marker = storage.read_json(path, what="marker")
    except (FileNotFoundError, NotADirectoryError):
        return None, f"no {MARKER_NAME} marker (save never committed)"
    except (OSError, CkptError) as e:
        return None, f"unreadable {MARKER_NAME}: {e}"
    if not isinstance(marker, dict) or marker.get("format") != MARKER_FORMAT:
        return None, f"{MARKER_NAME} is not a ckptools marker"
    files = marker.get("files")
    if not isinstance(files, dict):
        return None, f"{MARKER_NAME} lists no files"
    for name in files:  # never stat'ed outside the checkpoint (ckptools.io.containment)
        reason = storage.outside_reason(directory, name, links=False)
        if reason is not None:
            return None, f"{MARKER_NAME} names {storage.shown(name, reason)}, which {reason}"
    present = storage.file_sizes(directory, list(files))
    for name, size in files.items():
        found = present.get(name)
        if found is None:
            return None, f"missing file {name}"
        if found != size:
            return None, f"{name} is {found} bytes, marker says {size}"
    return marker, ""
