"""The interface every on-disk layout implements, and the registry that finds one for a path."""

from __future__ import annotations

import importlib
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import xxhash

from ckptools.core.manifest import Manifest
from ckptools.errors import (
    CheckpointNotFoundError,
    CkptError,
    UnknownFormatError,
    UsageError,
)
from ckptools.formats import safe_pickle, stream_transforms
from ckptools.io import storage
from ckptools.producers import registry
from ckptools.producers.dcp import STEP_SAVE
from ckptools.producers.registry import MODULES, REFUSED, VIEWED
from ckptools.producers.run_dirs import Chosen, directory_names, newest_numbered

if TYPE_CHECKING:
    from ckptools.producers.decoding import Decodes


class Layout(ABC):
    """One on-disk format or producer layout.

    ``probe`` is cheap (a few ``stat``/``listdir`` calls, no parsing of tensor data) and says why
    a path is not this layout; ``read_manifest`` parses metadata only.
    """

    #: short name used by ``--format`` and shown by ``inspect``
    name: str = ""
    #: one line for ``--help`` and error messages
    description: str = ""
    #: detection order, lower first: what the layout's family declares (its package's
    #: ``LAYOUTS``), set by :func:`register`; ``registry.MODULES`` lists them in that order
    priority: int = 50

    @abstractmethod
    def probe(self, path: str) -> str | None:
        """Return None when ``path`` is in this layout, else the reason it is not."""

    @abstractmethod
    def read_manifest(self, path: str) -> Manifest:
        """Describe the checkpoint at ``path`` (metadata only)."""

    def lacks(self, path: str) -> str | None:
        """What the save ``path`` lacks to be read whole, or None when it is whole (or this
        layout cannot tell cheaply): file presence per the save's own metadata, no tensor data
        read. A run directory's newest save is its newest whole one."""
        return None

    #: the module of ``ckptools.producers`` that views this layout's checkpoints as the Hugging
    #: Face model and as its training state, when its stored names are not the model's
    #: (``as_hf``, ``as_training``, ``with_masters``: :class:`ckptools.views.producer.Views`);
    #: None: its names are the model's. Imported only when a verb asks (:func:`layout_of`).
    views: str | None = None
    #: the module of ``ckptools.producers`` that reads stored forms which are not the model's
    #: tensors (quantized data and its scales) as the plain tensors, for ``consolidate
    #: --dtype`` (``decoded``: :mod:`ckptools.producers.decoding`); None: every tensor is stored
    #: as the model's.
    decodes: str | None = None
    #: a model directory (what ``push`` uploads): the layout reads published model files
    model_directory: bool = False
    #: its integer-keyed optimizer's groups are the model's parameters in the model's order
    #: (the Trainer's two, split by weight decay): the model's config names them
    groups_follow_the_model: bool = False

    def read_manifest_unchecked(self, path: str) -> Manifest:
        """:meth:`read_manifest`, listing every file its metadata names even when one is
        missing or short, for ``verify`` to report each (default: :meth:`read_manifest`)."""
        return self.read_manifest(path)

    def read_listing(self, path: str) -> Manifest:
        """What ``inspect`` shows of ``path`` (default: :meth:`read_manifest`). A layout that
        recognises a checkpoint ckptools cannot convert refuses it by name in
        :meth:`read_manifest`, so every verb does, and lists what it holds here, from its
        metadata alone: a manifest with no tensor to read (its facts: the family's ``FACTS``)."""
        return self.read_manifest(path)

    def numbered_saves(self) -> NumberedSaves | None:
        """How this layout's producer numbers the saves of a run directory, as ``ckpt list``
        shows them (:mod:`ckptools.producers.saves`); None: it keeps no numbered saves."""
        return None


def _no_record(root: str, names: list[str]) -> str | None:
    return None


def _no_ranks(path: str) -> int | None:
    return None


