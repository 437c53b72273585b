"""Bad input fails early, naming the key or file and saying how to fix it."""

from __future__ import annotations

import math
import re
import shutil

import numpy as np
import pytest

import pcframe.policies as P
from pcframe.errors import PolicyError
from pcframe.policies.base import SaveHint
from pcframe.policies.traces import Trace, TraceFormatError, shared_traces_dir
from pcframe.sim import JobSpec, SimConfigError, SimOptions, simulate, steady_trace
from pcframe.sim.app_config import select_traces


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"iteration_time": 0.0}, ["job.iteration_time=0.0", "seconds per step >= 1e-06"]),
        ({"save_stall": -1.0}, ["job.save_stall=-1.0", ">= 0"]),
        ({"save_stall": 5.0, "save_duration": 2.0}, ["job.save_duration=2.0", "job.save_stall"]),
        ({"max_in_flight": 0}, ["job.max_in_flight=0", "1..64"]),
        ({"persist": "fast"}, ["job.persist='fast'", "'parallel' or 'serial'"]),
        ({"deadline": 3600.0}, ["job.deadline=3600.0", "needs job.total_steps"]),
        ({"total_steps": 0}, ["job.total_steps=0", ">= 1"]),
        ({"restart_cost": float("nan")}, ["job.restart_cost=nan", "finite"]),
        ({"scaling_efficiency": 1.5}, ["job.scaling_efficiency=1.5", "(0, 1]"]),
        ({"vms": 0}, ["job.vms=0", "at least 1 VM"]),
        # A step of 1e-300 s looped for ever; 1e-14 s overflowed the step counter.
        ({"iteration_time": 1e-300}, ["job.iteration_time=1e-300", ">= 1e-06"]),
        ({"iteration_time": 1e-9, "measured_starts": ((1.0, 1.0),)}, ["iteration_time"]),
        ({"measured_starts": ((0.0, 1e-15),)}, ["job.measured_starts[0]", ">= 1e-06 s"]),
        ({"vms": True}, ["job.vms=True"]),  # a bool is not a count
        ({"max_in_flight": True}, ["job.max_in_flight=True"]),
        ({"final_save": "no"}, ["job.final_save='no'", "true or false"]),
    ],
)
def test_impossible_job_parameters_name_the_key_and_the_fix(kwargs: dict, words: list) -> None:
    with pytest.raises(SimConfigError) as err:
        JobSpec(**kwargs)
    for word in words:
        assert word in str(err.value)


def test_numpy_numbers_are_numbers() -> None:
    """A value read from an array was refused with a fix that did not apply ("give seconds
    per step > 0" for ``np.float32(1.0)``); they are taken as Python's numbers."""
    job = JobSpec(
        iteration_time=np.float32(0.5),
        max_in_flight=np.int64(2),
        restart_by_tier={"peers": np.float32(3.0)},
        measured_starts=np.array([[2.0, 1.0], [3.0, 1.5]]),
    )
    assert job.iteration_time == 0.5 and type(job.iteration_time) is float
    assert job.max_in_flight == 2 and type(job.max_in_flight) is int
    assert job.measured_starts == ((2.0, 1.0), (3.0, 1.5))
    assert SimOptions(seed=np.int64(3)).seed == 3
    with pytest.raises(SimConfigError, match=r"sim\.seed=-1 is invalid: give an integer >= 0"):
        SimOptions(seed=-1)  # numpy's generator raised a ValueError naming nothing


def test_an_interval_too_small_to_end_is_refused_naming_the_key() -> None:
    """``resource_interval=1e-12`` never ended (the clock no longer moved); a value that
    would ask a policy more than 1e7 times over the window is a slip, named with the least
    value that is not."""
    trace = steady_trace(hours=24.0)
    for key in ("resource_interval", "probe_gap"):
        with pytest.raises(SimConfigError, match=rf"sim\.{key}=1e-12 is invalid: .*at least"):
            simulate(trace, P.FixedSteps(10), JobSpec(), options=SimOptions(**{key: 1e-12}))


def test_an_empty_traces_setting_names_no_trace(tmp_path) -> None:
    (tmp_path / "notes.txt").write_text("not a trace")
    with pytest.raises(SimConfigError, match="traces='' names no trace"):
        select_traces("", cwd=tmp_path)  # it loaded every file of the working directory


