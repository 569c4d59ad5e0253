"""How producers name the numbered saves of a run directory: each family's package declares its
patterns (``SAVES``, group 1 the step), read from there.

Kept apart from the layouts that read those saves: finding a model's ``config.json`` above a
checkpoint (:func:`ckptools.views.model_config.find_model_files`) asks whether a directory is
one numbered save, and must not import every producer's reader for that (issue 27: start-up).
"""

from __future__ import annotations

from ckptools.producers.registry import declared


def is_numbered_save(name: str) -> bool:
    """Whether ``name`` is how one of the producers names one save of a run."""
    return any(p.match(name) for p in declared("SAVES"))


def run_records() -> tuple[str, ...]:
    """The files a run directory keeps recording its last save (DeepSpeed's tag file, verl's
    step file...), as the families declare them (``RUN_RECORDS``)."""
    return tuple(dict.fromkeys(declared("RUN_RECORDS")))
