"""``pcframe-sim`` as users run it: the real console script, real Hydra, files on disk."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from pcframe.errors import SimConfigError
from pcframe.sim.app_config import cases_from_config, register_schemas, select_traces

SMALL = "pccheck/gpus_trace.csv"  # 3.8 h, 26 drops: quick


def _script() -> list[str]:
    exe = Path(sys.executable).with_name("pcframe-sim")
    assert exe.exists(), "pcframe-sim is not installed: pip install -e . --no-deps"
    return [str(exe)]


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


@pytest.mark.slow
def test_one_run_writes_csv_markdown_and_plots(tmp_path: Path, child_env: dict) -> None:
    out = tmp_path / "run"
    proc = subprocess.run(
        [*_script(), f"traces={SMALL}", "policy/interval=young", f"hydra.run.dir={out}"],
        cwd=tmp_path,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(out / "results.csv")
    assert [r["label"] for r in rows] == ["Young", "oracle", "best_fixed"]
    assert all(r["trace"] == "gpus_trace (56 gpus)" for r in rows)
    goodput = {r["label"]: float(r["goodput"]) for r in rows}
    assert goodput["oracle"] >= max(goodput.values())
    assert (out / "results.md").read_text().count("| gpus_trace (56 gpus) |") == 3
    for png in ("goodput.png", "breakdown.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def _sweep(sweep: Path, child_env: dict, *overrides: str) -> list[dict]:
    """A ``pcframe-sim -m`` sweep over the small trace into ``sweep``; its rows."""
    proc = subprocess.run(
        [*_script(), "-m", f"traces={SMALL}", *overrides, "baselines=[]",
         f"hydra.sweep.dir={sweep}"],
        cwd=sweep.parent,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _rows(sweep / "sweep_results.csv")


def test_a_multirun_sweep_is_merged_into_one_table(tmp_path: Path, child_env: dict) -> None:
    sweep = tmp_path / "sweep"
    rows = _sweep(sweep, child_env, "policy/interval=young,checkfreq", "sim.job.save_stall=2,8")
    assert sorted((r["label"], r["p_save_stall"]) for r in rows) == [
        ("CheckFreq", "2"),
        ("CheckFreq", "8"),
        ("Young", "2"),
        ("Young", "8"),
    ]
    assert (sweep / "sweep_results.md").exists() and (sweep / "goodput.png").exists()


@pytest.mark.slow
def test_a_sweep_with_null_for_the_placement_runs_it_without_one(
    tmp_path: Path, child_env: dict
) -> None:
    """conf/sim.yaml documents policy/placement: null (no placement); on the command line
    Hydra refused it with a ValueError traceback, in a sweep once the other jobs had run."""
    rows = _sweep(
        tmp_path / "sweep", child_env, "policy/placement=null,single_tier", "output.plots=false"
    )
    assert sorted(r["placement_policy"] for r in rows) == ["", "single_tier"]


@pytest.mark.parametrize(
    ("value", "placed"),
    [("null", False), ("NULL", False), ("none", False), ("single_tier", True)],
)
def test_null_for_the_placement_composes_to_no_placement(value: str, placed: bool) -> None:
    """policy/placement=null (the documented default) was Hydra's ValueError traceback."""
    from pcframe.apps.compose import compose_config

    cfg = compose_config("sim", [f"policy/placement={value}", f"traces={SMALL}"])
    (case, *_) = cases_from_config(cfg, select_traces(cfg.traces))
    assert (case.placement is not None) == placed
    assert ("placement" in cfg.policy) == placed


def test_null_in_a_sweep_list_is_read_as_no_placement() -> None:
    from pcframe.apps.errors import APP_GROUPS
    from pcframe.apps.nulls import read_nulls

    argv = ["-m", "policy/placement=null,single_tier", "+sim/predictor=ewma,null", "label=null"]
    assert read_nulls(argv, "sim", APP_GROUPS["sim"]) == [
        "-m",
        "policy/placement=none,single_tier",
        "+sim/predictor=ewma,none",
        "label=null",  # a key, not a group: Hydra's null as ever
    ]


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("policy/interval=null", "policy/interval cannot be left out in pcframe-sim"),
        ("policy/interval=young,null", "choose one of checkfreq, daly"),
        ("policy/placement=[null]", "takes null only as a plain value"),
    ],
)
def test_null_where_a_group_needs_a_value_is_one_line_naming_it(
    override: str, words: str, tmp_path: Path, monkeypatch, capsys
) -> None:
    """Refused before Hydra starts (nothing composed, nothing run): exit 2, one line."""
    from pcframe.apps.sim import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["pcframe-sim", override, f"traces={SMALL}"])
    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"pcframe-sim: error: {override}: "), err
    assert words in err, err
    assert not any(tmp_path.iterdir()), "nothing was run"


