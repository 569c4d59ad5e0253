"""The one containment rule: a path a checkpoint names stays inside the checkpoint.

A checkpoint names files: DCP ``.metadata`` items their ``relative_path``, a safetensors or
``.bin`` index its shards, a wrapper its parts; and its files may be symbolic links. A checkpoint
from a stranger could name ``../../.ssh/id_rsa`` or ``/etc/passwd`` or hold a shard that is a link
to them, and a conversion would copy those bytes into an output the user then pushes. So every
layout passes each name through :func:`contained` before it turns it into a path, and refuses
(:class:`~ckptools.errors.OutsideCheckpointError`, one line naming the entry as written, never the
outside target) a name that

* is absolute, empty, holds a NUL, is a URL, or has a ``..`` segment (object-store keys too);
* locally, resolves (through symbolic links, of the file or of a directory on its way) to a
  place outside the checkpoint root.

One layout is legitimately made of links: the Hugging Face cache, whose
``models--<org>--<name>/snapshots/<rev>/<file>`` are relative links to ``../../blobs/<sha>`` of
the same repository. A link is allowed when it sits in such a snapshot and its target resolves
to a file directly in that repository's ``blobs/``; nothing wider.

The check costs one ``lstat`` per file named directly in the root (a ``realpath`` only for links
and names with directories), once per file, not per chunk: nothing measurable beside parsing.

The same idea for outputs (OUT is not SRC, does not hold it, does not lie inside it) is one of
the rules about OUT in :mod:`ckptools.io.out_rules`.
"""

from __future__ import annotations

import os
import stat

from ckptools.errors import OutsideCheckpointError
from ckptools.io.paths import is_url, join, local_path

#: How much of a refused name a message shows (names from a stranger may be huge).
_SHOWN_CHARS = 120
_HF_REPO_PREFIX = "models--"


def outside_reason(root: str, rel: str, *, links: bool = True) -> str | None:
    """Why ``root/rel`` would lead outside ``root`` (None when it stays inside); ``links``:
    follow local symbolic links too (else the name alone is judged).

    The reason never names the outside target. A missing file is inside (reading it reports it).
    """
    if not isinstance(rel, str) or not rel:
        return "is not a file name"
    if "\0" in rel:
        return "holds a NUL byte"
    if rel.startswith(("/", "\\")) or os.path.isabs(rel):
        return "is an absolute path"
    if "://" in rel:
        return "is a URL"
    if ".." in rel.split("/"):
        return "has a '..' segment"
    if links and not is_url(root) and _escapes(local_path(root), rel):
        return "is a symbolic link (or lies below one) leading elsewhere"
    return None


def contained(
    root: str,
    rel: str,
    *,
    named_by: str,
    entry: str = "names",
    fqn: str | None = None,
    links: bool = True,
) -> str:
    """``root/rel``, the path of a file the checkpoint names, when it lies inside ``root``.

    Args:
        root: the checkpoint root (the directory its names are relative to).
        rel: the name as the checkpoint wrote it.
        named_by: the file (or directory) that names it, for the message and ``path``.
        entry: how that file names it, a verb phrase put before the name: ``"names"``,
            ``"stores tensor 'model.w' in"``, ``"holds"`` (a file among the checkpoint's).
        fqn: the tensor or entry key, when there is one.
        links: follow local links (False: judge the name alone, no system call; what readers
            check again when they open a file the layout already checked).

    Raises:
        OutsideCheckpointError: the name leads outside (see the module docstring).
    """
    reason = outside_reason(root, rel, links=links)
    if reason is None:
        return join(root, rel)
    raise OutsideCheckpointError(
        f"{named_by}: {entry} {shown(rel, reason)}, which {reason}; refusing to read outside "
        "the checkpoint",
        entry=rel if isinstance(rel, str) else repr(rel),
        path=named_by,
        fqn=fqn,
    )


def shown(rel: object, reason: str = "") -> str:
    """``rel`` for a message: quoted on one line, cut short; an absolute path is not shown at
    all (it would print the outside target)."""
    if reason == "is an absolute path":
        return "a file"
    text = repr(rel)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 4] + "...'"


def _inside(path: str, real_root: str) -> bool:
    return path == real_root or path.startswith(real_root.rstrip(os.sep) + os.sep)


def _escapes(root: str, rel: str) -> bool:
    full = os.path.join(root, rel)
    if "/" not in rel and os.sep not in rel:
        try:
            if not stat.S_ISLNK(os.lstat(full).st_mode):
                return False  # a plain file (or directory) directly in the root
        except OSError:
            return False  # missing: whoever reads it reports that
    real_root = os.path.realpath(root)
    target = os.path.realpath(full)
    if _inside(target, real_root):
        return False
    real_parent = os.path.realpath(os.path.dirname(full))
    return not (_inside(real_parent, real_root) and _hf_blob(real_parent, target))


def _hf_blob(real_parent: str, target: str) -> bool:
    """True when ``real_parent`` lies in ``models--*/snapshots/<rev>`` of a Hugging Face cache
    and ``target`` is a file directly in that same repository's ``blobs/``."""
    d = real_parent
    while True:
        parent = os.path.dirname(d)
        if parent == d:
            return False
        repo = os.path.dirname(parent)
        if os.path.basename(parent) == "snapshots" and os.path.basename(repo).startswith(
            _HF_REPO_PREFIX
        ):
            return os.path.dirname(target) == os.path.join(repo, "blobs")
        d = parent
