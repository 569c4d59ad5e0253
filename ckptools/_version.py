"""The package version, in a module of its own so that any module can read it without importing
the package's public surface (which would make every such module part of an import cycle)."""

__version__ = "0.1.0"
