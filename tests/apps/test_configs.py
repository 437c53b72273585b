"""Every option of every config group composes, carries its values, and instantiates."""

from __future__ import annotations

import signal

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from pcframe.apps.compose import compose_config, engine_config
from pcframe.apps.instantiate import build as build_target
from pcframe.apps.preemption import kill_times
from pcframe.apps.tuning import Tuner, base_params, fixed_knobs, parse_space
from pcframe.apps.workloads import build
from pcframe.errors import ConfigError
from pcframe.policies import IntervalPolicy, PlacementPolicy, ResourcePolicy
from tests.apps.conftest import CONF, compose

PRIMARY = {p.stem for p in CONF.glob("*.yaml")}  # run, tune (and any app added later)


def _selected(path) -> set[str]:
    defaults = OmegaConf.to_container(OmegaConf.load(path)).get("defaults", [])
    return {
        next(iter(entry)).removeprefix("optional ").removeprefix("override ").strip("/")
        for entry in defaults
        if isinstance(entry, dict)
    }


def groups_of(primary: str) -> set[str]:
    """Config groups the primary config's defaults list selects, and the groups nested in
    the options it selects by default (``tune: default`` selects ``tune/target``)."""
    groups = _selected(CONF / f"{primary}.yaml")
    primary_defaults = OmegaConf.to_container(OmegaConf.load(CONF / f"{primary}.yaml"))
    for entry in primary_defaults.get("defaults", []):
        if isinstance(entry, dict):
            group, option = next(iter(entry.items()))
            path = CONF / str(group) / f"{option}.yaml"
            if path.is_file():
                groups |= {f"{group}/{nested}" for nested in _selected(path)}
    return groups


def options() -> list[tuple[str, str]]:
    """(group, option) for every YAML under conf/ except the primary configs: whatever
    exists, so options added by other people are covered too."""
    found = []
    for path in sorted(CONF.rglob("*.yaml")):
        group = path.parent.relative_to(CONF).as_posix()
        if group == "." and path.stem in PRIMARY:
            continue
        found.append((group, path.stem))
    return found


def primary_and_override(group: str, option: str) -> tuple[str, str]:
    for primary in sorted(PRIMARY, key=lambda p: p != "run"):
        if group in groups_of(primary):
            return primary, f"{group}={option}"
    owner = group.split("/")[0]  # e.g. sim/predictor belongs to conf/sim.yaml
    primary = owner if owner in PRIMARY else "run"
    return primary, f"+{group}={option}"  # e.g. placement/resource: not selected by run


