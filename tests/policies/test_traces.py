"""The trace loader over every shipped trace, its statistics, and its errors on bad input."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest

from pcframe.policies.traces import (
    ENV_VAR,
    Trace,
    TraceFormatError,
    detect_format,
    load_trace,
    load_traces,
    shared_traces_dir,
    trace_files,
)

REPO = Path(__file__).resolve().parents[2]


# --- every shipped trace ----------------------------------------------------------------------


def test_every_shipped_trace_loads_with_sane_statistics(traces_dir: Path) -> None:
    files = trace_files(traces_dir)
    assert len(files) >= 20, [f.name for f in files]  # 20 shipped; more may be added
    formats = {detect_format(f) for f in files}
    assert formats == {
        "skynomad-availability-csv",
        "skynomad-json",
        "bamboo-events",
        "pccheck-gpus",
    }
    for trace in load_traces(traces_dir):
        s = trace.stats()
        assert s.ticks > 100 and s.capacity >= 1, s
        assert 0.0 <= s.availability <= s.any_up_fraction <= 1.0, s
        assert s.preemptions >= 1, s  # every shipped trace has at least one drop
        assert s.mtbf == pytest.approx(trace.up_seconds() / s.preemptions)
        assert 0.1 * 3600 <= s.mtbf <= 400 * 3600, s  # between 6 minutes and ~2 weeks
        assert s.instance_mtbf >= 0.0 and s.hours == pytest.approx(s.ticks * s.step_seconds / 3600)


def test_v100_availability_csvs(traces_dir: Path) -> None:
    folder = traces_dir / "skynomad" / "aws-v100-availability-2023"
    prices = json.loads((traces_dir / "skynomad" / "aws-v100-spot-prices-2023.json").read_text())
    for path in sorted(folder.glob("*.csv")):
        t = load_trace(path)
        raw = np.loadtxt(path, delimiter=",", skiprows=1, usecols=1, dtype=int, converters={1: int})
        assert t.source == "skynomad-aws-v100-availability" and t.capacity == 1
        assert t.n_ticks == 20158 and t.step_seconds == pytest.approx(195.0, abs=1.0)
        assert np.array_equal(t.up, raw)
        assert t.availability() == pytest.approx(raw.mean())
        assert t.preemption_count() == int(((raw[:-1] == 1) & (raw[1:] == 0)).sum())
        assert t.spot_price is not None and np.allclose(t.spot_price, prices[path.stem])
        assert t.on_demand_price == 3.06 and t.zone == path.stem.split("_")[0]
        assert t.start_time == datetime(2023, 2, 15, 22, 8, 16, tzinfo=UTC)


def test_h100_inverted_convention(traces_dir: Path) -> None:
    for path in sorted((traces_dir / "skynomad" / "gcp-h100-16-2025").glob("*.json")):
        doc = json.loads(path.read_text())
        raw = np.asarray(doc["data"])  # 1 = preempted / unavailable
        t = load_trace(path)
        assert t.source == "skynomad-gcp-h100" and t.capacity == 1 and t.step_seconds == 600.0
        assert t.availability() == pytest.approx(1.0 - raw.mean())
        assert np.array_equal(t.up, 1 - raw)
        # a preemption is an available -> unavailable change, i.e. raw 0 -> 1
        assert t.preemption_count() == int(((raw[:-1] == 0) & (raw[1:] == 1)).sum())
        price = doc["metadata"]["price_info"]
        assert t.spot_price is not None and t.spot_price[0] == price["price"]
        assert t.on_demand_price == price["on_demand_price"]
        assert t.zone == doc["metadata"]["zone"] and t.start_time is not None
    # ... and reading one with the other convention gives the complement
    up = load_trace(path, convention="up")
    assert up.availability() == pytest.approx(raw.mean())


def test_h100_and_v100_regimes_differ(traces_dir: Path) -> None:
    v100 = load_traces(traces_dir / "skynomad" / "aws-v100-availability-2023")
    h100 = load_traces(traces_dir / "skynomad" / "gcp-h100-16-2025")
    assert np.median([t.mtbf() for t in h100]) > 1.5 * np.median([t.mtbf() for t in v100])
    assert np.mean([t.availability() for t in h100]) > np.mean([t.availability() for t in v100])


def test_v100_node_count_traces(traces_dir: Path) -> None:
    for folder, cap in (("aws-v100-4node-preemption-2023", 4), ("aws-v100-16node-2023", 16)):
        path = next((traces_dir / "skynomad" / folder).glob("*.json"))
        raw = np.asarray(json.loads(path.read_text())["data"])
        t = load_trace(path)
        assert t.capacity == cap and t.step_seconds == 300.0 and np.array_equal(t.up, raw)
        drops = np.maximum(raw[:-1] - raw[1:], 0)
        assert t.preemption_count() == int((drops > 0).sum())
        assert t.instances_lost() == drops.sum()
        assert t.availability() == pytest.approx(raw.mean() / cap)


def test_bamboo_event_traces(traces_dir: Path) -> None:
    for name, cap in (("p3-trace.csv", 32), ("g4dn-trace.csv", 24)):
        path = traces_dir / "bamboo" / name
        rows = list(csv.reader(path.open()))
        t = load_trace(path)
        assert t.capacity == cap and t.step_seconds == 60.0
        assert t.n_ticks == int(rows[-1][0]) // 60000 + 1
        assert t.instances_lost() == sum(r[1] == "remove" for r in rows)
        assert t.up[-1] == sum(r[1] == "add" for r in rows) - sum(r[1] == "remove" for r in rows)


def test_a_bamboo_node_lost_and_back_within_one_tick_is_a_preemption(tmp_path: Path) -> None:
    """Events between two ticks were sampled at the next tick only: a node removed and added
    back within a minute (or replaced at the same instant) vanished, with its preemption
    (a held-out trace read 1 preemption of 3, MTBF 7260 s for 2420 s)."""
    events = [
        (0, "add", "a"), (0, "add", "b"),
        (61_000, "remove", "a"), (62_000, "add", "a"),  # within one tick
        (600_000, "remove", "b"), (600_000, "add", "c"),  # replaced at the same instant
        (900_000, "remove", "a"), (960_000, "add", "a"),  # on whole minutes, as shipped
        (7_200_000, "add", "d"),
    ]  # fmt: skip
    path = tmp_path / "events.csv"
    path.write_text("".join(f"{ms},{what},{node}\n" for ms, what, node in events))
    t = load_trace(path, format="bamboo-events")
    assert t.preemption_count() == 3 and t.instances_lost() == 3
    assert list(t.up[[0, 1, 2, 10, 11, 15, 16, 120]]) == [2, 1, 2, 1, 2, 1, 2, 3]


def test_a_count_json_is_read_as_counts_and_every_guess_is_said(tmp_path: Path, caplog) -> None:
    """A GCP fleet of 8 VMs with prices was refused as an "inverted" trace (with a fix the
    simulator could not apply); a 4-VM file never all up read as 3 VMs without a word; a
    0/1 file without the H100 collector's marks is read as 1 = up, and says so."""
    fleet = tmp_path / "us-west1-a_fleet.json"
    fleet.write_text(json.dumps({"metadata": {"gap_seconds": 600, "price_info": {"price": 2.0}},
                                 "data": [8, 8, 6, 8, 3, 8]}))  # fmt: skip
    with caplog.at_level("WARNING", logger="pcframe"):
        t = load_trace(fleet)
    assert t.capacity == 8 and t.preemption_count() == 2 and t.spot_price[0] == 2.0
    assert "taken as the most VMs ever up, 8" in caplog.text
    assert load_trace(fleet, capacity=10).capacity == 10
    given = tmp_path / "four.json"
    given.write_text(json.dumps({"metadata": {"gap_seconds": 600, "capacity": 4}, "data": [3, 2]}))
    assert load_trace(given).capacity == 4
    ambiguous = tmp_path / "me-central2-a_h100_16.json"
    ambiguous.write_text(json.dumps({"metadata": {"gap_seconds": 600}, "data": [0, 0, 1, 0]}))
    caplog.clear()
    with caplog.at_level("WARNING", logger="pcframe"):
        assert list(load_trace(ambiguous).up) == [0, 0, 1, 0]
    assert "convention='inverted'" in caplog.text
    assert list(load_trace(ambiguous, convention="inverted").up) == [1, 1, 0, 1]