def test_unknown_keys_are_listed_with_the_known_ones() -> None:
    with pytest.raises(
        SimConfigError, match=r"job: unknown key\(s\) \['stal'\]; known keys: .*save_stall"
    ):
        JobSpec.from_dict({"stal": 1.0})
    with pytest.raises(SimConfigError, match=r"sim\.probe_gap=0"):
        SimOptions(probe_gap=0)
    with pytest.raises(SimConfigError, match=r"sim\.policy_state='engine'"):
        SimOptions(policy_state="engine")


def test_errors_name_the_key_where_the_app_config_holds_it() -> None:
    with pytest.raises(SimConfigError) as err:
        JobSpec.from_dict({"save_stall": 5.0, "save_duration": 2.0}, "sim.job")
    assert str(err.value).startswith("sim.job.save_duration=2.0 is invalid")
    assert "sim.job.save_stall=5.0" in str(err.value)
    with pytest.raises(SimConfigError, match=r"^sim\.options\.probe_gap=0 is invalid"):
        SimOptions.from_dict({"probe_gap": 0}, "sim.options")


def test_a_start_after_the_end_of_the_trace_names_the_trace() -> None:
    trace = steady_trace(2.0)
    with pytest.raises(SimConfigError, match=r"sim\.options\.start=9000.* always-up \(7200 s\)"):
        simulate(trace, P.FixedSteps(10), options=SimOptions(start=9000.0))


def test_a_negative_price_in_a_trace_names_the_tick() -> None:
    price = np.full(100, 0.9)
    price[42] = -1.0
    trace = Trace("bad-prices", "test", 60.0, 1, np.ones(100, dtype=np.int64), spot_price=price)
    with pytest.raises(SimConfigError, match=r"bad-prices: spot price at tick 42 is -1.0"):
        simulate(trace, P.FixedSteps(10))


def test_a_malformed_trace_file_names_the_file_and_line(tmp_path) -> None:
    bad = tmp_path / "zone.csv"
    bad.write_text("date,availability\n2023-02-15 22:08:16,1\n2023-02-15 22:11:31,maybe\n")
    with pytest.raises(TraceFormatError) as err:
        select_traces(str(bad))
    message = str(err.value)
    assert "zone.csv" in message and "line 3" in message and "Fix" in message


def test_a_trace_spec_that_matches_nothing_says_what_was_searched(tmp_path) -> None:
    with pytest.raises(SimConfigError, match=r"traces='nowhere/\*\.json' matched no trace file"):
        select_traces("nowhere/*.json", tmp_path)


def test_traces_can_be_picked_by_glob_relative_to_the_shipped_folder(tmp_path) -> None:
    picked = select_traces("skynomad/gcp-h100-16-2025/us-east4-*.json", tmp_path)
    assert sorted(t.zone for t in picked) == ["us-east4-a", "us-east4-b"]


class _EveryTen(P.IntervalPolicy):
    """A plugin that decides well; the subclasses break one rule each."""

    def decide(self, ctx):
        return P.Decision(ctx.step % 10 == 0, "ten")


class _ReturnsBool(_EveryTen):
    def decide(self, ctx):
        return ctx.step % 10 == 0


class _NegativePeriod(_EveryTen):
    def save_hint(self, ctx):
        return SaveHint(step=-5, every=-3)  # before: every result 0, exit 0


class _ZeroPeriod(_EveryTen):
    def save_hint(self, ctx):
        return SaveHint(every=0)  # before: ZeroDivisionError in the fast path


class _HugePeriod(_EveryTen):
    def save_hint(self, ctx):
        return SaveHint(every=2**70)  # before: a Numba TypingError traceback


class _NotAHint(_EveryTen):
    def save_hint(self, ctx):
        return 10


@pytest.mark.parametrize(
    ("policy", "words"),
    [
        (_ReturnsBool, r"decide returned False; it must return pcframe\.policies\.Decision"),
        (_NegativePeriod, r"save_hint returned every=-3: a period is an int >= 1"),
        (_ZeroPeriod, r"save_hint returned every=0"),
        (_HugePeriod, r"save_hint returned every=1180591620717411303424: a period is an int"),
        (_NotAHint, r"save_hint returned 10, not a SaveHint or None"),
    ],
)
def test_a_plugin_that_breaks_its_contract_is_named_not_simulated(policy, words) -> None:
    with pytest.raises(PolicyError, match=rf"policy tests\.sim\.test_errors\.{policy.__name__}\."):
        simulate(steady_trace(1.0), policy())
    with pytest.raises(PolicyError, match=words):
        simulate(steady_trace(1.0), policy())
    assert simulate(steady_trace(1.0), _EveryTen()).useful_steps > 0


