"""Every Markdown table pcframe writes keeps a name with a ``|`` or a newline in its cell.

A trace file named ``a|b.csv`` or a trace whose metadata names it ``east|west`` split its
row into one cell too many; a newline in a name ended the row half way. The tables are read
back here as GitHub Markdown reads them (cells split at unescaped pipes, ``\\|`` unescaped,
backslash escapes and ``<br>`` applied), independently of the writer.
"""

from __future__ import annotations

import json
import re
import string
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from pcframe.text import markdown_cell

REPO = Path(__file__).resolve().parents[1]

NAMES = [
    "east|west",
    "new\nline",
    "a\\|b",  # a backslash right before the pipe
    "tail\\",
    "two||pipes",
    "crlf\r\nname",
    "esc\x1b[31mred",
    "star\\*not emphasis",
    "`code|span`",
]


def _split_row(line: str) -> list[str]:
    """A table row's raw cells, split as GitHub's parser does: a backslash and the character
    after it are one unit, an unescaped ``|`` ends a cell."""
    line = line.strip()
    assert line.startswith("|") and line.endswith("|"), line
    cells, cell, i = [], "", 1
    while i < len(line):
        if line[i] == "\\" and i + 1 < len(line):
            cell += line[i : i + 2]
            i += 2
        elif line[i] == "|":
            cells.append(cell)
            cell, i = "", i + 1
        else:
            cell += line[i]
            i += 1
    assert cell == "", f"row does not end with an unescaped pipe: {line!r}"
    return [c.strip() for c in cells]


def _shown(raw: str) -> str:
    """The text a cell shows: ``\\|`` is a pipe everywhere; outside code spans a backslash
    before ASCII punctuation escapes it and ``<br>`` is a line break."""
    raw = raw.replace("\\|", "|")
    out, i = "", 0
    while i < len(raw):
        if raw[i] == "`":
            end = raw.find("`", i + 1)
            if end > 0:
                out += raw[i : end + 1]
                i = end + 1
                continue
        if raw[i] == "\\" and i + 1 < len(raw) and raw[i + 1] in string.punctuation:
            out += raw[i + 1]
            i += 2
        elif raw.startswith("<br>", i):
            out += "\n"
            i += 4
        else:
            out += raw[i]
            i += 1
    return out


def _table(text: str) -> list[list[str]]:
    """The shown cells of the first table in ``text``: header row, then body rows (the
    delimiter row dropped); every row must have as many cells as the header."""
    lines = text.splitlines()
    first = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    block = []
    for ln in lines[first:]:
        if not ln.startswith("|"):
            break
        block.append(ln)
    rows = [[_shown(c) for c in _split_row(ln)] for ln in block]
    assert set("".join(block[1])) <= set("|-: "), block[1]
    for row in rows:
        assert len(row) == len(rows[0]), (rows[0], row)
    return [rows[0], *rows[2:]]


def _expected(name: str) -> str:
    """What a name shows as: line breaks as one, other control characters escaped."""
    return name.replace("\r\n", "\n").replace("\x1b", "\\x1b")


@pytest.mark.parametrize("name", NAMES)
def test_a_cell_reads_back_as_the_name(name: str) -> None:
    (row,) = _table(f"| name | n |\n|---|---|\n| {markdown_cell(name)} | 1 |\n")[1:]
    assert row == [_expected(name), "1"]


def test_sim_results_md(tmp_path: Path) -> None:
    from pcframe.sim.app_config import write_outputs

    rows = [{"trace": f"{n} (2 vms)", "label": n, "goodput_ratio": 0.5} for n in NAMES]
    output = SimpleNamespace(csv="results.csv", markdown="results.md", plots=False)
    write_outputs(rows, tmp_path, output, header="pcframe-sim traces=x")
    body = _table((tmp_path / "results.md").read_text())[1:]
    assert [r[:2] for r in body] == [[f"{_expected(n)} (2 vms)", _expected(n)] for n in NAMES]


def test_sim_pivot_table_headers() -> None:
    from pcframe.sim.report import pivot_table

    rows = [{"policy": "Daly", "trace": n, "goodput": 0.5} for n in NAMES]
    header, *body = _table(pivot_table(rows, "policy", "trace", "goodput"))
    assert header == ["policy", *map(_expected, NAMES)]
    assert body[0][0] == "Daly"


