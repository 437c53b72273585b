"""The validation replay's pieces (experiments/sim/validate_replay.py, issue 43 item 1).

The replay itself takes minutes; these check what decides whether its report can be trusted:
the calibration summary is robust (medians, spread from the median absolute deviation, the
load recorded), the child builds each policy the prediction builds, notices reach the child's
notice source before the kill, and the prediction runs the policy at every step.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import pcframe.policies as P
from pcframe.policies import FileNoticeSource
from pcframe.sim import JobSpec, SimConfigError, simulate

SIM = Path(__file__).resolve().parents[2] / "experiments" / "sim"
sys.path.insert(0, str(SIM))

import replay_child  # noqa: E402
import replay_setup as S  # noqa: E402
import validate_replay as V  # noqa: E402

CAL = {"stall": 0.004, "durable": 0.04, "iteration_time": 0.1}


def test_robust_takes_the_median_and_ignores_one_spike() -> None:
    # The previous calibration's four samples, one of them taken under a load spike.
    stats = S.robust([2.35, 2.40, 2.31, 4.77, 2.38])
    assert stats["median"] == 2.38
    assert stats["n"] == 5 and stats["max"] == 4.77
    assert stats["spread"] < 0.1  # the mean and the standard deviation would be 2.84 and 1.07
    assert math.isnan(S.robust([])["median"])


def test_load_probe_records_load_and_cpu_share() -> None:
    probe = S.LoadProbe()
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    load = probe.stop()
    assert set(load) == {
        "load_before",
        "load_after",
        "load",
        "cpu_share",
        "cpu_pressure",
        "io_pressure",
        "steal",
    }
    assert load["load_before"] >= 0 and load["load_after"] >= 0
    assert 0 < load["cpu_share"] <= 2.5
    for key in ("cpu_pressure", "io_pressure"):  # NaN only without /proc/pressure
        pressure = load[key]
        assert math.isnan(pressure) or 0 <= pressure <= 1.5, (key, pressure)
    assert math.isnan(load["steal"]) or 0 <= load["steal"] <= 1  # a share of the CPU time
    stolen, total = S.cpu_ticks()
    assert math.isnan(total) or 0 <= stolen <= total


class FakeMachine:
    """A load that falls by ``drop`` at every poll; a clock that the polls' sleeps move."""

    def __init__(self, load: float, drop: float, pressure: float = 0.0) -> None:
        self.load, self.drop, self.pressure, self.now, self.sleeps = load, drop, pressure, 0.0, []

    def read_load(self) -> float:
        return self.load

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        self.load = max(self.load - self.drop, 0.0)

    def wait(self, max_wait: float) -> dict:
        return S.wait_until_quiet(
            max_wait,
            read_load=self.read_load,
            read_pressure=lambda: self.pressure,
            sleep=self.sleep,
            clock=lambda: self.now,
        )


def test_the_calibration_waits_for_a_finished_jobs_load_to_decay() -> None:
    decaying = FakeMachine(load=2.27, drop=0.5)  # the 12-07 campaign's start
    found = decaying.wait(600.0)
    assert found["quiet"] and found["load_at_first"] == 2.27
    assert found["load_at_start"] < 0.3 and found["waited_s"] == 20.0  # four 5 s polls
    # A quiet machine is measured at once; a busy one after the wait, and says so.
    assert FakeMachine(load=0.1, drop=0.0).wait(600.0)["waited_s"] == 0.0
    busy = FakeMachine(load=1.5, drop=0.0)
    found = busy.wait(12.0)
    assert not found["quiet"] and found["waited_s"] == 12.0 and busy.sleeps == [5.0, 5.0, 2.0]
    # The load average alone lags: tasks waiting for a CPU in the last 10 s keep it waiting.
    assert not FakeMachine(load=0.1, drop=0.0, pressure=0.05).wait(10.0)["quiet"]


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("fixed:50:2", P.FixedSteps),
        ("pa:2", P.PreemptionAware),
        ("notice:1", P.NoticeDriven),
        ("checkfreq:2", P.CheckFreq),
        ("pa:2+notice", P.NoticeDriven),  # the real-kills replay's spot configurations
        ("fixed:40:2+notice", P.NoticeDriven),
    ],
)
def test_child_and_prediction_build_the_same_policy(text: str, kind: type, tmp_path) -> None:
    config = S.Config.parse(text)
    assert config.label == text
    args = replay_child_args(text, tmp_path / "notice")
    child = replay_child.policy_for(args)
    sim = S.make_policy(config, 12.0, S.seeded_priors(CAL))
    assert type(child) is type(sim) is kind
    assert child.state_dict() == sim.state_dict()
    if config.policy == "notice":
        assert isinstance(child.source, FileNoticeSource) and sim.source is None
        assert isinstance(child.inner, P.Daly) and child.inner.mtbf == 12.0
    if config.on_notice:
        assert isinstance(child.source, FileNoticeSource) and sim.source is None
        assert type(child.inner) is type(sim.inner) is not P.NoticeDriven
    if config.policy in ("pa", "checkfreq") and not config.on_notice:
        # Seeded: a restarted process plans with the calibrated costs, not 1 s / 10 s.
        assert child.costs.stall.prior == 0.004 and child.costs.duration.prior == 0.04


