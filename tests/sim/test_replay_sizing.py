"""The validation sizes itself by each configuration's own noise, known before any replay
runs: more shifted replays where one cannot check the tolerance, none where it can, and an
honest 'cannot' (with the number that would) past the cap."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments" / "sim"))
import replay_sizing as Z
import validate_replay as V


def forecasts(noise_pct: dict[float, float], goodput: float = 10.0):
    """A forecast at each offset with the given relative noise (%), and the offsets asked."""
    asked: list[float] = []

    def forecast(offset: float) -> Z.Forecast:
        asked.append(offset)
        return Z.Forecast(offset, goodput, goodput * noise_pct.get(offset, 1.0) / 100)

    return forecast, asked


def test_a_quiet_configuration_gets_its_least_replays_and_no_more_forecasts() -> None:
    forecast, asked = forecasts({0.0: 1.0, 1.5: 1.0, 3.0: 1.0})
    sizing = Z.size([0.0, 1.5, 3.0, 0.75], least=3, most=6, forecast=forecast)
    assert sizing.offsets == (0.0, 1.5, 3.0) and sizing.checkable and sizing.added == 0
    assert asked == [0.0, 1.5, 3.0]  # the fourth candidate was never predicted
    assert sizing.noise_pct == pytest.approx(math.sqrt(3) / 3)


def test_a_noisy_configuration_gets_shifted_replays_until_their_mean_checks_the_tolerance() -> None:
    """4 % per replay: 2 x 4 > 5 with one; with three, 2 x 4 / sqrt(3) = 4.6 <= 5."""
    forecast, _ = forecasts(dict.fromkeys([1.5, 0.0, 3.0, 0.75], 4.0))
    sizing = Z.size([1.5, 0.0, 3.0, 0.75], least=1, most=6, forecast=forecast)
    assert sizing.offsets == (1.5, 0.0, 3.0) and sizing.checkable and sizing.added == 2
    assert sizing.noise_pct == pytest.approx(4.0 / math.sqrt(3))
    assert "3 replay(s) at offsets 1.5, 0, 3" in sizing.describe()


def test_past_the_cap_the_least_are_replayed_and_the_number_that_would_check_is_said() -> None:
    """22 % per replay: six give 22 / sqrt(6) = 9 %, far from 2.5 %; 78 would do."""
    candidates = [0.0, 1.5, 3.0, 0.75, 2.25, 3.75]
    forecast, asked = forecasts(dict.fromkeys(candidates, 22.0))
    sizing = Z.size(candidates, least=1, most=6, forecast=forecast)
    assert asked == candidates  # predicted up to the cap, never run
    assert sizing.offsets == (0.0,) and not sizing.checkable and sizing.added == 0
    assert sizing.tried == 6 and Z.replays_needed(22.0, 1) == 78
    assert sizing.noise_pct == pytest.approx(22.0)
    assert "even 6 would not check 5 %" in sizing.describe()


def test_candidate_offsets_start_with_the_plans_and_then_fall_between_them() -> None:
    assert Z.candidate_offsets([1.5], [0.0, 1.5, 3.0], 6) == [1.5, 0.0, 3.0, 0.75, 2.25, 3.75]
    assert Z.candidate_offsets([0.0, 1.5, 3.0], [0.0, 1.5, 3.0], 3) == [0.0, 1.5, 3.0]
    more = Z.candidate_offsets([0.0], [0.0, 1.5, 3.0], 9)
    assert len(set(more)) == 9 and more[6:] == [0.375, 1.125, 1.875]


def test_the_campaign_preset_sizes_itself_and_the_smoke_does_not() -> None:
    assert V.SIZES["campaign"]["max_replays"] >= 3
    assert V.SIZES["quick"]["max_replays"] == 1


def test_the_plan_is_grouped_by_configuration_in_run_order() -> None:
    args = argparse.Namespace(**V.SIZES["campaign"])
    groups = V.grouped(V.plan(args))
    assert len(groups) == len(args.traces) * (len(args.fixed) + len(args.policies))
    for _, config, offsets in groups:
        assert len(offsets) == (1 if config.policy == "fixed" else len(args.offsets))


def test_the_report_says_which_configurations_were_sized_and_which_cannot_be_checked() -> None:
    text = V.sizing_paragraph(
        {
            ("medium", "fixed:50:2"): Z.Sizing((1.5, 0.0, 3.0, 0.75), True, 2.4, 4, 3),
            ("harsh", "fixed:100:1"): Z.Sizing((0.0,), False, 21.9, 6, 0),
            ("mild", "pa:2"): Z.Sizing((0.0, 1.5, 3.0), True, 1.1, 3, 0),
        }
    )
    assert "more shifted replays for medium `fixed:50:2` 4 replay(s)" in text
    assert "Not checkable to 5 % by that many: harsh `fixed:100:1` 1 replay(s)" in text
    assert "even 6 would not check 5 %" in text and "mild `pa:2`" not in text


def test_the_noise_model_check_is_the_root_mean_square_of_the_errors_in_noise_units() -> None:
    rows = [
        {"trace": "t", "config": "a", "error_window_pct": 2.0, "noise_window_pct": 1.0},
        {"trace": "t", "config": "b", "error_window_pct": -1.0, "noise_window_pct": 2.0},
    ]
    lines = V.noise_lines(rows, [1, 1])
    rms = math.sqrt((2.0**2 + 0.5**2) / 2)
    assert f"the errors are {rms:.2f} x the predicted noise" in lines[0]


def test_configurations_take_turns_so_none_owns_a_stretch_of_the_machines_drift() -> None:
    """Three configurations of 3, 1 and 2 replays: every one's first, then the seconds
    starting one configuration later, then the third: no configuration's replays run as
    one stretch."""
    runs = [["a0", "a1", "a2"], ["b0"], ["c0", "c1"]]
    assert V.interleaved(runs) == ["a0", "b0", "c0", "c1", "a1", "a2"]
    assert V.interleaved([]) == []
    order = V.interleaved([[f"{c}{i}" for i in range(3)] for c in "pnk"])
    assert order == ["p0", "n0", "k0", "n1", "k1", "p1", "k2", "p2", "n2"]
