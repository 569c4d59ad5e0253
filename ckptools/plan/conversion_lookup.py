"""Which of the installed transformers' conversion rules apply to a model ``config.json``.

transformers does not look a model's conversion up by its name alone:
``get_model_conversion_mapping`` walks the model's modules and takes the mapping of every
sub-model (a VLM's MoE text model, the ``Dinov2Model`` inside ``Dinov2ForImageClassification``),
keyed by class name then ``model_type``, scoped to that sub-model's prefix (``PrefixChange``
entries with ``model_prefix`` included). The same walk is done here, on the model built from
``config`` on the ``meta`` device (no memory, no weights, transformers' own classes only: never
code named by the config), so the rules are transformers' own, scopes and all
(:func:`model_transforms`).

Importing transformers costs seconds, so :func:`mentioned` first reads its mapping's source text
for any name the config could be looked up by (:func:`lookup_names`).
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Mapping
from typing import Any

_MAX_MODULES = 4096  # a count field larger than this is not built (hostile or absurd config)


def lookup_names(config: Mapping[str, Any]) -> list[str]:
    """The names transformers may look ``config``'s conversions up by: its architectures, their
    base models (``XForY`` → ``XModel``), its ``model_type`` and its sub-configs' model types."""
    names: list[str] = []
    for arch in config.get("architectures") or []:
        if isinstance(arch, str):
            names.append(arch)
            if "For" in arch:
                names.append(arch.split("For", 1)[0] + "Model")
    todo, depth = [config], 0
    while todo and depth < 3:
        nxt: list[Mapping[str, Any]] = []
        for c in todo:
            if isinstance(c.get("model_type"), str):
                names.append(c["model_type"])
            nxt.extend(v for v in c.values() if isinstance(v, Mapping))
        todo, depth = nxt, depth + 1
    return names


def mapping_source() -> str | None:
    """The text of the installed transformers' ``conversion_mapping.py`` (read, not imported),
    or None without transformers."""
    try:
        spec = importlib.util.find_spec("transformers")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        try:
            with open(f"{location}/conversion_mapping.py", encoding="utf-8") as f:
                return f.read()
        except OSError:
            continue
    return None


def mentioned(names: list[str], source: str | None = None) -> bool:
    """Whether the installed transformers' mapping source (``source``, else
    :func:`mapping_source`) mentions any of ``names`` (quoted): a read of one file instead of a
    multi-second import for models it cannot convert."""
    text = mapping_source() if source is None else source
    return text is not None and any(f'"{n}"' in text for n in names)


def _too_big(config: Mapping[str, Any]) -> bool:
    for key, value in config.items():
        if isinstance(value, Mapping) and _too_big(value):
            return True
        counts = ("layers", "depth", "experts", "blocks")
        if isinstance(value, int) and any(c in key for c in counts) and value > _MAX_MODULES:
            return True
    return False


def _meta_model(config: Mapping[str, Any]) -> Any:
    """The model ``config`` names (its first ``architectures`` entry that is a transformers
    class and builds), on the ``meta`` device; None when none does."""
    import torch
    import transformers
    from transformers.utils import logging

    if _too_big(config):
        return None
    for arch in config.get("architectures") or []:
        cls: Any = getattr(transformers, arch, None) if isinstance(arch, str) else None
        if not callable(getattr(cls, "_from_config", None)) or not getattr(
            cls, "config_class", None
        ):
            continue
        verbosity = logging.get_verbosity()
        logging.set_verbosity_error()  # type: ignore[no-untyped-call]
        try:
            with warnings.catch_warnings(), torch.device("meta"):
                warnings.simplefilter("ignore")
                return cls._from_config(cls.config_class.from_dict(dict(config)))
        except Exception:
            continue
        finally:
            logging.set_verbosity(verbosity)
    return None


def model_transforms(config: Mapping[str, Any]) -> list[Any] | None:
    """transformers' own ``get_model_conversion_mapping`` (without the load-only legacy
    renames, as ``save_pretrained`` does) of the model ``config`` names, built on ``meta``.

    Returns None when no ``architectures`` entry is a transformers class or the model does not
    build from ``config`` (the caller then looks the root name up alone); an empty list for a
    model without conversions.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping

    model = _meta_model(config)
    if model is None:
        return None
    try:
        return list(get_model_conversion_mapping(model, add_legacy=False))
    except Exception:
        return None


def model_param_order(config: Mapping[str, Any]) -> list[str] | None:
    """The names ``model.named_parameters()`` yields, in order, for the transformers model
    ``config`` names (built on ``meta``); None when it does not build."""
    model = _meta_model(config)
    return None if model is None else [n for n, _ in model.named_parameters()]


def trainer_param_order(config: Mapping[str, Any]) -> list[str] | None:
    """The order in which a transformers ``Trainer`` gives the model ``config`` names its
    parameters to the optimizer (``create_optimizer``: the parameters with weight decay, by
    the Trainer's own ``get_decay_parameter_names``, in model order, then the others); None
    when the model does not build."""
    model = _meta_model(config)
    if model is None:
        return None
    try:
        from transformers import Trainer

        # an instance method that reads nothing of the instance: the Trainer's own rule
        decay = set(Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]
    except Exception:
        return None
    names = [n for n, _ in model.named_parameters()]
    return [n for n in names if n in decay] + [n for n in names if n not in decay]