def leaves(node, prefix=""):
    """(dotted key, value) for the scalar values an option file sets itself."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "defaults":
                continue
            yield from leaves(value, f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, node


def outermost_targets(node, path=""):
    """(path, node) of every ``_target_`` node not inside another one."""
    if OmegaConf.is_dict(node):
        if "_target_" in node:
            yield path, node
            return
        for key in node:
            yield from outermost_targets(node._get_node(key), f"{path}.{key}" if path else key)


def package_of(group: str, raw_text: str) -> str:
    first = raw_text.splitlines()[0] if raw_text else ""
    if first.startswith("# @package"):
        package = first.split()[-1]
        return "" if package == "_global_" else package
    return group.replace("/", ".")


@pytest.fixture(autouse=True)
def _keep_sigterm():
    # The notice policy's config installs a SIGTERM handler when instantiated; put the
    # test runner's own back afterwards.
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize(("group", "option"), options(), ids=lambda v: str(v))
def test_option_composes_and_instantiates(group, option, tmp_path):
    primary, override = primary_and_override(group, option)
    ours = primary in ("run", "tune")  # other apps' primaries have no storage group
    cfg = compose(primary, override, directory=tmp_path / "ckpt" if ours else None)
    path = CONF / group / f"{option}.yaml"
    raw = OmegaConf.to_container(OmegaConf.load(path))
    package = package_of(group, path.read_text())
    # What the file sets is what the composed config holds (nothing later overrides it;
    # experiments are applied last on purpose).
    for key, value in leaves(raw):
        if isinstance(value, str) and "${" in value:
            continue  # resolved in context (the Hydra output folder), replaced in tests
        full = f"{package}.{key}" if package else key
        if ours and full == "storage.directory":
            continue  # the test points every run at its own folder (tune/target presets)
        got = OmegaConf.select(cfg, full, throw_on_missing=True)
        if OmegaConf.is_config(got):
            got = OmegaConf.to_container(got, resolve=True)
        assert got == value, f"{group}/{option}: {full} is {got!r}, the file says {value!r}"

    # Instantiate everything the composed config describes.
    kinds = {
        "policy.interval": IntervalPolicy,
        "policy.placement": PlacementPolicy,
        "policy.resource": ResourcePolicy,
    }
    for node_path, node in outermost_targets(cfg):
        obj = instantiate(node)
        if node_path in kinds:
            assert isinstance(obj, kinds[node_path])
    if not ours:
        return
    try:
        engine = engine_config(cfg)
    except ConfigError as exc:
        # kernels=triton without a GPU may be refused up front, naming the key: that is an
        # error the user can act on, not a silent fallback.
        assert cfg.engine.copy_backend == "triton" and not torch.cuda.is_available()
        assert "engine.copy_backend" in str(exc)
        return
    assert engine.to_dict() == OmegaConf.to_container(cfg.engine)
    if primary == "run":
        workload = build(cfg.workload.name, **OmegaConf.to_container(cfg.workload.args))
        assert workload.state_bytes() > 0
        times = kill_times(cfg.failure)
        assert times == sorted(times) and all(t >= 0 for t in times)
        assert (cfg.failure.kind == "none") == (times == [])
    elif primary == "tune":
        tuner = Tuner(cfg, compose=lambda extra: cfg)
        assert {k.name for k in tuner.knobs} <= set(engine.to_dict())


def test_every_group_of_the_design_has_options():
    groups = {g for g, _ in options()}
    for group in (
        "engine",
        "storage",
        "kernels",
        "policy/interval",
        "policy/placement",
        "policy/resource",
        "workload",
        "failure",
        "experiment",
        "tune",
    ):
        assert group in groups, f"conf/{group} has no option"


def test_kernels_option_overrides_the_engine_even_a_tuned_one(tmp_path):
    assert compose("run", "kernels=numba", directory=tmp_path).engine.copy_backend == "numba"
    assert compose("run", "engine=serial", directory=tmp_path).engine.max_in_flight == 1
    # without a kernels option the engine's own value stands
    base = compose("run", directory=tmp_path)
    assert base.engine.copy_backend == engine_config(base).copy_backend


def test_experiment_overrides_the_primary_config(tmp_path):
    cfg = compose("run", "experiment=gpt_poisson", directory=tmp_path)
    assert cfg.workload.name == "gpt" and cfg.failure.kind == "poisson"
    assert cfg.steps == 400 and cfg.policy.interval.every == 10
    # and the command line still overrides the experiment
    cfg = compose("run", "experiment=gpt_poisson", "steps=7", directory=tmp_path)
    assert cfg.steps == 7


BAD_OVERRIDES = [
    # (overrides, exception type, text the message must contain); compose_config raises
    # ConfigError with the console scripts' line, Hydra's exception as its cause
    (["engine.max_inflight=3"], ConfigError, "engine.max_inflight"),
    (["engine.max_in_flight=abc"], ConfigError, "engine.max_in_flight"),
    (["engine=nosuch"], ConfigError, "nosuch"),
    (["workload.args.hiden=3"], ConfigError, "workload.args.hiden"),
    (["workload=gpt", "workload.args.width=wide"], ConfigError, "width"),
    (["failure=poisson", "failure.mtbf=soon"], ConfigError, "failure.mtbf"),
    (["failure=trace", "failure.compresion=3"], ConfigError, "compresion"),
    (["stepz=3"], ConfigError, "stepz"),
    (["+policy.interval.evry=3"], ConfigError, "policy.interval.evry"),
    # Young passes **kw to its base class: the typo was a TypeError naming the base class
    (
        ["policy/interval=young", "+policy.interval.mtbff=5"],
        ConfigError,
        "Young has no parameter 'mtbff' (did you mean 'mtbf'?)",
    ),
    (["policy.interval.every=often"], ConfigError, "policy.interval.every"),
    # a list for a mapping, and a mapping given whole without '+': said what to type
    (["engine.codecs=[nosuch]"], ConfigError, "engine.codecs is a mapping, not a list"),
    (["engine.codecs={model/*:zstd}"], ConfigError, "needs the + prefix: +engine.codecs="),
    (["policy.interval._target_=pcframe.policies.Nope"], ConfigError, "cannot be imported"),
]


@pytest.mark.parametrize(("overrides", "error", "text"), BAD_OVERRIDES, ids=str)
def test_bad_override_fails_at_compose_naming_the_key(overrides, error, text, tmp_path):
    with pytest.raises(error) as info:
        compose("run", *overrides, directory=tmp_path)
    message = str(info.value) + str(info.value.__cause__ or "")
    assert text in message


def test_out_of_range_engine_value_names_the_key_and_fix(tmp_path):
    cfg = compose("run", "engine.max_in_flight=0", directory=tmp_path)
    with pytest.raises(ConfigError, match=r"engine\.max_in_flight=0 .*use 1\.\.64"):
        engine_config(cfg)


@pytest.mark.parametrize(
    ("overrides", "text"),
    [
        (["failure=trace", "failure.path=no/such.csv"], "failure.path='no/such.csv'"),
        (["failure=trace", "failure.times=[1.0]"], "exactly one of failure.path"),
        (["failure=trace", "failure.compression=0"], "failure.compression=0"),
        (["failure=poisson", "failure.mtbf=-1"], "failure.mtbf=-1"),
        # NaN was dropped without a word (it fails every comparison): fewer kills came
        (["failure=trace", "failure.path=null", "failure.times=[nan]"], "failure.times=[nan]"),
        (["failure=trace", "failure.path=null", "failure.times=[inf]"], "failure.times=[inf]"),
        (["failure=trace", "failure.path=null", "failure.times=[-1]"], "failure.times=[-1.0]"),
        (["failure=trace", "failure.offset=nan"], "failure.offset=nan"),
    ],
    ids=str,
)
def test_bad_failure_values_name_the_key(overrides, text, tmp_path):
    # Composing refuses a value out of range (pcframe.apps.bounds); kill_times checks the
    # rest, and the same values again when the config does not come through compose.
    with pytest.raises(ConfigError) as info:
        kill_times(compose("run", *overrides, directory=tmp_path).failure)
    assert text in str(info.value)
    unchecked = compose_config("run", [f"storage.directory={tmp_path}", *overrides], check=False)
    with pytest.raises(ConfigError) as info:
        kill_times(unchecked.failure)
    assert text in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["policy.interval.every=0"], "policy.interval.every=0 is invalid: FixedSteps"),
        (
            ["policy/interval=notice", "policy.interval.source.window=0"],
            "policy.interval.source.window=0 is invalid",
        ),
        (["policy/interval=daly", "policy.interval.form=approx"], "policy.interval.form='approx'"),
    ],
    ids=str,
)
def test_a_value_the_policy_refuses_names_the_key(tmp_path, overrides, words):
    cfg = compose("run", *overrides, directory=tmp_path)
    with pytest.raises(ConfigError) as info:
        build_target(cfg.policy.interval, "policy.interval")
    assert words in str(info.value) and "\n" not in str(info.value)


def test_an_unknown_target_logs_nothing_before_its_one_line(tmp_path, caplog):
    with pytest.raises(ConfigError, match="ModuleNotFoundError: No module named 'nosuch'"):
        compose("run", "policy.interval._target_=nosuch.Policy", directory=tmp_path)
    assert not [r for r in caplog.records if r.name.startswith("hydra")], caplog.text


@pytest.mark.parametrize(
    ("space", "text"),
    [
        ({"turbo": {"type": "categorical", "choices": ["yes"]}}, "tune.space.turbo"),
        ({"max_in_flight": {"type": "int", "low": 3, "high": 1}}, "low < high"),
        ({"checksum": {"type": "categorical", "choices": []}}, "non-empty"),
        ({"chunk_bytes": {"type": "integer", "low": 1, "high": 2}}, "tune.space.chunk_bytes.type"),
    ],
    ids=str,
)
def test_bad_search_space_names_the_knob(space, text):
    with pytest.raises(ConfigError) as info:
        parse_space(space)
    assert text in str(info.value)


def test_null_removes_a_knob_and_pinned_knobs_leave_the_search(tmp_path):
    cfg = compose("tune", "tune.space.checksum=null", directory=tmp_path)
    pinned = fixed_knobs(["engine.o_direct=off", "kernels=numba", "tune.n_trials=3"])
    assert pinned == {"o_direct", "copy_backend"}
    names = {k.name for k in parse_space(cfg.tune.space, fixed=pinned)}
    assert not names & {"checksum", "o_direct", "copy_backend"} and "max_in_flight" in names


def test_trial_parameters_compose_into_the_engine_including_dict_values(tmp_path):
    base = ["tune=quick"]
    cfg = compose("tune", *base, directory=tmp_path)
    tuner = Tuner(cfg, compose=lambda extra: compose("tune", *base, *extra, directory=tmp_path))
    params = {"o_direct": "off", "checksum": "xxh3_64", "codecs": "zstd", "max_in_flight": 3}
    composed, engine = tuner.trial_config(params)
    assert engine.o_direct == "off"  # quoted: YAML would read a bare off as false
    assert engine.codecs == {"*": "zstd"} and engine.max_in_flight == 3
    assert composed.engine.codecs == {"*": "zstd"}
    # the base engine's values are trial 0, a dict value by its name
    assert base_params(engine, tuner.knobs)["codecs"] == "zstd"
