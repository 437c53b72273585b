"""What ``pcframe-run`` shows while it trains: a rich progress bar, and a line per phase.

In a terminal the bar shows the phase, steps done, steps per second, checkpoints committed
and (under the preemption supervisor) kills so far; it is transient, so the summary table
follows cleanly. Every phase also ends with one plain line (on stderr, like the bar), so a
log file or CI output shows what happened even where no bar is drawn.
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

REFRESH_S = 0.1  # at most this often the bar is updated from the training loop


class _Rate(ProgressColumn):
    def render(self, task: Any) -> Text:
        elapsed = task.fields.get("elapsed") or 0.0
        done = task.fields.get("done") or 0
        rate = done / elapsed if elapsed > 0 else 0.0
        return Text(f"{rate:,.0f} steps/s" if rate else "   … steps/s")


class StepProgress:
    """One bar per phase (``start``), fed with ``step``; ``commits``/``kills`` as they change."""

    def __init__(
        self, *, enabled: bool = True, kills: bool = False, console: Console | None = None
    ):
        self.console = console or Console(stderr=True)
        self.enabled = enabled
        columns: list[Any] = [
            TextColumn("{task.description}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            _Rate(),
            TextColumn("ckpts {task.fields[commits]}"),
        ]
        if kills:
            columns.append(TextColumn("kills {task.fields[kills]}"))
        columns.append(TimeElapsedColumn())
        self.progress = Progress(
            *columns, console=self.console, transient=True, disable=not enabled
        )
        self.task: Any = None
        self.description = ""
        self.total = 0
        self.first = 0
        self.done = 0
        self.commits = 0
        self.kills = 0
        self._began = 0.0
        self._shown = 0.0

    def __enter__(self) -> StepProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(*exc)

    def start(self, description: str, total: int, first: int = 0) -> None:
        """A new phase: ``total`` steps, counting from step ``first`` (a resumed run)."""
        if self.task is not None:
            self.progress.remove_task(self.task)
        self.description, self.total, self.first = description, total, first
        self.done, self.commits, self.kills = 0, 0, 0
        self._began = self._shown = time.perf_counter()
        self.task = self.progress.add_task(
            description, total=total, completed=first, commits=0, kills=0, done=0, elapsed=0.0
        )

    def resume(self, first: int) -> None:
        """The phase resumed from a checkpoint at step ``first``: count from there."""
        self.first = first
        self.progress.update(self.task, completed=first)

    def step(self, step: int) -> None:
        self.done = max(0, step - self.first)
        now = time.perf_counter()
        if now - self._shown >= REFRESH_S or step >= self.total:
            self._shown = now
            self._update(step, now)

    def set_commits(self, commits: int) -> None:
        self.commits = commits

    def set_kills(self, kills: int) -> None:
        self.kills = kills

    def _update(self, step: int, now: float) -> None:
        self.progress.update(
            self.task,
            completed=step,
            commits=self.commits,
            kills=self.kills,
            done=self.done,
            elapsed=now - self._began,
        )

    def finish(self, note: str = "") -> None:
        """End the phase with one line: steps, seconds, steps/s, checkpoints (+ ``note``)."""
        seconds = time.perf_counter() - self._began
        rate = self.done / seconds if seconds > 0 else 0.0
        parts = [f"{self.description}: {self.done} steps in {seconds:.1f} s ({rate:,.0f} steps/s)"]
        if note:
            parts.append(note)
        self.console.print(", ".join(parts), highlight=False, soft_wrap=True)
