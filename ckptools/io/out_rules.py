"""The rules for an output directory OUT: one place, the same for every writer.

Every writer (``consolidate`` in one process or under torchrun, the DCP writer behind ``reshard``
and ``shard``, ``save_pretrained``, the training manager's step directories) calls
:func:`check_out` before any work starts. OUT is refused, in one line, when

* it is not a usable place: an empty path, the current directory or one holding it (a
  directory in use cannot be replaced), a path below a file (``notes.txt/out``), or a place
  where nothing can be created (no write permission);
* it is the source checkpoint, holds it, or lies inside it, new or existing (``--overwrite``
  would delete the source, and whatever is written inside a source travels with it into the
  next conversion): no writer may put its output into its source;
* it exists, without ``overwrite``;
* it exists and, with ``overwrite``, holds anything but an earlier ckptools output of the same
  kind (:func:`foreign_file`): ``--overwrite`` replaces an output, never a directory of the
  user's (notes, training runs), so the message names a file it would have deleted.

What counts as an earlier output is recognised by the files ckptools writes, whatever wrote
them:

* ``"model"`` (``consolidate``, ``save_pretrained``): a Hugging Face model directory, its
  ``model.safetensors`` (or index and shards, or a LoRA adapter's weights) with nothing beside
  them but the config, generation-config and tokenizer files a consolidation copies;
* ``"dcp"`` (``reshard``, ``shard``, a training manager's ``step-N``): a DCP checkpoint, its
  ``.metadata`` at the top (or in accelerate's ``pytorch_model_fsdp_N/`` and ``optimizer_N/``
  parts), with the files a reshard copies beside the data; a second checkpoint nested deeper
  is not part of it.

Either may hold ckptools' own records (checksums, resume journals, commit markers); an empty
directory is replaceable as well.
"""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Iterable
from typing import Literal

from ckptools.core.hf_files import ADAPTER_CONFIG_NAME, INDEX_NAME, MODEL_FILES
from ckptools.errors import UsageError
from ckptools.io.paths import is_url, local_path, walk_files

#: What a writer produces, for what ``overwrite`` may replace (see the module docstring).
OutputKind = Literal["model", "dcp"]

#: ckptools' own records, in any kind of output: checksums, resume journals, commit markers,
#: the in-progress note of an object-store write.
_RECORD_PREFIX = ".ckptools-"
_DCP_METADATA = ".metadata"
_ACCELERATE_PART = re.compile(r"^(pytorch_model_fsdp|optimizer)_\d+$")
_KIND_NAMES = {"model": "a model directory", "dcp": "a DCP checkpoint"}


def check_out(
    out: str,
    *,
    kind: OutputKind,
    overwrite: bool,
    src: str | None = None,
    dry_run: bool = False,
) -> list[str]:
    """Refuse an OUT that breaks the rules (module docstring); call before any work starts.

    A dry run (which writes nothing) gets an OUT that exists, or that ``overwrite`` may not
    replace, said rather than refused, as the notes returned, so the plan is still shown; the
    other rules refuse it either way.

    Raises:
        UsageError: one line naming OUT and what to do.
    """
    check_place(out)
    if src is not None:
        check_apart(src, out)
    try:
        check_replaceable(out, kind=kind, overwrite=overwrite)
    except UsageError as e:
        if dry_run:
            return [f"{e} (without --dry-run the run would stop here)"]
        raise
    return []