def replay_child_args(config: str, notice: Path) -> argparse.Namespace:
    return argparse.Namespace(
        config=config,
        every=50,
        in_flight=2,
        mtbf=12.0,
        priors='{"stall_prior": 0.004, "duration_prior": 0.04, "iteration_prior": 0.1}',
        notice_file=str(notice),
        notice_lead=2.0,
        notice_margin=S.NOTICE_MARGIN,
    )


@pytest.mark.parametrize("bad", ["fixed:50", "pa", "notice:x", "daly:1", "fixed:a:1"])
def test_config_parse_names_the_forms(bad: str) -> None:
    with pytest.raises(ValueError, match="fixed:EVERY:N"):
        S.Config.parse(bad)


def test_traces_are_presets_or_any_file_with_its_gap_and_steps() -> None:
    """A held-out trace is validated with the same command: ``PATH:GAP:STEPS``."""
    assert S.trace_setup("harsh") == ("harsh", S.TRACES["harsh"])
    key, setup = S.trace_setup("/data/aws/zone-b.csv:7.5:300")
    assert key == "zone-b" and setup.path == "/data/aws/zone-b.csv"
    assert (setup.gap, setup.steps) == (7.5, 300)
    for bad in ("hars", "x.csv", "x.csv:12", "x.csv:0:300", "x.csv:nan:300", "x.csv:12:-1"):
        with pytest.raises(ValueError, match=r"--traces .*PATH:GAP:STEPS"):
            S.trace_setup(bad)


def test_notice_writer_delivers_before_the_kill_and_clears_at_it(tmp_path) -> None:
    path = tmp_path / "notice"
    writer = V.NoticeWriter(path, [0.3, 0.6], lead=0.2)
    writer.start()
    source = FileNoticeSource(str(path), window=5.0, poll_interval=0.0)
    seen = []
    end = time.monotonic() + 0.9
    while time.monotonic() < end:
        notice = source.poll(time.monotonic())
        seen.append((time.monotonic() - writer.start_time, notice))
        time.sleep(0.01)
    writer.stop()
    assert writer.delivered == 2 and not path.exists()
    noticed = [t for t, n in seen if n is not None]
    # Never before the lead (a loaded machine can only make the writer late, not early).
    assert noticed and min(noticed) >= 0.09
    deadlines = [n.deadline - n.received_at for _, n in seen if n is not None]
    assert all(abs(d - 0.2) < 1e-6 for d in deadlines)  # the file holds the seconds left


def test_campaign_covers_the_issue_matrix() -> None:
    args = argparse.Namespace(**V.SIZES["campaign"])
    replays = V.plan(args)
    assert len({key for key, _, _ in replays}) >= 3
    assert len({c.every for _, c, _ in replays if c.policy == "fixed"}) >= 4
    assert {c.in_flight for _, c, _ in replays} == {1, 2}
    for policy in ("pa", "notice", "checkfreq"):
        for key in args.traces:
            offsets = {o for k, c, o in replays if c.policy == policy and k == key}
            assert len(offsets) >= 3, (policy, key)
    assert 30 <= len(replays) <= 45  # ~55 min at 60-90 s a replay


