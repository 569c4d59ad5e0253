"""What the probes of layouts whose checkpoints are directories share: the directory listed
once, a file or a missing path named "not a directory", and the names handed to the layout.
"""

from __future__ import annotations

from abc import abstractmethod

from ckptools.producers.base import Layout
from ckptools.producers.run_dirs import directory_names

#: A probe's answer for a path that is a file, or no longer there.
NOT_A_DIRECTORY = "not a directory"


class DirectoryLayout(Layout):
    """A layout whose checkpoint is a directory: :meth:`probe` lists ``path`` once and asks
    :meth:`probe_names` about its names."""

    def probe(self, path: str) -> str | None:
        names = directory_names(path)
        return NOT_A_DIRECTORY if names is None else self.probe_names(path, names)

    @abstractmethod
    def probe_names(self, path: str, names: list[str]) -> str | None:
        """Why the directory ``path`` holding ``names`` is not of this layout (None when it
        is), as :meth:`Layout.probe` answers."""
