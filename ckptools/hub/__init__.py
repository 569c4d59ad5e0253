"""``ckptools.push_to_hub``: publish a model directory to the Hugging Face Hub, checked first.

Everything that can be checked locally is checked before the first request, so a push never
leaves half a model on the Hub:

1. **Complete.** The directory must be a model directory (safetensors, or ``pytorch_model*.bin``)
   that :func:`ckptools.verify` finds whole at the structural level; a DCP checkpoint is refused
   with the ``ckpt consolidate`` command that makes one (:mod:`~ckptools.hub.checks`).
2. **Within the Hub's limits.** Every file is compared with :data:`HUB_MAX_FILE_BYTES`; a file over
   it fails the push before anything is sent, naming the ``--max-shard-size`` that fixes it.
3. **Described.** Unless the directory has its own ``README.md``, a model card with the weights'
   provenance and each file's SHA-256 is generated and uploaded from memory
   (:mod:`~ckptools.hub.card`).

Then the repository is created if needed and the files are uploaded in one commit, or above
:data:`LARGE_FOLDER_BYTES` in several with the index last; re-running a push that failed resumes
it (:mod:`~ckptools.hub.push`). Errors the Hub answers (401, 403, 404, 409, ...) and an
unreachable Hub become :class:`~ckptools.errors.HubError` subclasses whose one-line message says
what to do (:mod:`~ckptools.hub.errors`, an ordered table).

``huggingface_hub`` is imported only inside the functions that talk to the Hub, so
``import ckptools`` and ``ckpt --help`` stay light. The verb and the checks the CLI runs before
it are re-exported; modules inside the package import each other directly, never from here.

Example:
    >>> import ckptools
    >>> r = ckptools.push_to_hub("hf_model", "me/my-model", private=True)  # doctest: +SKIP
    >>> r.commit_url  # doctest: +SKIP
    'https://huggingface.co/me/my-model/commit/4f1c...'
"""

from __future__ import annotations

from ckptools.hub.checks import check_sizes, preflight, resolve_max_file_bytes
from ckptools.hub.push import PushOptions, PushResult, push_to_hub

__all__ = [
    "PushOptions",
    "PushResult",
    "check_sizes",
    "preflight",
    "push_to_hub",
    "resolve_max_file_bytes",
]