def test_every_fixed_interval_can_be_replayed_at_every_shift() -> None:
    """``--fixed-offsets all``: each fixed interval of each trace at every offset (a mean per
    interval, as for the policies); the preset replays each at one of them."""
    args = argparse.Namespace(**dict(V.SIZES["campaign"], fixed_offsets="all", policies=[]))
    replays = V.plan(args)
    assert len(replays) == len(args.traces) * len(args.fixed) * len(args.offsets)
    for key in args.traces:
        for text in args.fixed:
            offsets = [o for k, c, o in replays if k == key and c.label == text]
            assert sorted(offsets) == sorted(args.offsets), (key, text)


def test_prediction_runs_each_policy_at_every_step() -> None:
    x = {
        "iteration_time": 0.1,
        "iteration_jitter": 0.01,
        "restart": 2.2,
        "restart_jitter": 0.1,
        "stall": 0.004,
        "durable": 0.04,
    }
    kills = [6.0, 14.0, 19.0, 31.0]
    for text in ("fixed:25:1", "pa:2", "notice:1", "checkfreq:2"):
        config = S.Config.parse(text)
        runs = V.predict(x, config, kills, 300, 2, 8.0, 2.0, S.seeded_priors(CAL))
        assert len(runs) == 2
        for r in runs:
            assert r.finished and r.useful_steps == 300 and r.preemptions == 4
            assert r.decisions >= 300  # asked at every step, as the engine asks
        if config.notices:
            assert all(r.emergency_saves >= 3 for r in runs)


def test_mean_row_and_verdict_report_errors_of_the_means() -> None:
    rows = [
        fake_row(10.0, 10.4, 9.8, load=1.2),
        fake_row(8.0, 7.8, 7.8, load=3.5),
    ]
    mean = V.mean_row(rows)
    assert mean["offset_gaps"] == "mean"
    assert mean["error_pct"] == pytest.approx(100 * (9.1 / 9.0 - 1))
    assert mean["error_window_pct"] == pytest.approx(100 * (9.1 / 9.0 - 1))
    text = V.verdict([*rows, mean])
    assert "headline): mean |error| 1.11 %, max 1.11 %, 1 of 1 configurations within 5 %" in text
    assert "CPU pressure 0.10 -> 0.60" in text  # where the inputs moved, the load says why


def test_the_noise_of_a_mean_of_shifted_replays_adds_in_quadrature() -> None:
    """Two replays of 4 % and 3 % noise around 10 and 5 steps/s: their mean's spread is
    sqrt(0.4² + 0.15²) / 2 = 0.2136 steps/s, 2.85 % of the mean prediction 7.5."""
    rows = [fake_row(10.0, 10.0, 10.0, 1.0, noise=4.0), fake_row(5.0, 5.0, 5.0, 1.0, noise=3.0)]
    mean = V.mean_row(rows)
    assert mean["noise_window_pct"] == pytest.approx(100 * math.hypot(0.4, 0.15) / 2 / 7.5)


def test_verdict_says_which_errors_the_replays_own_noise_explains_and_which_it_does_not() -> None:
    """A 6 % error on a configuration whose one replay has 4 % noise: that replay cannot
    check 5 % (2 x 4 > 5), and 3 shifted replays would (ceil(1 x (8 / 5)²) = 3); a 3 %
    error on a 0.5 % noise is beyond the noise: the inputs or the model."""
    noisy = fake_row(10.0, 10.6, 10.6, 1.0, noise=4.0, config="fixed:100:1")
    off = fake_row(10.0, 10.3, 10.3, 1.0, noise=0.5, config="notice:1")
    fine = fake_row(10.0, 10.0, 10.0, 1.0, noise=1.0, config="pa:2")
    text = V.verdict([noisy, off, fine])
    assert "1 of 3 configurations cannot be checked to 5 %" in text
    assert "medium `fixed:100:1` (4.0 % with 1, 3 needed)" in text
    assert "errors beyond 2 x the noise (the inputs moved, or the model is off): " in text
    assert "medium `notice:1` +3.0 % = +6.0 x its noise" in text
    assert "`pa:2` +" not in text and "`fixed:100:1` +6.0 %" not in text
    # The headline again over the two whose replays can check it: 3 % and 0 %.
    assert (
        "the 2 configurations their replays can check (named before they ran): mean |error| "
        "1.50 %, max 3.00 %, 2 of 2 within 5 %" in text
    )


