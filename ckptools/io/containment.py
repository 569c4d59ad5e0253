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

:func:`check_apart` is the same idea for outputs: OUT must not be SRC, hold it or lie inside it,
or ``--overwrite`` would delete the source (or the next run copy OUT into itself).
"""

from __future__ import annotations

import os
import posixpath
import stat

from ckptools.errors import OutsideCheckpointError, UsageError
from ckptools.io.paths import exists, is_url, isfile, join, local_path, walk_files

#: How much of a refused name a message shows (names from a stranger may be huge).
_SHOWN_CHARS = 120
_HF_REPO_PREFIX = "models--"
#: What a consolidation writes last in its model directory, and the kinds of file it writes
#: (weights, config and tokenizer files, a model card): an existing OUT inside SRC with one of
#: the markers and nothing else is an earlier consolidation's output, which a new one may
#: replace; a checkpoint saved there (optimizer.pt, .distcp, rng_state.pth...) is not.
_MODEL_DIR_MARKERS = ("model.safetensors.index.json", "model.safetensors")
_MODEL_DIR_SUFFIXES = (".safetensors", ".json", ".txt", ".model", ".jinja", ".md")


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


def _normalised(path: str) -> str:
    if is_url(path):
        scheme, _, rest = path.split("::")[-1].partition("://")
        return f"{scheme}://{posixpath.normpath('/' + rest).lstrip('/')}"
    return os.path.realpath(local_path(path))


def check_apart(src: str, out: str, *, allow_inside: bool = False) -> None:
    """Refuse an OUT that is SRC, holds SRC or (unless ``allow_inside``) lies inside SRC (real
    paths compared; URLs by their normalised prefix). Call before anything is created or deleted.

    ``allow_inside`` is for writers that copy nothing but the model's own files from SRC
    (consolidate, whose Trainer callback writes ``checkpoint-N/hf/`` by design): an OUT inside
    SRC is never deleted with it, and they never read it back. A reshard copies every file
    beside the data, so an OUT inside SRC would end up in the next output. Even then an OUT
    inside SRC that exists must be a model directory an earlier consolidation wrote (the
    callback again, for a resumed run saving the same step): anything else there is part of
    the source, which ``--overwrite`` would replace.

    Raises:
        UsageError: one line saying which.
    """
    if is_url(src) != is_url(out):
        return
    sep = "/" if is_url(out) else os.sep
    s, o = _normalised(src), _normalised(out)
    if o == s:
        why = "is the source checkpoint itself"
    elif s.startswith(o.rstrip(sep) + sep):
        why = f"holds the source checkpoint {src} (--overwrite would delete it)"
    elif o.startswith(s.rstrip(sep) + sep) and not allow_inside:
        why = f"lies inside the source checkpoint {src}"
    elif o.startswith(s.rstrip(sep) + sep) and exists(out) and not _is_model_dir(out):
        why = (
            f"already exists inside the source checkpoint {src} and is part of it (not a model "
            "directory a consolidation wrote), which --overwrite would replace"
        )
    else:
        return
    raise UsageError(f"{out}: {why}; write the output somewhere else", path=out)


def _is_model_dir(path: str) -> bool:
    if not any(isfile(join(path, name)) for name in _MODEL_DIR_MARKERS):
        return False
    return all(rel.endswith(_MODEL_DIR_SUFFIXES) for rel in walk_files(path))