def check_place(out: str) -> None:
    """Refuse an OUT that cannot be a directory written here: an empty path, the current
    directory (or one holding it), a path below a file, a place without write permission.
    Nothing to check for a URL: an object store creates prefixes as it writes."""
    if not out:
        raise UsageError("OUT is an empty path; name the directory to write the output to")
    if is_url(out):
        return
    full = os.path.abspath(local_path(out))
    real = os.path.realpath(full)
    try:
        cwd = os.path.realpath(os.getcwd())
    except OSError:  # the current directory was deleted: nothing can hold it
        cwd = None
    if cwd is not None and (cwd == real or cwd.startswith(real.rstrip(os.sep) + os.sep)):
        what = "is" if cwd == real else "holds"
        raise UsageError(
            f"{out}: {what} the current directory, which cannot be replaced while in use; "
            "choose another OUT",
            path=out,
        )
    parent = os.path.dirname(full)
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UsageError(
            f"{out}: {parent} is not a directory, so nothing can be written below it; "
            "choose another OUT",
            path=parent,
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(
            f"{out}: cannot create it in {parent} (permission denied); choose another OUT",
            path=parent,
        )


def _normalised(path: str) -> str:
    if is_url(path):
        scheme, _, rest = path.split("::")[-1].partition("://")
        return f"{scheme}://{posixpath.normpath('/' + rest).lstrip('/')}"
    return os.path.realpath(local_path(path))


def check_apart(src: str, out: str) -> None:
    """Refuse an OUT that is SRC, holds SRC or lies inside SRC (real paths compared; URLs by
    their normalised prefix), whether it exists or not and whatever ``overwrite`` says.

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
    elif o.startswith(s.rstrip(sep) + sep):
        why = f"lies inside the source checkpoint {src} (its files would become part of the source)"
    else:
        return
    raise UsageError(f"{out}: {why}; write the output somewhere else", path=out)


def check_replaceable(out: str, *, kind: OutputKind, overwrite: bool) -> None:
    """Refuse an existing OUT without ``overwrite`` (on an object store: one holding a
    checkpoint or foreign objects, see :meth:`ckptools.io.staging.ObjectStoreStaging.
    check_writable`), and, with it, one that is not an earlier output of ``kind``.

    Raises:
        UsageError: one line; with ``overwrite``, naming a file it would delete.
    """
    from ckptools.io.staging import staging_for  # staging writes; these rules only look

    staging_for(out).check_writable(out, overwrite)
    if not overwrite:
        return
    if is_url(out):
        files: Iterable[str] = walk_files(out)
    else:
        local = local_path(out)
        if not os.path.lexists(local):
            return
        if os.path.islink(local) or not os.path.isdir(local):
            what = "symbolic link" if os.path.islink(local) else "file"
            raise UsageError(
                f"{out}: --overwrite would delete this {what}, which ckptools did not write; "
                "remove it yourself or choose another OUT",
                path=out,
            )
        files = _local_names(local)
    foreign = foreign_file(files, kind)
    if foreign is not None:
        raise UsageError(
            f"{out}: --overwrite would delete {foreign}, which ckptools did not write as part "
            f"of {_KIND_NAMES[kind]}; remove it yourself or choose another OUT",
            path=out,
        )


def _local_names(root: str) -> list[str]:
    """Every entry below ``root`` that is not a directory (links to directories included, not
    followed), ``/``-separated and relative; no ``stat`` beyond the walk's own."""
    names: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
        names += [prefix + n for n in filenames]
        names += [prefix + d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
    return names


def _is_record(rel: str) -> bool:
    return rel.rsplit("/", 1)[-1].startswith(_RECORD_PREFIX)


def foreign_file(files: Iterable[str], kind: OutputKind) -> str | None:
    """The first of ``files`` (``/``-separated names below an existing OUT) that shows it is
    not an earlier ckptools output of ``kind``; None when it is one, or holds nothing but
    ckptools' records."""
    names = sorted(n for n in files if not _is_record(n))
    if not names:
        return None
    if kind == "model":
        return _foreign_in_model_dir(names)
    return _foreign_in_dcp_dir(names)


def _beside_weights() -> frozenset[str]:
    """The files a consolidation writes beside its ``.safetensors`` weights."""
    return frozenset({*MODEL_FILES, ADAPTER_CONFIG_NAME, INDEX_NAME})


def is_model_output(files: Iterable[str]) -> bool:
    """True when ``files`` (names relative to a directory) are a model directory ckptools
    writes: its weights' marker, and nothing but model files beside them."""
    names = sorted(n for n in files if not _is_record(n))
    return bool(names) and _foreign_in_model_dir(names) is None


def _foreign_in_model_dir(names: list[str]) -> str | None:
    beside = _beside_weights()
    for name in names:
        if "/" in name or not (name in beside or name.endswith(".safetensors")):
            return name
    if not any(n.endswith(".safetensors") for n in names):
        return names[0]  # config or tokenizer files without weights: not an output
    return None


def _foreign_in_dcp_dir(names: list[str]) -> str | None:
    parts = {n.rpartition("/")[0] for n in names if n.rpartition("/")[2] == _DCP_METADATA}
    recognised = "" in parts or (
        bool(parts) and all("/" not in p and _ACCELERATE_PART.match(p) for p in parts)
    )
    if not recognised:
        return next((n for n in names if not n.endswith((".distcp", _DCP_METADATA))), names[0])
    # a checkpoint nested below the output's own parts is another one (a training run's)
    nested = sorted(p for p in parts if p and not _ACCELERATE_PART.match(p))
    if nested:
        return f"{nested[0]}/{_DCP_METADATA}"
    return None