def test_report_has_the_headline_and_every_column(tmp_path) -> None:
    """A report from made-up measurements: the beforehand prediction is the headline, the
    in-replay one the check, and the calibration's medians and load are stated."""
    stats = S.robust([2.4, 2.5, 2.45, 2.6, 2.4])
    cal = {
        "iteration_time": 0.105,
        "iteration_bare": 0.102,
        "iteration_jitter": 0.01,
        "restart": 2.35,
        "restart_jitter": 0.25,
        "restart_stats": stats,
        "restart_samples": [2.4, 2.5, 2.45, 2.6, 2.4],
        "compute": 0.1,
        "costs": {1: {"stall": S.robust([0.001] * 3), "durable": S.robust([0.03] * 3)}},
        "load_before": 1.0,
        "load_after": 1.2,
        "load": 1.1,
        "cpu_share": 0.2,
        "cpu_pressure": 0.05,
    }
    config = S.Config.parse("pa:1")
    x = V.inputs(cal, 1)
    sims = V.predict(x, config, [6.0, 14.0], 100, 2, 8.0, 1.0, S.seeded_priors(x))
    run = SimpleNamespace(wall=sims[0].wall_seconds * 1.02, kills=2, lost_steps=5, commits=9)
    load = {"load": 1.5, "cpu_share": 0.4, "cpu_pressure": 0.3}
    window = V.WINDOW * min(d.wall_seconds for d in sims)
    inside = V.predict(x, config, [6.0, 14.0], 100, 2, 8.0, 1.0, S.seeded_priors(x), window)
    scored = V.Windowed(window, 60, 2, inside, inside, inside)
    rows = [
        V.row("medium", config, o, 42.0, 100, run, 0, x, x, sims, sims, sims, load, cal, scored)
        for o in (0.0, 1.5)
    ]
    args = argparse.Namespace(
        out=str(tmp_path / "report"),
        size="quick",
        traces=["medium"],
        setups={"medium": S.TRACES["medium"]},
        steps_scale=0.3,
        offsets=[0.0, 1.5],
        accelerator_ms=90.0,
        notice_lead=1.0,
        seeded=True,
        draws=2,
        fixed_offsets="all",
        max_replays=4,
    )
    later = dict(cal, restart_stats=dict(cal["restart_stats"], median=3.1))
    cals = {"medium": cal, "mild": later}  # --calibrate per-trace: one paragraph each
    V.write_outputs(args, V.with_means({("medium", "pa:1"): rows}), cals, 60.0, 2)
    text = (tmp_path / "report.md").read_text()
    assert text.startswith("# Validation") and "Command: `" in text
    assert "restart 2.45 s (spread" in text and "CPU pressure 0.05" in text
    assert "**Calibration, before the medium replays**" in text
    assert "**Calibration, before the mild replays**" in text and "restart 3.10 s" in text
    assert "each fixed interval at every one; more, up to 4, where" in text
    head = next(line for line in text.splitlines() if line.startswith("| trace | config"))
    for column in ("goodput_measured", "goodput_predicted", "error_pct", "error_exact_pct"):
        assert f"| {column} |" in head
    assert head.index("goodput_predicted") < head.index("goodput_in_replay")
    # The headline is scored over the window, first in the table and in the verdict.
    assert head.index("error_window_pct") < head.index("error_pct")
    assert "- beforehand, over the window (headline): mean |error|" in text
    assert "- exact replay (the event model alone), over the window: mean |error|" in text
    assert rows[0]["goodput_window_measured"] == pytest.approx(60 / window)
    assert "| medium | pa:1 | mean |" in text
    csv = (tmp_path / "report.csv").read_text()
    assert csv.startswith("#") and "cpu_pressure_calibrated" in csv


