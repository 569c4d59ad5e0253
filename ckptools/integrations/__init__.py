"""Hooks into other libraries' training loops; each submodule imports its library.

* :mod:`ckptools.integrations.transformers`: ``CkptoolsCallback``, a ``transformers``
  ``TrainerCallback`` that consolidates each FSDP checkpoint the Trainer saves.

Example:
    >>> from ckptools.integrations.transformers import CkptoolsCallback  # doctest: +SKIP
"""

from __future__ import annotations