def test_a_damaged_price_table_is_named_not_the_trace(tmp_path: Path) -> None:
    trace = tmp_path / "eu-west-1b_v100_1.csv"
    trace.write_text("date,availability\n2024-01-01 00:00:00,1\n2024-01-01 00:10:00,1\n")
    table = tmp_path / "spot-prices.json"
    table.write_text('{"eu-west-1b_v100_1": [1.0, }')
    with pytest.raises(TraceFormatError, match=r"spot-prices.json:line 1 column 29: the price"):
        load_trace(trace)
    table.write_text('{"eu-west-1b_v100_1": [1.0, null]}')
    with pytest.raises(TraceFormatError, match=r"\[1\] of .*price None is not a number"):
        load_trace(trace)
    other = tmp_path / "b-price.json"  # a second table, the one holding this trace
    table.write_text('{"elsewhere": [1.0, 2.0]}')
    other.write_text('{"eu-west-1b_v100_1": [1.5, 2.5]}')
    assert list(load_trace(trace).spot_price) == [1.5, 2.5]


def test_a_price_table_that_is_not_a_regular_file_is_skipped_not_read(tmp_path: Path) -> None:
    """A FIFO named like a price table beside an availability CSV (or in the folder above it)
    blocked load_trace for ever, and a folder of that name was a raw IsADirectoryError."""
    import os
    import subprocess
    import sys

    trace = tmp_path / "zone" / "eu-west-1b_v100_1.csv"
    trace.parent.mkdir()
    trace.write_text("date,availability\n2024-01-01 00:00:00,1\n2024-01-01 00:10:00,1\n")
    os.mkfifo(trace.parent / "spot-prices.json")
    (tmp_path / "old-prices.json").mkdir()
    (tmp_path / "loop-price.json").symlink_to(tmp_path / "loop-price.json")
    # In a child: a FIFO read blocks the whole process, so a timeout is the only way out.
    code = "from pcframe.policies.traces import load_trace; import sys; " + (
        f"t = load_trace({str(trace)!r}); print(t.n_ticks, t.spot_price)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["2", "None"]


def test_pccheck_gpu_trace(traces_dir: Path) -> None:
    path = traces_dir / "pccheck" / "gpus_trace.csv"
    t = load_trace(path)
    gpus = np.loadtxt(path, delimiter=",", skiprows=1, usecols=2)
    assert t.unit == "gpu" and t.units_per_vm == 4 and t.capacity == 56
    assert t.step_seconds == pytest.approx(63.0)
    assert t.instances_lost() == np.maximum(gpus[:-1] - gpus[1:], 0).sum() / 4
    assert t.start_time is not None and t.start_time.year == 2022


def test_shipped_copy_keeps_licences() -> None:
    root = REPO / "experiments" / "traces"
    if not root.is_dir():
        pytest.skip("experiments/traces is not in this checkout")
    for folder, files in (
        ("skynomad", ("LICENSE", "NOTICE")),
        ("bamboo", ("LICENSE",)),
        ("pccheck", ("LICENSE",)),
    ):
        for f in files:
            assert (root / folder / f).is_file(), f"{folder}/{f} must ship with the traces"


# --- locating the traces ------------------------------------------------------------------------


def test_shared_traces_dir_prefers_env_then_repo_copy(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    found = shared_traces_dir()
    if (REPO / "experiments" / "traces").is_dir():
        assert found == REPO / "experiments" / "traces"
    monkeypatch.setenv(ENV_VAR, str(tmp_path))
    assert shared_traces_dir() == tmp_path
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match=ENV_VAR):
        shared_traces_dir()


def test_trace_files_skip_licences_and_price_tables(traces_dir: Path) -> None:
    names = {p.name for p in trace_files(traces_dir)}
    assert "LICENSE" not in names and "README.md" not in names
    assert "aws-v100-spot-prices-2023.json" not in names


# --- users' own traces --------------------------------------------------------------------------


def test_json_round_trip(tmp_path: Path) -> None:
    t = Trace(
        "mine",
        "user",
        60.0,
        4,
        np.array([4, 3, 4, 0, 2]),
        spot_price=[1.0] * 5,
        on_demand_price=3.0,
        start_time=datetime(2025, 1, 1, tzinfo=UTC),
        zone="z",
    )
    back = load_trace(t.save_json(tmp_path / "mine.json"))
    assert detect_format(tmp_path / "mine.json") == "pcframe-json"
    assert np.array_equal(back.up, t.up) and back.capacity == 4 and back.zone == "z"
    assert back.start_time == t.start_time and back.spot_price is not None
    assert back.preemption_count() == 2 and back.instances_lost() == 5


def test_pcframe_csv_with_header_comments(tmp_path: Path) -> None:
    path = tmp_path / "fleet.csv"
    path.write_text(
        "# capacity: 8\n# on_demand_price: 2.5\n# zone: eu-1\n"
        "time,up,spot_price\n"
        "2025-01-01T00:00:00Z,8,0.9\n2025-01-01T00:05:00Z,6,0.9\n"
        "2025-01-01T00:10:00Z,8,1.1\n"
    )
    t = load_trace(path)
    assert (t.capacity, t.step_seconds, t.on_demand_price, t.zone) == (8, 300.0, 2.5, "eu-1")
    assert t.preemption_count() == 1 and t.mtbf() == pytest.approx(900.0)
    assert t.start_time == datetime(2025, 1, 1, tzinfo=UTC)


def test_trace_helpers() -> None:
    t = Trace("x", "t", 10.0, 2, np.array([2, 2, 0, 0, 1, 2, 1]))
    assert list(t.preemption_ticks()) == [2, 6]
    assert t.preempted_at(2) and not t.preempted_at(3) and not t.preempted_at(0)
    assert t.up_seconds() == 50.0 and t.mtbf() == 25.0
    assert t.availability() == pytest.approx(8 / 14)
    assert t.instance_mtbf() == pytest.approx(80.0 / 3)
    assert math.isinf(Trace("c", "t", 1.0, 1, np.ones(3, dtype=int)).mtbf())
    with pytest.raises(IndexError):
        t.preempted_at(7)
    with pytest.raises(ValueError, match=r"\[0, capacity=2\]"):
        Trace("bad", "t", 1.0, 2, np.array([3]))


# --- malformed input: the error names the file, the place and the fix -----------------------------


def _err(path: Path, **kw: object) -> str:
    with pytest.raises(TraceFormatError) as info:
        load_trace(path, **kw)  # type: ignore[arg-type]
    msg = str(info.value)
    assert str(path) in msg and "Fix:" in msg, msg
    return msg


def test_malformed_inputs(tmp_path: Path) -> None:
    p = tmp_path / "a_v100_1.csv"
    p.write_text("date,availability\n2023-01-01 00:00:00,1\n2023-01-01 00:03:15,2\n")
    assert "line 3" in _err(p) and "0 or 1" in _err(p)

    p = tmp_path / "b_h100_16.json"
    p.write_text(json.dumps({"metadata": {"gap_seconds": 600, "gap_filled": 0}, "data": [0, 1, 5]}))
    assert "inverted" in _err(p)

    p = tmp_path / "c.json"
    p.write_text(json.dumps({"metadata": {}, "data": [1, 2]}))
    assert "metadata.gap_seconds" in _err(p)

    p = tmp_path / "d.json"
    p.write_text(json.dumps({"metadata": {"gap_seconds": 300}, "data": [1, -2]}))
    assert "data[1]" in _err(p)

    p = tmp_path / "e.json"
    p.write_text(json.dumps({"metadata": {"gap_seconds": 300}, "data": [1, 4]}))
    assert "capacity" in _err(p, capacity=2)

    p = tmp_path / "f.csv"
    p.write_text("0,add,node1\n60000,remove,node1\n120000,remove,node1\n")
    msg = _err(p)
    assert "line 3" in msg and "not up" in msg

    p = tmp_path / "g.csv"
    p.write_text("time,up\n0,1\n60,1\n30,0\n")
    msg = _err(p)
    assert "line 4" in msg and "strictly increasing" in msg

    p = tmp_path / "h.csv"
    p.write_text("foo;bar\n1;2\n")
    assert "unknown trace format" in _err(p)

    p = tmp_path / "i.json"
    p.write_text('{"metadata": {"gap_seconds": 300}, "data": [1, 2,]}')
    msg = _err(p)
    assert "invalid JSON" in msg and "line 1" in msg

    p = tmp_path / "prices.json"
    p.write_text(json.dumps({"zone_v100_1": [1.0, 2.0]}))
    assert "price table" in _err(p)

    p = tmp_path / "j.json"
    p.write_text(json.dumps({"format": "pcframe-trace/1", "step_seconds": 60, "capacity": 2}))
    assert "'up'" in _err(p)

    p = tmp_path / "k.csv"
    p.write_text("time,up\n0,1\n60,x\n")
    assert "line 3" in _err(p)


@pytest.mark.parametrize(
    ("name", "content", "words"),
    [
        ("binary.csv", b"\x89PNG\r\n\x1a\n\x00\x00", "not UTF-8 text"),
        ("binary.json", b"\xff\xfe{\x00", "not UTF-8 text"),
        ("huge.json", b'{"metadata": {"gap_seconds": 60}, "data": [1, 99999999999999999999]}',
         "too large"),
        ("gap_null.json", b'{"metadata": {"gap_seconds": null}, "data": [1, 0]}',
         "'metadata.gap_seconds': None is not a number"),
        # an AttributeError, reported as "unexpected error (a bug)"; now named
        ("h100_pi.json",
         b'{"metadata": {"gap_seconds": 600, "price_info": [1, 2]}, "data": [0, 1]}',
         "metadata.price_info"),
        # 1e20 ms: one tick per minute of it would be petabytes; refused before allocating
        ("events.csv", b"0,add,node1\n100000000000000000000,remove,node1\n", "100 years"),
        # 3e12 ms (95 years) is under that, but 50 million minutes took 2.6 GB to resample
        ("events_95y.csv", b"0,add,node1\n3000000000000,remove,node1\n", "at most 10,000,000"),
    ],
    ids=lambda v: v if isinstance(v, str) and "." in v else None,
)  # fmt: skip
def test_unreadable_files_are_one_format_error_naming_the_file(tmp_path, name, content, words):
    """Each was a raw UnicodeDecodeError, OverflowError, TypeError or MemoryError."""
    p = tmp_path / name
    p.write_bytes(content)
    with pytest.raises(TraceFormatError) as info:
        load_trace(p)
    assert str(p) in str(info.value) and words in str(info.value)


def test_a_file_named_h100_is_not_read_inverted_without_price_info(tmp_path: Path) -> None:
    """Before, the name alone made a user's own up-count file read as 1 = preempted."""
    doc = {"metadata": {"gap_seconds": 600}, "data": [1, 1, 1, 0, 1]}
    (tmp_path / "my_h100_up.json").write_text(json.dumps(doc))
    assert load_trace(tmp_path / "my_h100_up.json").up.tolist() == [1, 1, 1, 0, 1]


def test_units_per_vm_must_be_a_whole_number_of_gpus() -> None:
    with pytest.raises(ValueError, match=r"units_per_vm=0 must be a whole number >= 1"):
        Trace(name="t", source="x", step_seconds=60.0, capacity=1, up=np.ones(3), units_per_vm=0)


def test_times_the_simulator_would_misplace_are_refused(tmp_path: Path) -> None:
    """Ticks are placed by count: a 10 h gap in 60 s rows silently vanished from the results,
    NaN times slipped past the ordering check, 1e300 s steps hung the simulator."""
    rows = [(60 * i, 1 - (i // 7) % 2) for i in range(40)]
    p = tmp_path / "gap.csv"
    p.write_text(
        "time,up\n"
        + "".join(f"{t + (36000 if i >= 20 else 0)},{u}\n" for i, (t, u) in enumerate(rows))
    )
    msg = _err(p)
    assert "line 22" in msg and "36060 s after the row before" in msg and "60 s apart" in msg
    p = tmp_path / "burst.csv"  # a second row in one step adds time the same way
    p.write_text("time,up\n" + "".join(f"{t},{u}\n" for t, u in rows[:10]) + "545,1\n600,1\n")
    assert "line 12" in _err(p)
    jitter = tmp_path / "jitter.csv"  # what the real collectors do: accepted
    jitter.write_text(
        "time,up\n" + "".join(f"{t + (i % 3) * 5},{u}\n" for i, (t, u) in enumerate(rows))
    )
    assert load_trace(jitter).n_ticks == 40
    for bad, line in (("nan", "line 3"), ("inf", "line 3")):
        p = tmp_path / f"{bad}.csv"
        p.write_text(f"time,up\n0,1\n{bad},1\n120,0\n")
        msg = _err(p)
        assert line in msg and "not finite" in msg, msg
    p = tmp_path / "huge.csv"
    p.write_text("time,up\n0,1\n1e300,0\n2e300,1\n")
    assert "step_seconds=1e+300" in _err(p)
    p = tmp_path / "price.json"
    doc = {"format": "pcframe-trace/1", "step_seconds": 60, "capacity": 1, "up": [1, 0]}
    p.write_text(json.dumps({**doc, "on_demand_price": "abc"}))
    assert "on_demand_price='abc' is not a number" in _err(p)
    p = tmp_path / "bom.csv"  # saved by a spreadsheet: a byte-order mark before the header
    p.write_bytes("\ufefftime,up\n0,1\n60,0\n".encode())
    assert load_trace(p).n_ticks == 2


def test_price_table_length_mismatch(tmp_path: Path) -> None:
    folder = tmp_path / "avail"
    folder.mkdir()
    p = folder / "z_v100_1.csv"
    p.write_text("date,availability\n2023-01-01 00:00:00,1\n2023-01-01 00:03:15,0\n")
    (tmp_path / "spot-prices.json").write_text(json.dumps({"z_v100_1": [1.0, 1.0, 1.0]}))
    msg = _err(p)
    assert "3 prices for 2" in msg


def test_statistics_table_cli(traces_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pcframe.policies.traces.__main__ import main

    assert main([str(traces_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 + len(trace_files(traces_dir))
    assert any("us-central1-a_h100_16" in ln and "| 0.958 |" in ln for ln in lines)


_OWN_FORMS = {
    "csv": ("t.csv", "time,up\n0,2\n60,1\n120,2\n"),
    "csv with # capacity": ("t.csv", "# capacity: 4\ntime,up\n0,2\n60,1\n120,2\n"),
    "json": ("t.json", '{"format": "pcframe-trace/1", "step_seconds": 60, "capacity": 3, '
             '"up": [2, 1, 2]}'),
}  # fmt: skip


@pytest.mark.parametrize("form", list(_OWN_FORMS))
def test_a_capacity_given_is_honoured_by_pcframes_own_forms(tmp_path: Path, form: str) -> None:
    """capacity= (pcframe-sim's trace_options.capacity) was silently ignored for pcframe's
    CSV and JSON, though honoured for the node-count and event traces: the simulated job
    then asked for the file's VMs, not the ones given."""
    name, text = _OWN_FORMS[form]
    path = tmp_path / name
    path.write_text(text)
    assert load_trace(path, capacity=8).capacity == 8
    assert load_trace(path).capacity == {"csv": 2, "csv with # capacity": 4, "json": 3}[form]
    msg = _err(path, capacity=1)
    assert msg.startswith(f"{path}:capacity=1: ") and "up-count 2" in msg, msg
    assert "trace_options.capacity" in msg and "\n" not in msg


def test_a_capacity_given_below_an_event_trace_names_the_option(traces_dir: Path) -> None:
    """It said 'Fix: correct the file's times or values' of a shipped file."""
    msg = _err(traces_dir / "pccheck" / "gpus_trace.csv", capacity=8)
    assert ":capacity=8: " in msg and "leave it out to use the file's" in msg, msg


def _bad_argument(tmp_path: Path, kind: str) -> tuple[str, str]:
    """A command-line argument of ``kind`` and a piece of text its error line must hold."""
    if kind == "missing file":
        return str(tmp_path / "nope.csv"), "nope.csv"
    if kind == "trace name":
        return "us-east-1a_v100_1", "us-east-1a_v100_1"
    if kind == "empty folder":
        (tmp_path / "empty").mkdir()
        return str(tmp_path / "empty"), "empty"
    if kind == "malformed csv":
        (tmp_path / "bad.csv").write_text("time,up\n0,1\n60,many\n")
        return str(tmp_path / "bad.csv"), "bad.csv:line 3"
    if kind == "unknown format":
        (tmp_path / "odd.csv").write_text("hello,world\n")
        return str(tmp_path / "odd.csv"), "odd.csv:line 1"
    if kind == "folder with a bad file":
        (tmp_path / "d").mkdir()
        (tmp_path / "d" / "ok.csv").write_text("time,up\n0,1\n60,0\n")
        (tmp_path / "d" / "broken.json").write_text('{"format": "pcframe-trace/1"')
        return str(tmp_path / "d"), "broken.json"
    if kind == "newline in the name":
        return str(tmp_path / "a\nb.csv"), "a\\nb.csv"
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind",
    [
        "missing file",
        "trace name",
        "empty folder",
        "malformed csv",
        "unknown format",
        "folder with a bad file",
        "newline in the name",
    ],
)
def test_statistics_cli_bad_argument_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    """``python -m pcframe.policies.traces BAD`` printed a traceback: now one line on stderr
    naming the argument (or the file in it) and the fix, and a non-zero status."""
    from pcframe.policies.traces.__main__ import main

    arg, named = _bad_argument(tmp_path, kind)
    assert main([arg]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and named in err, err
    assert any(w in err for w in ("pass ", "Fix: ")), err


@pytest.mark.parametrize("argv", [["a", "b"], ["--bogus"]])
def test_statistics_cli_wrong_command_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from pcframe.policies.traces.__main__ import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "usage:" in err


def test_statistics_cli_runs_as_a_module(tmp_path: Path) -> None:
    """The module entry point itself: the status and one line, no traceback."""
    done = subprocess.run(
        [sys.executable, "-m", "pcframe.policies.traces", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "missing" in done.stderr, done.stderr


@pytest.mark.parametrize("dropped", [("price_info",), ("price_info", "gap_filled")])
def test_an_h100_file_without_its_price_is_still_read_inverted(
    traces_dir: Path, tmp_path: Path, dropped: tuple[str, ...]
) -> None:
    """A held-out H100 zone whose collector failed to fetch the price (no ``price_info``)
    was read as an up-count: its availability upside down, recoveries counted as
    preemptions. The collector's other marks (``gap_filled``, ``source_dir``) still tell."""
    path = sorted((traces_dir / "skynomad" / "gcp-h100-16-2025").glob("*.json"))[0]
    doc = json.loads(path.read_text())
    for key in dropped:
        del doc["metadata"][key]
    copy = tmp_path / path.name
    copy.write_text(json.dumps(doc))
    raw = np.asarray(doc["data"])
    assert np.array_equal(load_trace(copy).up, 1 - raw)


@pytest.mark.parametrize(
    ("name", "text", "words"),
    [
        (
            "ms.csv",
            "time,up\n" + "".join(f"{1_700_000_000_000 + 60_000 * i},1\n" for i in range(5)),
            "milliseconds",
        ),
        ("nan.csv", "time,up,spot_price\n0,1,0.5\n60,1,nan\n120,1,0.5\n", "line 3"),
        ("neg.csv", "time,up,spot_price\n0,1,0.5\n60,1,-2\n120,1,0.5\n", "line 3"),
    ],
)
def test_csv_times_in_milliseconds_and_bad_prices_are_refused(
    tmp_path: Path, name: str, text: str, words: str
) -> None:
    """Millisecond times read as seconds made 100 rows 69 days; a NaN or negative price
    loaded and failed later in the simulator, by tick instead of line."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(TraceFormatError, match=words):
        load_trace(path)


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"capacity": 2.7}, "capacity"),
        ({"units_per_vm": 2.5}, "units_per_vm"),
        ({"up": [True, False, True]}, "up"),
        ({"spot_price": [1.0, None, 1.0]}, "spot_price"),
        ({"spot_price": [1.0, -1.0, 1.0]}, "spot_price"),
    ],
)
def test_json_values_are_not_truncated_or_coerced(tmp_path: Path, change: dict, key: str) -> None:
    doc = {
        "format": "pcframe-trace/1",
        "step_seconds": 60,
        "capacity": 2,
        "up": [1, 0, 2],
        **change,
    }
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(TraceFormatError, match=key):
        load_trace(path)


@pytest.mark.parametrize(
    ("name", "text", "where"),
    [
        ("ms.csv", ",Time,GPUs\n0,1700000000250,8\n1,1700000060250,8\n", ":line 2: time"),
        ("cap.csv", "# capacity: 8.5\ntime,up\n0,1\n60,1\n", ":# capacity: '8.5' is not"),
        ("gap.json", '{"metadata": {"gap_seconds": null}, "data": [1]}', "metadata.gap_seconds"),
        ("meta.json", '{"format": "pcframe-trace/1", "step_seconds": 60, "capacity": 1, '
         '"up": [1, 1], "metadata": [1]}', "key 'metadata'"),
        ("step.json", '{"format": "pcframe-trace/1", "step_seconds": true, "capacity": 1, '
         '"up": [1, 1]}', "key 'step_seconds': True"),
    ],
)  # fmt: skip
def test_a_bad_value_is_named_where_it_is(tmp_path: Path, name: str, text: str, where: str):
    """Each gave a message naming no line or key ("year 55840 is out of range", "invalid
    literal for int()", "float() argument must be...") or, for step_seconds: true, was read
    as 1 s ticks."""
    path = tmp_path / name
    path.write_text(text)
    assert where in _err(path)


def test_an_availability_csv_ending_in_a_whitespace_line_loads(tmp_path: Path) -> None:
    path = tmp_path / "zone_v100_1.csv"
    path.write_text("date,availability\n2024-01-01 00:00:00,1\n2024-01-01 00:10:00,0\n  \n")
    assert list(load_trace(path, prices=None).up) == [1, 0]
