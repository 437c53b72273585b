"""The one error a trace loader raises: it names the file, the place in it and the fix."""

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
