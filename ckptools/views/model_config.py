"""The one config rule: where every verb finds the model's ``config.json`` and the files beside
it (``--config``, else beside the checkpoint, then up to its run directory), whether that
config's model fits the checkpoint's tensors (:mod:`ckptools.views.model_fit`), and the config
as written with a cast dtype.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ckptools.core.hf_files import MODEL_FILES
from ckptools.errors import CkptError, UsageError
from ckptools.io import storage
from ckptools.producers.numbered import is_numbered_save, run_records

if TYPE_CHECKING:
    pass


def _config_dir_files(directory: str) -> list[str]:
    present = storage.file_sizes(directory, MODEL_FILES)  # one listing on an object store
    return [n for n in MODEL_FILES if n in present]


def _copied_from(directory: str, names: list[str]) -> list[tuple[str, str]]:
    """``(path, name)`` of the model files ``names`` in ``directory``, each checked to lie inside
    it: a ``config.json`` that is a link to a file elsewhere would copy that file into OUT."""
    return [(storage.contained(directory, n, named_by=directory, entry="holds"), n) for n in names]


def _up_to_the_run(here: str) -> list[str]:
    """``here`` and the directories above it where a model's files may lie: its parent, and,
    when ``here`` is one numbered save of a run (its name, or the parent's record of the last
    save, says so), the run directory's parent too: the config a run keeps beside its
    checkpoints' directory is found from a save as from the run directory itself. A directory
    inside a numbered save (verl's ``global_step_N/actor/``) is searched as the save is, so the
    run's config is found from it too."""
    url = storage.is_url(here)

    def up(path: str) -> str:
        return storage.dirname(path) if url else os.path.dirname(os.path.abspath(path))

    def name(path: str) -> str:
        return path.rstrip("/").rsplit("/", 1)[-1] if url else os.path.basename(path)

    found = [here]
    parent = up(here)
    if is_numbered_save(name(parent)):
        here, parent = parent, up(parent)
        found.append(here)
    found.append(parent)
    if is_numbered_save(name(here)) or storage.file_sizes(parent, run_records()):
        found.append(up(parent))
    return found


def _check_model_config(given: str, path: str) -> None:
    """``--config``'s ``config.json`` must be a transformers config (``model_type`` set):
    anything else copied as OUT's config makes a directory ``from_pretrained`` cannot load."""
    cfg = model_config([(path, "config.json")])
    if cfg is None or not isinstance(cfg.get("model_type"), str):
        raise UsageError(
            f"--config {given}: {path} has no 'model_type', so from_pretrained cannot load "
            "it; give the model's own config.json (as save_pretrained writes it)"
        )


def find_model_files(
    src: str, config: str | None, inside: str | None = None, *, data_dir: str | None = None
) -> list[tuple[str, str]]:
    """``(source path, name in OUT)`` of the config and tokenizer files to copy.

    ``config`` may be a ``config.json`` file (copied alone) or a directory; its ``config.json``
    must name a ``model_type``. By default the checkpoint's own model-files subdirectory
    ``inside`` (``MODEL_FILES_DIR`` in its manifest's details: verl's ``huggingface/``), the
    checkpoint directory, then its parent (and, for one numbered save of a run, the run
    directory's parent: :func:`_up_to_the_run`) are searched, and the first holding
    ``config.json`` is used. ``data_dir``: the directory the checkpoint's
    files lie in when the layout found it below ``src`` (a run directory's newest checkpoint),
    searched (with ``inside`` below it, and its parent) before ``src``. A file of a directory
    must lie inside it (:func:`ckptools.io.storage.contained`).

    Raises:
        UsageError: ``config`` names nothing usable, or a config without ``model_type``.
        OutsideCheckpointError: a model file is a link leading outside its directory.
    """
    if config is not None:
        if storage.isfile(config):
            _check_model_config(config, config)
            return [(config, "config.json")]
        if storage.isdir(config):
            found = _config_dir_files(config)
            if not found:
                raise UsageError(
                    f"--config {config}: directory holds none of {', '.join(MODEL_FILES[:3])}..."
                )
            if "config.json" in found:
                _check_model_config(config, storage.join(config, "config.json"))
            return _copied_from(config, found)
        raise UsageError(f"--config {config}: no such file or directory")
    directories: list[str] = []
    named: list[str] = []  # the layout's own model-files directory, from each start
    for start in (data_dir, src) if data_dir not in (None, src) else (src,):
        assert start is not None
        if storage.is_url(start):
            here = start.rstrip("/") if storage.isdir(start) else storage.dirname(start)
        else:
            here = start if os.path.isdir(start) else os.path.dirname(os.path.abspath(start))
        if inside:  # named by the layout, kept inside the checkpoint
            own = storage.contained(here, inside, named_by=here, entry="holds")
            if own not in named:
                named.append(own)
                directories.insert(len(named) - 1, own)
        directories += [d for d in _up_to_the_run(here) if d not in directories]
    for directory in directories:
        found = _config_dir_files(directory)
        if "config.json" in found:
            return _copied_from(directory, found)
    for directory in named:  # the layout's directory holds the tokenizer alone: the config is
        found = _config_dir_files(directory)  # made from the checkpoint's own record
        if found and storage.isdir(directory):
            return _copied_from(directory, found)
    return []


def fitting_model_files(
    src: str,
    config: str | None,
    shapes: Mapping[str, tuple[int, ...]] | None,
    inside: str | None = None,
    *,
    data_dir: str | None = None,
    needed: str | None = None,
    quiet: bool = False,
) -> tuple[list[tuple[str, str]], str | None]:
    """The one rule every verb finds the model's ``config.json`` (and the files beside it) by:
    ``config`` when given, else beside the checkpoint, then up to its run directory
    (:func:`find_model_files`); and a config is used only when the model it names fits the
    tensors ``shapes`` (output name → shape, as the model would hold them;
    :func:`ckptools.views.model_fit.misfit`; None: not checked, the caller's conversion checks it).

    Returns the files to use and a note when a config found by itself does not fit: then no
    file of its directory is used (they are another model's), and the note names it and
    ``--config``.

    Raises:
        UsageError: ``config`` is given and does not fit; or a config found does not fit and
            ``needed`` (what needs it: a producer's "sizes come from it") says the conversion
            cannot go on without one; and as :func:`find_model_files` raises.
    """
    files = find_model_files(src, config, inside, data_dir=data_dir)
    if shapes is None:
        return files, None
    note = config_misfit(files, src, config, shapes, needed=needed, quiet=quiet)
    return (files, None) if note is None else ([], note)


def config_misfit(
    files: list[tuple[str, str]],
    src: str,
    config: str | None,
    shapes: Mapping[str, tuple[int, ...]],
    *,
    needed: str | None = None,
    quiet: bool = False,
) -> str | None:
    """The note that the ``config.json`` among ``files`` (:func:`find_model_files`) does not
    fit the tensors ``shapes`` of ``src``, or None (it fits, there is none, or its model
    cannot be built to tell: :func:`ckptools.views.model_fit.misfit`).

    Raises:
        UsageError: it does not fit and was given (``config``), or ``needed`` says what cannot
            go on without it.
    """
    cfg = model_config(files)
    if cfg is None or not shapes:
        return None
    from ckptools.views.model_fit import misfit

    found = misfit(cfg, shapes, quiet=quiet)
    if found is None:
        return None
    (path,) = [p for p, n in files if n == "config.json"]
    if config is not None:
        raise UsageError(
            f"--config {config}: its model does not fit the tensors of {src} "
            f"({found.describe()}); give the config of the model these weights are"
        )
    if needed is not None:
        raise UsageError(
            f"{path} (found for {src}) does not fit its tensors ({found.describe()}); "
            f"give the model's own config with --config ({needed})"
        )
    return (
        f"{path} (found for {src}) does not fit its tensors ({found.describe()}): not used, "
        "nor the files beside it; give the model's own config with --config"
    )


def model_config(files: list[tuple[str, str]]) -> dict[str, Any] | None:
    """The ``config.json`` among ``files`` (:func:`find_model_files`), read, or None."""
    for path, name in files:
        if name == "config.json":
            try:
                cfg = storage.read_json(path, what="model config")
            except OSError as e:
                raise UsageError(f"{path}: cannot read the model config: {e}") from e
            except CkptError as e:  # too large, or not JSON
                raise UsageError(str(e)) from e
            if not isinstance(cfg, dict):
                raise UsageError(f"{path}: the model config is not a JSON object")
            return cfg
    return None


def _dtype_keys() -> tuple[str, ...]:
    """The key the installed transformers' ``save_pretrained`` writes a model's dtype under:
    ``dtype`` since 4.56, ``torch_dtype`` before."""
    from ckptools.io import installed

    try:
        major, minor = (int(p) for p in (installed.version("transformers") or "").split(".")[:2])
    except ValueError:
        return ("dtype",)
    return ("dtype",) if (major, minor) >= (4, 56) else ("torch_dtype",)


def with_dtype(config: Mapping[str, Any], dtype: str) -> dict[str, Any]:
    """``config`` stating ``dtype`` (``--dtype``'s) as ``save_pretrained`` after
    ``model.to(dtype)`` does: ``from_pretrained(dtype="auto")`` then loads that dtype. Every
    dtype key the config (or a sub-config) has is set; without one, the installed
    transformers' key (:func:`_dtype_keys`) is added."""

    def set_in(cfg: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
        out, found = dict(cfg), False
        for key, value in cfg.items():
            if key in ("dtype", "torch_dtype") and (value is None or isinstance(value, str)):
                out[key], found = dtype, True
            elif isinstance(value, Mapping) and key.endswith("_config"):
                sub, sub_found = set_in(value)
                if sub_found:
                    out[key] = sub
        return out, found

    out, found = set_in(config)
    if not found:
        out.update(dict.fromkeys(_dtype_keys(), dtype))
    return out
