"""The errors of the policies package: a plugin that cannot be loaded, a trace file that
cannot be read (it names the file, the place in it and the fix)."""

from __future__ import annotations

from pathlib import Path


class TraceFormatError(ValueError):
    """A trace file is malformed or of an unknown format."""

    def __init__(self, path: str | Path, where: str, problem: str, fix: str) -> None:
        self.path = str(path)
        self.where = where
        self.problem = problem
        self.fix = fix
        loc = f"{self.path}:{where}" if where else self.path
        super().__init__(f"{loc}: {problem}. Fix: {fix}")


class PluginError(RuntimeError):
    """A plugin entry point could not be loaded or is not a pcframe plugin class."""