def _sim_small(tmp_path: Path, child_env: dict, *overrides: str) -> subprocess.CompletedProcess:
    """``pcframe-sim`` on the small trace with ``overrides``, run in ``tmp_path``."""
    return subprocess.run(
        [*_script(), f"traces={SMALL}", *overrides, f"hydra.run.dir={tmp_path}"],
        cwd=tmp_path,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_bad_key_fails_with_the_key_in_the_message(tmp_path: Path, child_env: dict) -> None:
    proc = _sim_small(tmp_path, child_env, "+sim.job.stal=3")
    assert proc.returncode != 0
    assert "stal" in proc.stderr


def test_an_output_that_cannot_be_written_fails_before_the_simulations(
    tmp_path: Path, child_env: dict
) -> None:
    """A raw ``FileNotFoundError`` ("unexpected error (a bug)") once the runs were done."""
    proc = _sim_small(tmp_path, child_env, "output.csv=/proc/x/r.csv")
    assert proc.returncode == 2, proc.stderr
    assert "output.csv='/proc/x/r.csv': cannot make /proc/x" in proc.stderr
    assert "Traceback" not in proc.stderr and "a bug" not in proc.stderr
    os.mkfifo(tmp_path / "pipe")  # it blocked once every simulation had run
    proc = _sim_small(tmp_path, child_env, f"output.csv={tmp_path}/pipe")
    assert proc.returncode == 2 and "exists and is not a regular file" in proc.stderr


def _compose(*overrides: str):
    register_schemas()
    with initialize_config_module("pcframe.conf", version_base="1.3"):
        return compose("sim", overrides=list(overrides))


def test_composed_config_builds_one_case_per_trace_and_baseline() -> None:
    cfg = _compose("traces=skynomad/gcp-h100-16-2025/us-east4-*.json", "sim/job=h100_llm")
    traces = select_traces(cfg.traces)
    cases = cases_from_config(cfg, traces)
    assert [c.label for c in cases] == ["Daly", "oracle", "best_fixed"] * 2
    assert cases[0].job.notice_window == 30.0 and cases[0].job.iteration_time == 2.0


def test_trace_options_reach_the_loader_and_are_checked(tmp_path: Path) -> None:
    """The loader's fixes (convention=, capacity=) could not be given to pcframe-sim."""
    from pcframe.sim.app_config import trace_options

    trace = tmp_path / "zone-a_h100_16.json"
    trace.write_text(json.dumps({"metadata": {"gap_seconds": 600}, "data": [0, 1, 0, 0]}))
    cfg = _compose(f"traces={trace}", "trace_options.convention=inverted")
    (loaded,) = select_traces(cfg.traces, **trace_options(cfg.trace_options))
    assert list(loaded.up) == [1, 0, 1, 1]
    cfg = _compose(f"traces={trace}", "trace_options.capacity=3")
    (loaded,) = select_traces(cfg.traces, **trace_options(cfg.trace_options))
    assert loaded.capacity == 3
    own = tmp_path / "mine.csv"  # pcframe's own CSV: the option was silently ignored
    own.write_text("# capacity: 2\ntime,up\n0,2\n60,1\n")
    cfg = _compose(f"traces={own}", "trace_options.capacity=6")
    (loaded,) = select_traces(cfg.traces, **trace_options(cfg.trace_options))
    assert loaded.capacity == 6
    for override, message in (
        ("trace_options.convention=sideways", "give auto, up"),
        ("trace_options.capacity=0", "give the VMs the job asked for"),
        ("trace_options.step_seconds=-1", "give the seconds per tick"),
    ):
        with pytest.raises(SimConfigError, match=message):
            trace_options(_compose(override).trace_options)


def test_an_unknown_baseline_is_rejected_with_the_choices() -> None:
    cfg = _compose("baselines=[oracle,clairvoyant]")
    with pytest.raises(SimConfigError, match=r"unknown \['clairvoyant'\]; choose from"):
        cases_from_config(cfg, [])


@pytest.mark.slow
def test_terminal_table_fits_and_csv_is_plain(tmp_path: Path, child_env: dict) -> None:
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            *_script(),
            "traces=skynomad/gcp-h100-16-2025/*.json",  # long names: asia-southeast1-b_h100_16
            "baselines=[oracle]",
            "progress=false",
            "output.plots=false",
            f"hydra.run.dir={out}",
        ],
        cwd=tmp_path,
        env={**child_env, "COLUMNS": "80"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with (out / "results.csv").open(newline="") as f:  # no comment line to skip
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames[:3] == ["trace", "source", "label"]
    traces = {r["trace"] for r in rows}
    assert len(traces) > 5
    table = [line for line in proc.stdout.splitlines() if line.startswith("│")]
    assert table and all(len(line) <= 80 for line in table)
    shown = {line.split("│")[1].strip() for line in table}
    assert shown == traces  # every name whole: the rows can be told apart
    assert "finished" not in proc.stdout.split("┃", 1)[1].split("\n", 1)[0]  # header row
    assert "preemptions that hit the job" in proc.stdout  # a legend under the table
    meta = json.loads((out / "results.meta.json").read_text())
    assert meta["command"].startswith("pcframe-sim traces=skynomad/gcp-h100-16-2025/*.json")
    assert "total_steps" in meta["columns"]["finished"]
    assert set(meta["columns"]) == set(reader.fieldnames)
    md = (out / "results.md").read_text()
    assert "Columns:" in md and "- goodput_ratio: goodput / the ideal" in md
    assert "| finished |" not in md  # no total_steps: a column of "no" says nothing


def test_a_policy_refusing_its_config_names_the_full_key_and_the_reason_once(tmp_path) -> None:
    """A history with no up-time: the error named only 'predictor' and printed the reason
    twice (Hydra's wrapper and its cause); now the key from the config's root, once."""
    down = tmp_path / "down.csv"
    down.write_text("time,up\n" + "".join(f"{60 * i},0\n" for i in range(10)))
    cfg = _compose(
        "policy/interval=preemption_aware",
        f"policy.interval.predictor.traces={down}",
        "baselines=[]",
    )
    traces = select_traces("skynomad/gcp-h100-16-2025/us-east4-a*.json")
    case = cases_from_config(cfg, traces)[0]
    with pytest.raises(SimConfigError) as info:
        case.interval(traces[0])
    message = str(info.value)
    assert message.startswith("policy.interval.predictor: ValueError: no up-time")
    assert "(down)" in message and message.count("no up-time") == 1


@pytest.mark.parametrize("label", ["Daly[mtbf=3600]", "x[/y]", "[bold]pa[/bold]"])
def test_labels_and_trace_names_are_shown_as_written_not_read_as_markup(label: str) -> None:
    """rich read table cells as markup: label='Daly[mtbf=3600]' was shown as 'Daly', and
    'x[/y]' ended pcframe-sim in a MarkupError traceback after the simulations had run."""
    from rich.console import Console

    from pcframe.apps.sim import print_table

    console = Console(width=200, record=True)
    print_table([{"trace": f"zone[{label}]", "label": label, "goodput_ratio": 0.5}], console)
    text = console.export_text()
    assert label in text and f"zone[{label}]" in text


def test_dollar_signs_in_names_are_plotted_as_text_not_mathtext(tmp_path: Path) -> None:
    """Text between two $ in a trace name or label was parsed as mathtext: a name like
    '$\\frac{$' ended pcframe-sim in a ParseException after the simulations had run."""
    from pcframe.sim.report import plot_breakdown, plot_grouped_bars

    rows = [
        {
            "trace": r"zone $\frac{$",
            "label": "Daly $a^$",
            "goodput_ratio": 0.5,
            "useful_hours": 1.0,
        },
        {"trace": "spot $1 to $2", "label": "x", "goodput_ratio": 0.7, "useful_hours": 2.0},
    ]
    assert plot_grouped_bars(rows, tmp_path / "g.png").stat().st_size > 0
    assert plot_breakdown(rows, tmp_path / "b.png").stat().st_size > 0
