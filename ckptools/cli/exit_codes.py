"""The ``ckpt`` exit codes, one meaning each, so scripts can tell "broken" from "different".

A module of its own because both the group (which maps errors to codes) and the commands that
report findings (``verify``, ``diff``) need them; in ``main`` they made a cycle with the commands
``main`` registers.
"""

from __future__ import annotations

#: the command did what was asked and found nothing wrong
EXIT_OK = 0
#: a :class:`~ckptools.errors.CkptError` (or the environment's refusal: disk full, permissions)
EXIT_ERROR = 1
#: the arguments make no sense (:class:`~ckptools.errors.UsageError`, click's own usage errors)
EXIT_USAGE = 2
#: ``verify`` found problems or ``diff`` found differences: the command worked, the answer is "no"
EXIT_DIFFERENCES = 3
#: interrupted (Ctrl-C): 128 + SIGINT, what a shell reports for a process SIGINT ended
EXIT_INTERRUPTED = 130