@dataclass(frozen=True)
class NumberedSaves:
    """How one producer numbers its saves inside a run directory (:meth:`Layout.numbered_saves`)."""

    pattern: re.Pattern[str]  # group 1: the step
    #: what a save lacks to be read (None: whole), as the layout reading the run directory judges
    lacks: Callable[[str], str | None]
    #: the save the producer's own record in the run directory ``root`` (listing ``names``)
    #: names as its latest, or None
    recorded: Callable[[str, list[str]], str | None] = _no_record
    ranks: Callable[[str], int | None] = _no_ranks  # ranks that wrote a save, from file names
    #: who ``ckpt list`` says reads the run directory ``root`` (None: the layout's name)
    label: Callable[[str], str] | None = None


# each family's pickled classes, as data-only stand-ins, before any of its files is read
safe_pickle.admit(
    enums=registry.declared("PICKLE_ENUMS"),
    records=registry.declared("PICKLE_RECORDS"),
    wrappers=registry.declared("PICKLE_WRAPPERS"),
)


def _lazy_decoder(module: str) -> Callable[[str], stream_transforms.Decoder | None]:
    """A family's decoder of one stream transform, its module (below ``ckptools.producers``)
    imported only when an item stored with that transform is met: its ``decoder(version)``."""

    def make(version: str) -> stream_transforms.Decoder | None:
        found: Callable[[str], stream_transforms.Decoder | None]
        found = importlib.import_module(f"ckptools.producers.{module}").decoder
        return found(version)

    return make


# each family's decoders of stream transforms (its ``DECODERS``: transform name -> module)
stream_transforms.admit(
    (name, _lazy_decoder(module)) for name, module in registry.declared("DECODERS")
)
_REGISTRY: dict[str, Layout] = {}


def register(layout: Layout) -> Layout:
    if layout.name not in MODULES:
        raise ValueError(
            f"layout {layout.name!r} is declared by no family's LAYOUTS: detection would not try it"
        )
    layout.priority = registry.priority(layout.name)
    _REGISTRY[layout.name] = layout
    return layout


def _layout(name: str) -> Layout:
    """The layout called ``name``, its module imported on first use."""
    found = _REGISTRY.get(name)
    if found is None:
        # by name: each layout module imports this one to register itself
        importlib.import_module(f"ckptools.producers.{MODULES[name]}")
        found = _REGISTRY[name]
    return found


def layout_of(manifest: Manifest) -> Layout | None:
    """The registered layout that read ``manifest`` (its ``layout``), None when none did (a
    DCP's producer, ``fsdp2``; a manifest ckptools made)."""
    return _layout(manifest.layout) if manifest.layout in MODULES else None


def decodes_of(manifest: Manifest) -> Decodes | None:
    """The ``decodes`` module of the layout that read ``manifest``
    (:mod:`ckptools.producers.decoding`), None when it stores every tensor as the model's;
    imported only then."""
    layout = layout_of(manifest)
    if layout is None or layout.decodes is None:
        return None
    return cast("Decodes", importlib.import_module(f"ckptools.producers.{layout.decodes}"))


def viewed_by(path: str) -> Layout | None:
    """The layout with its own views (:attr:`Layout.views`: its stored names are not the
    model's) that recognises the directory ``path``, None when none does. Probes only those
    (the registry's ``VIEWED``), importing no other family's modules."""
    for name in VIEWED:
        layout = _layout(name)
        if layout.probe(path) is None:
            return layout
    return None


def read_by_producer(path: str) -> Layout | None:
    """The layout that must read the directory ``path`` rather than ``dcp.load`` into the
    model: one whose stored names are not the model's (:func:`viewed_by`), or one that
    recognises it only to refuse it (the registry's ``REFUSED``: its ``read_manifest`` says
    why). None when neither does. Probes only those layouts."""
    found = viewed_by(path)
    if found is not None:
        return found
    for name in REFUSED:
        layout = _layout(name)
        if layout.probe(path) is None:
            return layout
    return None


