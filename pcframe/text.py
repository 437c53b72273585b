"""Text that reaches a terminal or a report: a message on one line, a Markdown table cell.

Names come from users' files (a trace file, a checkpoint folder, a plugin's class) and may
hold a newline, a control character or a ``|``; these helpers keep one message to one line
and one value to one table cell.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def one_line(exc: BaseException | str) -> str:
    """The message on one line, control characters and lone surrogates escaped (a hostile
    name must not break the terminal or the output encoding)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def value_text(value: object, limit: int = 60) -> str:
    """A user's value in a message: its ``repr`` on one line, cut to ``limit`` characters
    (a ``repr`` that raises: the type's name)."""
    try:
        shown = repr(value)
    except Exception:  # a repr that raises: its type says enough
        shown = f"<{type(value).__name__}>"
    shown = one_line(shown)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


# CommonMark's backslash-escapable characters: a backslash before one of them is an escape,
# before any other character it is shown as it is.
_PUNCTUATION = frozenset("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")


def markdown_cell(value: object) -> str:
    """``str(value)`` as the text of one GitHub Markdown table cell.

    A ``|`` would end the cell and a newline the row: the ``|`` is written ``\\|`` and a
    line break ``<br>`` (shown as one). A backslash before punctuation is doubled, so that it
    shows instead of escaping (``a\\|b`` keeps its backslash and stays one cell); inside a
    code span, where backslashes show as they are, only the ``|`` is escaped. Other control
    characters and lone surrogates are written as Python escapes (``\\x1b``), which no
    terminal or encoder chokes on. Other Markdown (a code span, emphasis) is kept.
    """
    text = str(value).replace("\r\n", "\n").replace("\r", "\n")
    out: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c == "`":
            run = len(text[i:]) - len(text[i:].lstrip("`"))
            close = _closing_backticks(text, i + run, run)
            if close < 0:  # no code span: literal backticks
                out.append(c * run)
                i += run
                continue
            inner = text[i + run : close].replace("\n", " ")
            out.append(c * run + "".join(_cell_char(ch) for ch in inner) + c * run)
            i = close + run
            continue
        if c == "\\" and i + 1 < len(text) and text[i + 1] in _PUNCTUATION:
            out.append("\\\\")
        else:
            out.append(_cell_char(c))
        i += 1
    return "".join(out)


def _closing_backticks(text: str, start: int, run: int) -> int:
    """Where a run of exactly ``run`` backticks starts at or after ``start``; -1 if none."""
    i = start
    while (i := text.find("`" * run, i)) >= 0:
        end = i + run
        if (i == 0 or text[i - 1] != "`") and (end == len(text) or text[end] != "`"):
            return i
        i = end
        while i < len(text) and text[i] == "`":
            i += 1
    return -1


def _cell_char(c: str) -> str:
    if c == "|":
        return "\\|"
    if c == "\n":
        return "<br>"
    return c if c.isprintable() or c == " " else repr(c)[1:-1]


def markdown_row(cells: Iterable[object]) -> str:
    """One table row, ``| a | b |``, each cell through :func:`markdown_cell`."""
    return "| " + " | ".join(markdown_cell(c) for c in cells) + " |"


def markdown_code(value: object) -> str:
    """``str(value)`` as one inline code span on one line (a command, a study's name): a
    newline would end the paragraph (or start a heading), a backtick the span; so the text
    is put on one line (:func:`one_line`) inside a fence longer than its longest backtick run.
    """
    text = one_line(value) if str(value).strip() else ""
    if not text:
        return ""
    longest = max((len(run) for run in _backtick_runs(text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _backtick_runs(text: str) -> list[str]:
    runs, current = [], ""
    for c in text:
        if c == "`":
            current += c
        elif current:
            runs.append(current)
            current = ""
    return [*runs, current] if current else runs


# Seconds past this (31 years) are no real interval: shown as 1e+308, not in 309 digits.
_PLAIN_SECONDS = 1e9


def seconds_text(value: float) -> str:
    """``value`` seconds for a message: ``84.9``, ``12,345.0``; one past a billion, or not
    finite, as ``1e+308`` / ``inf`` (``policy.interval.seconds=1e308`` printed 309 digits)."""
    if math.isfinite(value) and abs(value) < _PLAIN_SECONDS:
        return f"{value:,.1f}"
    return f"{value:.3g}"