def fake_row(
    measured: float,
    predicted: float,
    check: float,
    load: float,
    noise: float = 1.0,
    config: str = "pa:2",
) -> dict:
    return {
        "trace": "medium",
        "config": config,
        "noise_window_pct": noise,
        "every": "",
        "in_flight": 2,
        "steps": 100,
        "offset_gaps": "0",
        "goodput_measured": measured,
        "goodput_predicted": predicted,
        "goodput_in_replay": check,
        "error_pct": 100 * (predicted / measured - 1),
        "error_in_replay_pct": 100 * (check / measured - 1),
        "goodput_window_measured": measured,
        "goodput_window_predicted": predicted,
        "goodput_window_in_replay": check,
        "error_window_pct": 100 * (predicted / measured - 1),
        "error_window_in_replay_pct": 100 * (check / measured - 1),
        "goodput_exact": check,
        "error_exact_pct": 100 * (check / measured - 1),
        "goodput_window_exact": check,
        "error_window_exact_pct": 100 * (check / measured - 1),
        "inputs_moved_pct": 100 * (predicted / check - 1),
        "iteration_ms": 100.0,
        "iteration_calibrated_ms": 101.0,
        "restart_s": 2.3,
        "restart_calibrated_s": 2.4,
        "load": load,
        "load_calibrated": 1.0,
        "cpu_share": 1.0,
        "cpu_share_calibrated": 1.0,
        "cpu_pressure": 0.6,
        "cpu_pressure_calibrated": 0.1,
    }


def test_a_restart_from_a_version_without_measured_costs_plans_with_the_priors() -> None:
    """Issue 43 item 6. A process that restores nothing plans with the priors (durable 10 s:
    a 10 s / N floor) until its own first save completes; one restored from a version is
    told what that version's save cost (the engine and the simulator alike). Where lives are
    shorter than the prior's floor no save ever completes, so nothing is learnt and every
    life starts from nothing: seeded with the calibrated costs, CheckFreq keeps its work."""
    x = {
        "iteration_time": 0.1,
        "iteration_jitter": 0.0,
        "restart": 2.4,
        "restart_jitter": 0.0,
        "stall": 0.0013,
        "durable": 0.025,
    }
    kills = [8.0 * (i + 1) for i in range(40)]  # lives of 8 s - 2.5 s of restart: 55 steps
    config = S.Config.parse("checkfreq:2")
    default = V.predict(x, config, kills, 200, 1, 8.0, 1.0, None)[0]
    seeded = V.predict(x, config, kills, 200, 1, 8.0, 1.0, S.seeded_priors(x))[0]
    # Default priors: k = (10 s - 1 s) / 0.1 s = 90 steps, longer than any life (55 steps):
    # no save ever completes, so no life learns the real costs (1 save in 40 lives here;
    # seeded: 199 saves, nothing lost, done after 3 kills).
    assert seeded.goodput > 1.5 * default.goodput
    assert seeded.lost_steps < default.lost_steps / 3


def life(index: int, spawned: float, ended: float, start: int | None, killed: bool = True):
    return SimpleNamespace(
        index=index, spawned=spawned, ended=ended, start_step=start, killed=killed
    )


def test_the_window_holds_the_newest_step_or_the_one_a_kill_sent_the_job_back_to() -> None:
    # Life 0 trains steps 1-40 (0.1 s each from 2.5 s) and is killed at 6.55 s; life 1 is
    # killed while it starts; life 2 restores step 30 and trains on.
    lives = [life(0, 0.0, 6.55, 0), life(1, 6.6, 7.5, None), life(2, 7.55, 20.0, 30, False)]
    timeline = [(2.5 + 0.1 * i, i + 1) for i in range(40)] + [
        (10.1 + 0.1 * i, 31 + i) for i in range(50)
    ]
    run = SimpleNamespace(lives=lives)
    assert V.held_at(run, timeline, 1.0) == 0  # nothing trained yet
    assert V.held_at(run, timeline, 4.0) == 16  # the newest step, the job goes on
    assert V.held_at(run, timeline, 6.5) == 40  # killed 50 ms later: after the window
    assert V.held_at(run, timeline, 6.6) == 30  # killed inside it: back to the version
    assert V.held_at(run, timeline, 9.0) == 30  # still restarting
    assert V.held_at(run, timeline, 11.05) == 40  # step 31 at 10.1 s: 40 at 11.0 s