def _in_order() -> Iterator[Layout]:
    """Every layout in detection order, each module imported when the walk reaches it."""
    for name in MODULES:
        yield _layout(name)


def layouts() -> Sequence[Layout]:
    """Every layout, in detection order (all their modules imported)."""
    return tuple(_in_order())


def detect(path: str, format: str | None = None) -> Layout:
    """Find the layout of ``path``; wrappers are tried before the plain formats they contain.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist.
        UsageError: ``path`` is one file of a multi-file checkpoint (point at its directory).
        UnknownFormatError: ``path`` is an empty directory, or no layout matched (one line;
            each layout's reason is in its ``details``, which ``--debug`` prints).
    """
    if not storage.exists(path):
        raise CheckpointNotFoundError(f"{path}: no such file or directory", path=path)
    if format is not None:
        if format in MODULES:
            layout = _layout(format)
            reason = layout.probe(path)
            if reason is not None:
                run = None
                with suppress(CkptError):  # a run of step-N/ saves whose newest that layout reads
                    run = step_run(path)
                if run is not None and run.name == format:
                    return run
                raise UnknownFormatError(
                    f"{path}: not a {format} checkpoint: {reason}{_part_hint(path)}", path=path
                )
            return layout
        names = ", ".join(MODULES)
        raise UnknownFormatError(f"unknown format {format!r}; choose one of: {names}")
    _refuse_one_part(path)
    if directory_names(path) == []:
        raise UnknownFormatError(f"{path}: empty directory, no checkpoint here", path=path)
    refusals = []
    for layout in _in_order():
        reason = layout.probe(path)
        if reason is None:
            return layout
        refusals.append((layout.name, reason))
    reasons = tuple(f"  {name}: {reason}" for name, reason in refusals)
    run = step_run(path)
    if run is not None:
        return run
    inside = checkpoints_inside(path)
    if inside:
        raise UnknownFormatError(_point_at(path, inside), path=path, details=reasons)
    # one line; a layout that recognised the path but names a way on (a directory of several
    # torch.save files: point at one) is that line, the rest are --debug's
    way_on = next(((n, r) for n, r in refusals if "point at" in r), None)
    enclosing = _enclosing(path) if way_on is None else None
    if way_on is not None:
        message = f"{path}: not a checkpoint ckptools reads as it is: {way_on[0]}: {way_on[1]}"
    elif enclosing is not None:
        where, name = enclosing
        message = f"{path}: lies inside the {name} checkpoint at {where}; point at {where}"
    else:
        message = (
            f"{path}: not a checkpoint ckptools recognises (--debug lists why each layout "
            "refused it; --format NAME forces one and shows its full error)"
        )
    raise UnknownFormatError(message, path=path, details=reasons)


def _enclosing(path: str, levels: int = 2) -> tuple[str, str] | None:
    """``(directory, layout)`` of the checkpoint ``path`` lies inside, up to ``levels`` up (a
    side folder a producer writes beside its data: verl's ``huggingface/``, NeMo's
    ``context/``, DeepSpeed's ``zero_to_fp32.py``), or None. Probes only: no manifest read."""
    at = path.rstrip("/")
    for _ in range(levels):
        parent = storage.dirname(at)
        if not parent or parent == at:
            return None
        for layout in _in_order():
            with suppress(CkptError, OSError):
                if layout.probe(parent) is None:
                    return parent, layout.name
        at = parent
    return None


