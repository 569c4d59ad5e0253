"""The ``ckpt`` command line: a thin translator from options to library calls.

click lives only in this package. Each command parses its options, calls one library function
and prints the result with :func:`ckptools.cli.render.emit` (human text, or one JSON object with
``--json``). Option names are the library's keyword arguments, so a command passes the options
it does not use itself straight through (``**options``), never restating a default; options
several commands take are defined once in :mod:`ckptools.cli.options`, exit codes in
:mod:`ckptools.cli.exit_codes`. Commands import heavy modules inside their bodies so that
``ckpt --help`` stays fast and never imports torch.

This module imports nothing itself: :func:`main` (the ``ckpt`` entry point) first makes Ctrl-C
end the process with one line and exit code 130, and only then imports click and the commands,
so an interrupt while they load is answered the same way as one during the work.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> None:
    """The ``ckpt`` entry point: parse ``argv`` (default: ``sys.argv[1:]``) and run the command."""
    from ckptools.cli.interrupts import leave_on_interrupt

    leave_on_interrupt()
    from ckptools.core.bulk import own_process

    own_process()  # this process exists for one command: what parsing builds is frozen
    from ckptools.cli.main import main as run

    run(argv)


__all__ = ["main"]
