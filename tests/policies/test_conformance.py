"""The conformance kit over every shipped policy and predictor (and the kit over itself)."""

from __future__ import annotations

import pytest

import pcframe.policies as P
from pcframe.policies.traces import load_traces, shared_traces_dir
from pcframe.testing import (
    IntervalPolicyConformance,
    PlacementPolicyConformance,
    PredictorConformance,
    ResourcePolicyConformance,
)

# --- interval ---------------------------------------------------------------------------------


class TestFixedSteps(IntervalPolicyConformance):
    factory = staticmethod(lambda: P.FixedSteps(every=25))


class TestFixedTime(IntervalPolicyConformance):
    factory = staticmethod(lambda: P.FixedTime(seconds=60.0))


class TestYoung(IntervalPolicyConformance):
    factory = staticmethod(lambda: P.Young(mtbf=1800.0))


class TestDalyExact(IntervalPolicyConformance):
    factory = staticmethod(lambda: P.Daly(mtbf=1800.0, form="exact"))


class TestDalySeries(IntervalPolicyConformance):
    factory = staticmethod(lambda: P.Daly(mtbf=1800.0, form="series", cost="duration"))


class TestOverheadBudget(IntervalPolicyConformance):
    factory = staticmethod(lambda: P.OverheadBudget(budget=0.05))


class TestCheckFreq(IntervalPolicyConformance):
    factory = staticmethod(lambda: P.CheckFreq(budget=0.05))


class TestPreemptionAware(IntervalPolicyConformance):
    factory = staticmethod(lambda: P.PreemptionAware(P.WindowedPoisson(prior_mtbf=1800.0)))


class TestPreemptionAwareWindowUpper(IntervalPolicyConformance):
    # the upper bound is infinite before any exposure: must not break the interval
    factory = staticmethod(lambda: P.PreemptionAware(P.WindowedPoisson(), bound="upper"))


class TestPreemptionAwareDefault(IntervalPolicyConformance):
    factory = staticmethod(lambda: P.PreemptionAware(bound="upper"))


class TestPreemptionAwareLives(IntervalPolicyConformance):
    # plans against its own lives (a life shape prior, so the interval follows the age)
    factory = staticmethod(
        lambda: P.PreemptionAware(
            P.GammaPoissonRate(1800.0, life_prior=[1.0 / 7] * 7), schedule="lives"
        )
    )


class TestNoticeDrivenAroundDaly(IntervalPolicyConformance):
    factory = staticmethod(lambda: P.NoticeDriven(P.Daly(mtbf=1800.0), P.ManualNoticeSource()))


class TestNoticeDrivenAlone(IntervalPolicyConformance):
    factory = staticmethod(lambda: P.NoticeDriven())
    expects_periodic_saves = False


# --- placement --------------------------------------------------------------------------------


class TestSingleTier(PlacementPolicyConformance):
    factory = staticmethod(lambda: P.SingleTier())


class TestMemoryThenDisk(PlacementPolicyConformance):
    factory = staticmethod(lambda: P.MemoryThenDisk(disk_every=3))


class TestLocalPlusRemote(PlacementPolicyConformance):
    factory = staticmethod(lambda: P.LocalPlusRemote(remote_every=4))


class TestPeersThenRemote(PlacementPolicyConformance):
    # both rules: the kit's clock moves 10 s per version, so the time rule fires in between
    factory = staticmethod(lambda: P.PeersThenRemote(remote_every=7, remote_every_seconds=45.0))


class TestPeersThenRemoteByTime(PlacementPolicyConformance):
    # the time rule alone: its learned state (the last upload's time) must round-trip
    factory = staticmethod(lambda: P.PeersThenRemote(remote_every=None, remote_every_seconds=35.0))


# --- resource ---------------------------------------------------------------------------------


class TestSpotOnly(ResourcePolicyConformance):
    factory = staticmethod(lambda: P.SpotOnly(vms=2))


class TestOnDemandOnly(ResourcePolicyConformance):
    factory = staticmethod(lambda: P.OnDemandOnly())


class TestHybridAvailability(ResourcePolicyConformance):
    factory = staticmethod(lambda: P.HybridAvailability(min_dwell=1200.0))


class TestUniformProgress(ResourcePolicyConformance):
    factory = staticmethod(lambda: P.UniformProgress())


# --- predictors -------------------------------------------------------------------------------


class TestWindowedPoisson(PredictorConformance):
    factory = staticmethod(lambda: P.WindowedPoisson())


class TestEwmaRate(PredictorConformance):
    factory = staticmethod(lambda: P.EwmaRate())


class TestGammaPoisson(PredictorConformance):
    factory = staticmethod(lambda: P.GammaPoissonRate(forget_halflife=86400.0))


def _h100_traces() -> list:
    root = shared_traces_dir()
    if root is None:
        pytest.skip("no trace directory: copy shared/traces to experiments/traces")
    return load_traces(root / "skynomad" / "gcp-h100-16-2025")


class TestHazardByTimeOfDay(PredictorConformance):
    @staticmethod
    def factory() -> P.HazardByTimeOfDay:
        return P.HazardByTimeOfDay(_h100_traces(), prior_strength=3600.0)


# --- every shipped name is covered above ------------------------------------------------------


def test_every_registered_builtin_has_a_conformance_class() -> None:
    covered = set()
    for cls in list(globals().values()):
        if isinstance(cls, type) and cls.__name__.startswith("Test"):
            factory = cls.__dict__.get("factory")
            if factory is not None:
                obj = factory.__func__() if isinstance(factory, staticmethod) else factory()
                covered.add(obj.name)
    shipped = {
        n
        for k in ("interval", "placement", "resource", "predictor")
        for n in P.available(k)
        if P.get(n).__module__.startswith("pcframe.policies")
    }
    assert shipped <= covered, f"no conformance test for {sorted(shipped - covered)}"