class RunSave(Layout):
    """A run directory of ``step-N/`` saves (a :class:`~ckptools.training.CheckpointManager`
    root, or a script's ``dcp.save`` per step), read as the save :func:`step_run` chose, by the
    layout that detects that save (its ``name``); the manifest's notes say which."""

    def __init__(self, chosen: Chosen, layout: Layout) -> None:
        self.chosen, self.layout = chosen, layout
        self.name, self.description, self.priority = layout.name, layout.description, 99
        self.views, self.model_directory = layout.views, layout.model_directory
        self.decodes = layout.decodes
        self.groups_follow_the_model = layout.groups_follow_the_model

    @property
    def save(self) -> str:
        return storage.join(self.chosen.parent, self.chosen.name)

    def probe(self, path: str) -> str | None:
        return None if path == self.chosen.parent else f"not the run directory {path}"

    def read_manifest(self, path: str) -> Manifest:
        return self.chosen.noted(self.layout.read_manifest(self.save))

    def read_listing(self, path: str) -> Manifest:
        return self.chosen.noted(self.layout.read_listing(self.save))


def step_lacks(path: str, *, managed: bool) -> str | None:
    """What the ``step-N`` save ``path`` lacks, or None when whole: in a CheckpointManager root
    (``managed``) its commit marker and every file it records, else a whole DCP directory."""
    if managed:
        from ckptools.producers.dcp.manager import read_marker as commit_marker

        return commit_marker(path)[1] or None
    return _layout("dcp").lacks(path)


def is_managed(path: str, names: Sequence[str]) -> bool:
    """Whether the run directory ``path`` is a CheckpointManager root: one of its ``step-N``
    saves holds the manager's commit marker."""
    from ckptools.producers.dcp.manager import MARKER_NAME

    return any(
        STEP_SAVE.match(n) and storage.isfile(storage.join(path, n, MARKER_NAME)) for n in names
    )


def step_run(path: str) -> RunSave | None:
    """The directory ``path`` of ``step-N/`` saves that no layout reads itself, resolved to its
    newest whole save (numbers compared as numbers; what ``ckpt list`` marks latest), or None
    when it holds no ``step-N/`` (or none a layout reads)."""
    names = directory_names(path) or []
    if not any(STEP_SAVE.match(n) for n in names):
        return None
    managed = is_managed(path, names)
    what = "no commit marker recording every file" if managed else "no whole DCP save"
    chosen = newest_numbered(
        path, STEP_SAVE, lambda p: step_lacks(p, managed=managed) is None, what
    )
    if chosen is None:
        return None
    save = storage.contained(path, chosen.name, named_by=path, entry="holds")
    try:
        layout = detect(save)
    except UnknownFormatError:
        return None
    return RunSave(chosen, layout)


def _part_hint(path: str) -> str:
    """For a file of a multi-file checkpoint forced to a layout that cannot read it alone: the
    directory to point at instead."""
    from ckptools.producers.part_files import part_of

    part = part_of(path)
    return "" if part is None else f"; it is one file of the checkpoint at {part[1]}: point at it"


def _refuse_one_part(path: str) -> None:
    """A file that is one part of a multi-file checkpoint (:mod:`ckptools.producers.part_files`)
    is refused, naming the directory to point at (``--format`` still reads the file alone)."""
    from ckptools.producers.part_files import missing_siblings, part_of

    part = part_of(path)
    if part is None:
        return
    family, directory = part
    total, missing = missing_siblings(path)
    if missing:  # the directory alone would be read as something else, or fail
        shown = ", ".join(missing[:3]) + (
            f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        )
        raise UsageError(
            f"{path}: this is one of {total} files of a {family} checkpoint, and {directory} "
            f"lacks {shown}; point at the directory that holds all of them",
            path=path,
        )
    with suppress(CkptError):  # the directory's own problem is told when the user points at it
        family = detect(directory).name
    raise UsageError(
        f"{path}: this is one file of the {family} checkpoint at {directory}; point at {directory}",
        path=path,
    )


#: entries of a directory that is no checkpoint probed for one (the directory above a
#: checkpoint holds it and a few files; a directory of thousands is no such mistake)
_CHILDREN_PROBED_MAX = 32