def test_the_window_s_prediction_counts_the_steps_done_when_its_trace_ends() -> None:
    x = {
        "iteration_time": 0.1,
        "iteration_jitter": 0.0,
        "restart": 2.0,
        "restart_jitter": 0.0,
        "stall": 0.001,
        "durable": 0.01,
    }
    config = S.Config.parse("fixed:1000:1")  # never saves: a kill loses everything
    (whole,) = V.predict(x, config, [], 400, 1, 8.0, 1.0, None)
    (window,) = V.predict(x, config, [], 400, 1, 8.0, 1.0, None, 20.0)
    assert whole.useful_steps == 400
    # 20 s: the 2 s start, then 0.1 s steps (the last one may end on the window's edge).
    assert window.useful_steps in (179, 180)
    (killed,) = V.predict(x, config, [15.0], 400, 1, 8.0, 1.0, None, 20.0)
    assert killed.useful_steps == pytest.approx(30, abs=1)  # restarted at 15 s: 3 s of steps


def test_the_window_ends_clear_of_the_kills_the_prediction_holds() -> None:
    assert V.clear_of_kills(50.0, [10.0, 49.0, 51.0]) == 50.0
    assert V.clear_of_kills(50.0, [49.97]) == pytest.approx(49.87)  # inside the last 0.1 s
    assert V.clear_of_kills(50.0, [49.8, 49.95]) == pytest.approx(49.7)  # a burst: all of it
    assert V.clear_of_kills(50.0, [50.0]) == pytest.approx(49.9)
    # Every kill before the moved end is in the simulator's trace, none after it.
    kills = [12.34, 49.97]
    end = V.clear_of_kills(50.0, kills)
    up = V.kill_trace(kills, end).up
    assert list(up).count(0) == 1 and up[math.ceil(12.34 / V.TICK)] == 0


def replay_life(spawned, first_step_at, ended, killed):
    return SimpleNamespace(
        spawned=spawned,
        first_step_at=first_step_at,
        ended=ended,
        killed=killed,
        start_step=0,
        last_step=0,
    )


def test_the_exact_check_replays_each_lifes_own_restart_and_pace() -> None:
    """The exact check feeds the simulator each life's restart and pace as the replay ran
    them: the simulated first steps end when the real ones did (the kill ticks' grid
    aside), a life killed while starting stays down past its kill, and each life steps at its
    own pace."""
    kills = [6.0, 14.0, 15.0]
    run = SimpleNamespace(
        lives=[
            replay_life(0.0, 2.6, 6.0, True),
            replay_life(6.0, 8.7, 14.0, True),
            replay_life(14.0, None, 15.0, True),  # killed before its first step
            replay_life(15.0, 17.9, 40.0, False),
        ]
    )
    paces = {0: 0.1, 1: 0.12, 3: 0.11}  # life 2 has none
    starts = V.exact_starts(run, kills, paces, 0.1)
    assert len(starts) == 4
    # Each simulated start begins the tick after its kill's tick (kill_trace) and ends its
    # first step (restart + one step at its pace) when the real one did.
    begins = [0.0] + [(math.ceil(k / V.TICK) + 1) * V.TICK for k in kills]
    for (restart, factor), begin, real in zip(starts, begins, [2.6, 8.7, None, 17.9], strict=True):
        if real is not None:
            assert begin + restart + 0.1 * factor == pytest.approx(real)
    assert [f for _, f in starts] == pytest.approx([0.1 / 0.11, 0.12 / 0.11, 1.0, 1.0])
    assert starts[2][0] > 15.0 - 14.05  # still starting when the next kill comes

    # The simulator takes them: one life, no kills, a measured 3 s restart at half speed.
    job = JobSpec(
        iteration_time=0.1,
        save_stall=0.0,
        save_duration=0.01,
        restart_cost=1.0,
        max_in_flight=1,
        total_steps=100,
        measured_starts=((3.0, 2.0),),
    )
    result = simulate(V.kill_trace([], 60.0), P.FixedSteps(50), job)
    assert result.time["restart"] == pytest.approx(3.0)
    assert result.wall_seconds == pytest.approx(3.0 + 100 * 0.2 + 0.01, abs=0.06)
    with pytest.raises(SimConfigError, match=r"job.measured_starts\[0\]"):
        JobSpec(measured_starts=((-1.0, 1.0),))


