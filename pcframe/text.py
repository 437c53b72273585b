"""Text that reaches a terminal or a report: a message on one line, a Markdown table cell.

Names come from users' files (a trace file, a checkpoint folder, a plugin's class) and may
hold a newline, a control character or a ``|``; these helpers keep one message to one line
and one value to one table cell.
"""

from __future__ import annotations


def one_line(exc: BaseException | str) -> str:
    """The message on one line, control characters and lone surrogates escaped (a hostile
    name must not break the terminal or the output encoding)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