def checkpoints_inside(path: str) -> list[tuple[str, str]]:
    """(entry, layout name) of each checkpoint directory directly inside the directory
    ``path``: what pointing one level too high meant (``run/`` for ``run/ckpt``)."""
    names = directory_names(path)
    if not names or len(names) > _CHILDREN_PROBED_MAX:
        return []
    found = []
    for name in sorted(names):
        if name.startswith(".") or storage.outside_reason(path, name) is not None:
            continue
        child = storage.join(path, name)
        if not storage.isdir(child):  # a directory of files is the layouts' own to judge
            continue
        for layout in _in_order():
            try:
                refused = layout.probe(child)
            except (CkptError, OSError):
                break  # a damaged child is no way forward to name
            if refused is None:
                found.append((name, layout.name))
                break
    return found


def _point_at(path: str, inside: list[tuple[str, str]]) -> str:
    if len(inside) == 1:
        name, layout = inside[0]
        return (
            f"{path} is no checkpoint itself, but {storage.join(path, name)} holds a {layout} "
            "checkpoint: point at it (--debug lists why each layout refused the directory)"
        )
    listed = ", ".join(f"{name} ({layout})" for name, layout in inside)
    return f"{path} is no checkpoint itself, but holds {len(inside)}: {listed}: point at one"


def read_manifest(
    path: str, format: str | None = None, *, model_only: bool = False, listing: bool = False
) -> Manifest:
    """Detect the layout of ``path`` and read its :class:`~ckptools.core.manifest.Manifest`.

    Each marker file is read from storage once, even when a probe looked inside it first
    (:func:`read_marker`). ``model_only``: the caller exports the model and nothing else, so a
    layout that keeps the optimizer in files of its own (one per rank) may leave them unread
    (:func:`model_only`; it says so in the notes). ``listing``: for ``inspect``, what the
    layout lists of a checkpoint it cannot convert (:meth:`Layout.read_listing`).
    """
    token = _MODEL_ONLY.set(model_only)
    try:
        with _markers_read_once():
            layout = detect(path, format)
            return layout.read_listing(path) if listing else layout.read_manifest(path)
    finally:
        _MODEL_ONLY.reset(token)


_MODEL_ONLY: ContextVar[bool] = ContextVar("ckptools_model_only", default=False)


def model_only() -> bool:
    """Whether the :func:`read_manifest` under way may leave optimizer-only files unread."""
    return _MODEL_ONLY.get()


#: Marker bytes a probe read during the current :func:`read_manifest`, kept for the layout's
#: own read of the same file (torchtitan's probe looks for its key inside DCP ``.metadata``).
_PEEKED: ContextVar[dict[str, bytes] | None] = ContextVar("ckptools_peeked_markers", default=None)


@contextmanager
def _markers_read_once() -> Iterator[None]:
    token = _PEEKED.set({})
    try:
        yield
    finally:
        _PEEKED.reset(token)


#: the most bytes of one marker file read (a DCP ``.metadata``: a 405B model saved by 1,024
#: ranks writes 144 MiB of it)
MARKER_LIMIT = 1 << 30


def read_marker(path: str, *, peek: bool = False, limit: int = MARKER_LIMIT) -> bytes:
    """The bytes of the marker file ``path`` (e.g. a DCP ``.metadata``), at most ``limit``.

    Inside :func:`read_manifest` a file is read from storage once: a probe passes ``peek`` to
    keep the bytes for the layout that parses them, whose own read takes (and frees) them.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CorruptCheckpointError: the file is larger than ``limit``.
    """
    peeked = _PEEKED.get()
    if peeked is not None and path in peeked:
        return peeked[path] if peek else peeked.pop(path)
    data = storage.read_bounded(path, limit, what="marker file")
    if peek and peeked is not None:
        peeked[path] = data
    return data


def digest(data: bytes) -> str:
    """The digest a manifest records for a marker's bytes (:attr:`Manifest.marker_digests`)."""
    return xxhash.xxh3_128_hexdigest(data)