def test_traces_statistics_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pcframe.policies.traces.__main__ import main

    (tmp_path / "a|b.csv").write_text("# name: east|west\ntime,up\n0,1\n60,0\n120,1\n")
    (tmp_path / "c.csv").write_text("# source: src|x\ntime,up\n0,1\n60,1\n")
    assert main([str(tmp_path)]) == 0
    body = _table(capsys.readouterr().out)[1:]
    assert [r[:2] for r in body] == [["pcframe-csv", "east|west"], ["src|x", "c"]]


def test_run_sweep_summary(tmp_path: Path) -> None:
    from pcframe.apps.summary import merge_sweep

    for job, trace in enumerate(["a|b.csv", "c\nd.csv"]):
        folder = tmp_path / str(job)
        folder.mkdir()
        document = {
            "job": job,
            "overrides": [f"failure.trace={trace}"],
            "summary": {"steps": 10},
            "warnings": ["line one\nline two"],
        }
        (folder / "summary.json").write_text(json.dumps(document))
    merge_sweep(tmp_path)
    text = (tmp_path / "sweep_summary.md").read_text()
    header, *body = _table(text)
    column = header.index("failure.trace")
    assert [r[column] for r in body] == ["a|b.csv", "c\nd.csv"]
    assert "- job 0: line one line two" in text.splitlines()


def test_tune_trials_table() -> None:
    import optuna

    from pcframe.apps.tuning.report import trials_table

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study()
    for value in ("a|b", "c\nd"):
        study.enqueue_trial({"target": value})
        study.optimize(lambda t: len(t.suggest_categorical("target", ["a|b", "c\nd"])), n_trials=1)
    header, *body = _table(trials_table(study, ["overhead"]))
    column = header.index("target")
    assert sorted(r[column] for r in body) == ["a|b", "c\nd"]


def test_experiments_results_file_table() -> None:
    sys.path.insert(0, str(REPO / "experiments"))
    try:
        from results_file import table_lines
    finally:
        sys.path.remove(str(REPO / "experiments"))
    header, *body = _table("\n".join(table_lines(["|ΔL|", "x"], [[n, 1] for n in NAMES])))
    assert header == ["|ΔL|", "x"]
    assert [r[0] for r in body] == [_expected(n) for n in NAMES]


def _code_span(line: str) -> str:
    """The text of a line that is one inline code span, as CommonMark reads it: the
    opening backtick run, then the text up to the same run, one padding space each side
    dropped where both are there."""
    fence = line[: len(line) - len(line.lstrip("`"))]
    assert fence and line.endswith(fence) and len(line) > 2 * len(fence), line
    inner = line[len(fence) : -len(fence)]
    assert len(fence) not in map(len, re.findall("`+", inner)), line  # the span goes on
    if inner.startswith(" ") and inner.endswith(" ") and inner.strip():
        inner = inner[1:-1]
    return inner


@pytest.mark.parametrize("text", ["pcframe-sim traces=a", "a`b", "``x`", "x ``` y", "p\nq"])
def test_a_code_span_reads_back_on_one_line(text: str) -> None:
    from pcframe.text import markdown_code, one_line

    line = markdown_code(text)
    assert "\n" not in line
    assert _code_span(line) == one_line(text)


def test_the_sim_reports_command_stays_one_code_span(tmp_path: Path) -> None:
    """The command went in one backtick pair as it was: a trace path with a backtick ended
    the span, one with a newline put a '# ...' heading of its own into results.md."""
    from pcframe.sim.app_config import write_outputs

    output = SimpleNamespace(csv="results.csv", markdown="results.md", plots=False)
    header = "pcframe-sim 'traces=a`b\n# injected.csv'"
    write_outputs([{"trace": "t", "label": "x"}], tmp_path, output, header=header)
    lines = (tmp_path / "results.md").read_text().splitlines()
    assert [ln for ln in lines if ln.startswith("#")] == ["# pcframe-sim results"]
    assert _code_span(lines[2]) == "pcframe-sim 'traces=a`b # injected.csv'"


def test_the_run_sweeps_title_stays_one_line(tmp_path: Path) -> None:
    from pcframe.apps.summary import merge_sweep

    sweep = tmp_path / "a\n# b"
    (sweep / "0").mkdir(parents=True)
    document = {"job": 0, "overrides": [], "summary": {"steps": 1}}
    (sweep / "0" / "summary.json").write_text(json.dumps(document))
    merge_sweep(sweep)
    lines = (sweep / "sweep_summary.md").read_text().splitlines()
    assert [ln for ln in lines if ln.startswith("#")] == [lines[0]]
    assert lines[0].endswith("a # b")
