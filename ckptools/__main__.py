"""``python -m ckptools`` is the ``ckpt`` command."""

from ckptools.cli import main

main()