def test_a_kill_between_a_step_and_its_saves_commit_loses_the_save_in_the_model_too() -> None:
    """The exact check of a knife edge: step 50 ends at 5.90 s, its save commits 30 ms later,
    the kill comes between the two. The replay lost that save, so the next life starts from
    nothing; the simulator, whose kills land at most a tick late, must lose it too (on a
    50 ms grid it kept it, and the exact check of one replay was off by 24 %)."""
    x = {
        "iteration_time": 0.1,
        "iteration_jitter": 0.0,
        "restart": 1.0,
        "restart_jitter": 0.0,
        "stall": 0.0,
        "durable": 0.03,
    }
    config = S.Config.parse("fixed:50:1")
    kill = 5.905
    run = SimpleNamespace(
        lives=[replay_life(0.0, 1.0, kill, True), replay_life(kill, kill + 1.1, 30.0, False)]
    )
    starts = V.exact_starts(run, [kill], {}, 0.1)
    (sim,) = V.predict(x, config, [kill], 100, 1, 8.0, 1.0, None, starts=starts)
    assert sim.saves_lost >= 1 and sim.lost_steps == 50  # life 1 starts again from step 0
    assert sim.wall_seconds == pytest.approx(kill + 1.1 + 99 * 0.1 + 0.03, abs=2 * V.TICK)


def test_the_campaign_waits_for_quiet_and_states_the_drift_after_it(tmp_path) -> None:
    """The campaign preset waits for a quiet machine before calibrating and calibrates once
    more after the last replay; the results file states both."""
    assert V.SIZES["campaign"]["settle"] > 0 and V.SIZES["campaign"]["calibrate_after"]
    assert V.SIZES["quick"]["settle"] == 0  # a smoke run does not wait
    first = {
        "iteration_time": 0.104,
        "restart_stats": {"median": 2.74},
        "load": 0.2,
        "steal": 0.001,
    }
    after = dict(first, iteration_time=0.102, restart_stats={"median": 2.85}, load=0.4)
    text = V.drift_paragraph({"": first, "after": after})
    assert "104.0 -> 102.0 ms (-1.9 %)" in text and "2.74 -> 2.85 s (+0.11 s)" in text
    assert V.drift_paragraph({"": first}) == ""


def test_each_replay_is_kept_as_it_ran_to_be_predicted_again(tmp_path) -> None:
    """The raw file holds what the exact check needs to predict a replay again (lives,
    kills, step lines, commits, paces) and the calibration, in milliseconds."""
    run = SimpleNamespace(
        wall=20.0,
        lives=[
            replay_life(0.0, 2.6, 6.0, True),
            replay_life(6.0, 8.7, 20.0, False),
        ],
    )
    config = S.Config.parse("fixed:25:1")
    raw = V.raw_replay(
        "harsh", config, 1.5, [6.0, 30.0], run, [(2.6, 1), (2.7, 2)], {1: 0.1}, [(5.0, 25)]
    )
    V.write_raw(tmp_path / "report", [raw], {"": {"restart": 2.4}})
    back = json.loads((tmp_path / "report.raw.json").read_text())
    (got,) = back["replays"]
    assert back["calibrations"] == {"": {"restart": 2.4}}
    assert got["config"] == "fixed:25:1" and got["kills_ms"] == [6000]  # none past the end
    assert got["lives"][0] == {
        "spawned_ms": 0,
        "first_step_ms": 2600,
        "ended_ms": 6000,
        "killed": True,
        "start_step": 0,
        "last_step": 0,
    }
    assert got["steps_ms"] == [[2600, 1], [2700, 2]] and got["commits_ms"] == [[5000, 25]]
    assert got["pace_us"] == {"1": 100000}