def test_the_engine_names_a_decide_that_returns_no_decision(tmp_path) -> None:
    import torch

    from pcframe import Checkpointer

    with Checkpointer(tmp_path, model=torch.nn.Linear(2, 2), policy=_ReturnsBool()) as ckpt:
        with pytest.raises(PolicyError, match=r"_ReturnsBool\.decide returned True"):
            ckpt.maybe_save(10)
        assert ckpt.committed_versions() == []


def test_a_glob_loads_every_folder_and_file_it_matches_and_skips_price_tables(tmp_path) -> None:
    """A glob whose first match was a folder loaded only that folder; one that matched a
    price table beside the traces stopped the whole run on it."""
    shipped = shared_traces_dir()
    assert shipped is not None
    h100 = sorted((shipped / "skynomad" / "gcp-h100-16-2025").glob("us-east4-*.json"))
    for i, zone in enumerate(("zoneA", "zoneB")):
        (tmp_path / zone).mkdir()
        shutil.copy(h100[i], tmp_path / zone / h100[i].name)
    shutil.copy(h100[0], tmp_path / "top.json")
    (tmp_path / "spot-prices.json").write_text('{"us-east4-a": [1.0]}')
    picked = select_traces("*", tmp_path)
    assert sorted(t.zone for t in picked) == ["us-east4-a", "us-east4-a", "us-east4-b"]
    with pytest.raises(TraceFormatError, match="price table"):
        select_traces("spot-prices.json", tmp_path)  # named outright: said, not skipped


def test_a_glob_enters_each_folder_once_whatever_links_loop_back(tmp_path) -> None:
    """glob's ``**`` followed links to folders without end: one link to ``..`` in a traces
    folder listed its trace 41 times (once per level, until the kernel refused the path),
    two such links made 2**40 paths, a pcframe-sim that never started."""
    import signal

    shipped = shared_traces_dir()
    assert shipped is not None
    h100 = sorted((shipped / "skynomad" / "gcp-h100-16-2025").glob("us-east4-*.json"))
    zone = tmp_path / "traces" / "zone"
    zone.mkdir(parents=True)
    shutil.copy(h100[0], zone / h100[0].name)
    (zone / "parent").symlink_to("..")
    picked = select_traces("traces/**/*.json", tmp_path)
    assert [t.zone for t in picked] == ["us-east4-a"]

    (zone / "top").symlink_to("../..")  # a second way back: exponentially many paths

    def too_long(signum, frame):
        raise TimeoutError("select_traces still globbing after 20 s")

    before = signal.signal(signal.SIGALRM, too_long)
    signal.alarm(20)
    try:
        picked = select_traces("traces/**", tmp_path)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
    assert [t.zone for t in picked] == ["us-east4-a"]


def test_a_traces_variable_naming_no_folder_is_one_line_and_spares_a_named_file(
    tmp_path, monkeypatch
) -> None:
    """$PCFRAME_TRACES set to a path that is not a folder was a raw FileNotFoundError
    (pcframe-sim: "unexpected error (a bug)") even for traces= naming a file by its path."""
    from pcframe.apps.preemption.schedule import resolve_trace
    from pcframe.errors import ConfigError

    trace = tmp_path / "mine.json"
    steady_trace(1.0).save_json(trace)
    monkeypatch.setenv("PCFRAME_TRACES", str(tmp_path / "gone"))
    assert [t.n_ticks for t in select_traces(str(trace), tmp_path)] == [60]
    assert resolve_trace(trace) == trace
    for spec in ("all", "nowhere/*.json"):
        with pytest.raises(SimConfigError, match=r"PCFRAME_TRACES=.*gone.* is not a directory"):
            select_traces(spec, tmp_path)
    with pytest.raises(ConfigError, match=r"failure\.path='nowhere\.csv'.*PCFRAME_TRACES"):
        resolve_trace("nowhere.csv")


def test_a_target_interval_of_any_real_number_is_seconds() -> None:
    """A plugin's target_interval returning a fractions.Fraction (a numbers.Real, so
    accepted) ended decide in a TypeError formatting its reason: 'unexpected error (a bug)'
    in pcframe-sim, a raw TypeError in the engine."""
    from fractions import Fraction

    class Sevenths(P.SecondsIntervalPolicy):
        name = "sevenths"

        def target_interval(self, ctx):
            return Fraction(600, 7)

    r = simulate(steady_trace(1.0), Sevenths(), JobSpec(restart_cost=0.0))
    assert r.saves == 41  # every 600/7 s + a 2 s stall, in an hour


class _Resources(P.ResourcePolicy):
    """A plugin resource policy answering what it was built with."""

    def __init__(self, answer) -> None:
        self.answer = answer

    def decide(self, ctx):
        return self.answer() if callable(self.answer) else self.answer


@pytest.mark.parametrize("spot", [float("nan"), 1.5, math.inf, "1", True])
def test_a_resource_decision_counts_whole_vms(spot) -> None:
    """NaN passed the `< 0` check (the simulator then ran nothing and reported goodput 0,
    exit 0), 1.5 ran and billed one and a half VMs, inf and "1" were raw tracebacks."""
    with pytest.raises(ValueError, match="VM counts must be whole numbers >= 0"):
        P.ResourceDecision(spot=spot)
    assert P.ResourceDecision(spot=np.int64(2)).spot == 2


@pytest.mark.parametrize("answer", [None, (1, 0), "spot"])
def test_a_resource_policy_returning_no_decision_is_named(answer) -> None:
    """None ended the simulation in a bare AssertionError, a tuple in an AttributeError."""
    with pytest.raises(PolicyError, match=r"_Resources\.decide returned .*ResourceDecision"):
        simulate(steady_trace(1.0), P.FixedSteps(10), JobSpec(), _Resources(answer))
    good = _Resources(P.ResourceDecision(spot=1))
    assert simulate(steady_trace(1.0), P.FixedSteps(10), JobSpec(), good).useful_steps > 0


@pytest.mark.parametrize(("reason", "shown"), [(3, "reason=3 (int)"), ([], "reason=[] (list)")])
def test_a_resource_decision_whose_reason_is_not_text_names_the_policy(reason, shown) -> None:
    """A non-text reason ran on unchecked (a falsy one silently dropped): now one line
    naming the resource policy's class and the field, in the simulator and the kit."""
    from pcframe.testing.policy_conformance import ResourcePolicyConformance

    bad = _Resources(P.ResourceDecision(spot=1, reason=reason))
    expected = rf"_Resources\.decide returned a ResourceDecision with {re.escape(shown)}"
    with pytest.raises(PolicyError, match=expected) as raised:
        simulate(steady_trace(1.0), P.FixedSteps(10), JobSpec(), bad)
    assert "\n" not in str(raised.value) and "must be a str. Fix: " in str(raised.value)

    class Kit(ResourcePolicyConformance):
        factory = staticmethod(lambda: bad)

    with pytest.raises(PolicyError, match=expected):
        Kit().test_never_raises_on_missing_inputs()


def _nested(levels: int) -> dict:
    state: dict = {}
    for _ in range(levels):
        state = {"a": state}
    return state


def test_policy_state_nested_past_the_recursion_limit_is_a_policy_error():
    """The simulator copies a policy's state through JSON: 5000 levels of nesting raised
    json's raw RecursionError out of simulate. Now a PolicyError naming the policy and the
    engine's limit (the engine refuses more than 64 levels)."""

    class Nested(P.FixedSteps):
        def state_dict(self) -> dict:
            return {**super().state_dict(), "x": _nested(5000)}

    with pytest.raises(PolicyError, match=r"Nested\.state_dict\(\).*at most 64 levels"):
        simulate(steady_trace(hours=1.0), Nested(10), JobSpec(restart_cost=10.0))


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"interval": P.Daly}, "interval="),
        ({"interval": "daly"}, "interval="),
        ({"resource": P.SpotOnly}, "resource="),
        ({"resource": "spot_only"}, "resource="),
        ({"predictor": P.EwmaRate}, "predictor="),
        ({"placement": P.SingleTier}, "placement="),
    ],
)
def test_a_policy_class_or_name_given_to_simulate_is_named(kwargs, key):
    """simulate() took a class or a registry name where a policy object goes and failed
    inside ("state_dict() missing 1 required positional argument: 'self'", "'str' object
    has no attribute 'decide'", "'property' object is not iterable")."""
    args = {"interval": P.FixedSteps(10), **kwargs}
    with pytest.raises(TypeError, match=re.escape(key)):
        simulate(steady_trace(hours=1.0), **args)
