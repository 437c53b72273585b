"""PeersThenRemote: peers every version, the object store by count and/or time, notices,
learned state across a restart, and how the distributed engine asks it."""

from __future__ import annotations

import json

import pytest

import pcframe.policies as P
from pcframe.policies import Notice, PlacementContext
from pcframe.policies.placement import PEERS_TIER, RemoteDue


def place(
    policy: P.PlacementPolicy, version: int, now: float = 0.0, **kw: object
) -> P.PlacementDecision:
    return policy.place(PlacementContext(version=version, step=10 * version, now=now, **kw))  # type: ignore[arg-type]


def uploads(policy: P.PlacementPolicy, versions: range, seconds_per_version: float) -> list[int]:
    """The versions placed in the object store, with the clock moving evenly."""
    out = []
    for v in versions:
        d = place(policy, v, now=v * seconds_per_version)
        assert d.tiers[:2] == ("local", "peers"), d  # local disk and peers: every version
        if "remote" in d.tiers:
            out.append(v)
    return out


def test_tiers_primary_first_and_registry_name() -> None:
    p = P.PeersThenRemote()
    assert p.tiers == ("local", "peers", "remote")  # the first is the engine's own directory
    assert P.get("peers_then_remote") is P.PeersThenRemote
    made = P.create("peers_then_remote", remote_every=3)
    assert isinstance(made, P.PeersThenRemote) and made.remote_every == 3


def test_peer_tier_name_is_the_distributed_engines() -> None:
    from pcframe.distributed.job_tiers import PEERS

    assert PEERS_TIER == PEERS == P.PeersThenRemote().peers_tier


def test_peers_every_version_remote_every_nth() -> None:
    p = P.PeersThenRemote(remote_every=4)
    assert uploads(p, range(1, 14), seconds_per_version=1000.0) == [4, 8, 12]


def test_remote_by_time_since_the_last_upload() -> None:
    p = P.PeersThenRemote(remote_every=None, remote_every_seconds=100.0)
    # 30 s per version: the first version goes up (nothing is there yet), then the first
    # version at least 100 s after the last upload: t=30, 150, 270, 390
    assert uploads(p, range(1, 15), seconds_per_version=30.0) == [1, 5, 9, 13]


def test_count_and_time_rules_together() -> None:
    p = P.PeersThenRemote(remote_every=5, remote_every_seconds=100.0)
    # count: 5, 10; time (30 s per version): 1, then 100 s after each upload from either rule
    assert uploads(p, range(1, 16), seconds_per_version=30.0) == [1, 5, 9, 10, 14, 15]


def test_asking_again_about_a_version_gives_the_same_answer() -> None:
    """The engine asks about a version at its commit, after each copy (retention) and on
    rank 0 when it becomes global, each time with a later clock: the answer must not flip
    (a flip would record an upload that never happened and delay the next one)."""
    p = P.PeersThenRemote(remote_every=None, remote_every_seconds=100.0)
    assert "remote" in place(p, 1, now=0.0).tiers
    assert "remote" not in place(p, 2, now=99.0).tiers
    state = json.dumps(p.state_dict())
    assert "remote" not in place(p, 2, now=500.0).tiers  # later clock, same version
    assert "remote" in place(p, 1, now=600.0).tiers  # an older version: its own answer
    assert json.dumps(p.state_dict()) == state  # re-asks learn nothing
    assert "remote" in place(p, 3, now=101.0).tiers


def test_retention_per_tier() -> None:
    p = P.PeersThenRemote(remote_every=2, local_keep=2, peers_keep=2, remote_keep=3)
    committed = {"local": (3, 4), "peers": (3, 4), "remote": (2, 4)}
    d = place(p, 5, committed=committed)
    assert d.tiers == ("local", "peers")
    assert d.keep == {"local": (4, 5), "peers": (4, 5), "remote": (2, 4)}
    d = place(p, 6, committed={"local": (4, 5), "peers": (4, 5), "remote": (2, 4)})
    assert d.keep["remote"] == (2, 4, 6)


def test_notice_peers_first_then_remote_if_it_fits() -> None:
    p = P.PeersThenRemote(remote_every=100, margin=5.0)
    times = {"local": 1.0, "remote": 20.0}
    # 30 s of notice, 25 after the margin: the upload (20 s) fits
    d = place(p, 3, now=0.0, tier_write_times=times, notice=Notice(0.0, 30.0))
    assert d.tiers == ("peers", "local", "remote")
    assert RemoteDue.NOTICE.value in d.reason
    # 20 s of notice, 15 after the margin: peers alone (local disk dies with the VM)
    d = place(p, 4, now=0.0, tier_write_times=times, notice=Notice(0.0, 20.0))
    assert d.tiers == ("peers", "local")
    assert d.keep["peers"][-1] == 4
    # the upload time unknown: peers alone
    d = place(p, 5, now=0.0, notice=Notice(0.0, 1000.0))
    assert d.tiers == ("peers", "local")


def test_notice_without_a_deadline_goes_to_peers() -> None:
    """Rank 0 asks with ``Notice(deadline=None)`` (job_tiers.peers_due): the window is
    unknown, the peer tier is the answer, and nothing raises."""
    p = P.PeersThenRemote(remote_every=2)
    d = place(p, 4, now=0.0, notice=Notice(0.0, None, "rank"))  # type: ignore[arg-type]
    assert d.tiers == ("peers", "local")


def test_an_upload_on_a_notice_restarts_the_time_rule() -> None:
    p = P.PeersThenRemote(remote_every=None, remote_every_seconds=100.0)
    place(p, 1, now=0.0)  # first upload
    d = place(p, 2, now=90.0, tier_write_times={"remote": 5.0}, notice=Notice(90.0, 120.0))
    assert "remote" in d.tiers
    assert "remote" not in place(p, 3, now=150.0).tiers  # 60 s after the notice's upload
    assert "remote" in place(p, 4, now=190.0).tiers


def test_state_survives_a_restart_as_json() -> None:
    a = P.PeersThenRemote(remote_every=None, remote_every_seconds=100.0)
    for v in range(1, 5):
        place(a, v, now=30.0 * v)  # uploads 1 (t=30); the last ask at t=120
    b = P.PeersThenRemote(remote_every=None, remote_every_seconds=100.0)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for v, now in ((5, 125.0), (6, 131.0), (7, 200.0)):
        assert place(a, v, now=now).tiers == place(b, v, now=now).tiers
    # without the state a restarted process uploads its first version (nothing known)
    fresh = P.PeersThenRemote(remote_every=None, remote_every_seconds=100.0)
    assert "remote" in place(fresh, 8, now=210.0).tiers


def test_a_clock_that_went_back_uploads() -> None:
    """State written by another process (another monotonic clock): the age of the last
    upload is unknown, so the next version goes to the object store."""
    a = P.PeersThenRemote(remote_every=None, remote_every_seconds=100.0)
    place(a, 1, now=5000.0)
    b = P.PeersThenRemote(remote_every=None, remote_every_seconds=100.0)
    b.load_state_dict(a.state_dict())
    d = place(b, 2, now=12.0)
    assert "remote" in d.tiers and RemoteDue.CLOCK.value in d.reason
    assert "remote" not in place(b, 3, now=40.0).tiers  # counted from the new clock


def test_the_distributed_engine_asks_it_for_the_peer_tier(tmp_path) -> None:
    """Rank 0 asks through the local engine's tiers (which serialize the calls), with an
    unbounded notice for an emergency version."""
    from pcframe.distributed.job_tiers import PEERS, peers_due
    from pcframe.store.directory import WritableCheckpointDir
    from pcframe.store.tiers import Tiers

    tiers = Tiers(
        {"remote": tmp_path / "remote"}, P.PeersThenRemote(remote_every=3), external=(PEERS,)
    )
    tiers.attach(WritableCheckpointDir(tmp_path / "local"), keep_last=2)
    try:
        due = peers_due(tiers, replicas=1)
        assert due is not None
        assert [due(v, False) for v in range(1, 5)] == [True] * 4
        assert due(5, True)  # an emergency version: peers first
        assert peers_due(tiers, replicas=0) is None
    finally:
        tiers.close()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"remote_every": None, "remote_every_seconds": None}, "remote_every"),
        ({"remote_every": 0}, "remote_every=0"),
        ({"remote_every": 2.5}, "remote_every=2.5"),
        ({"remote_every_seconds": 0.0}, "remote_every_seconds"),
        ({"remote_every_seconds": float("inf")}, "remote_every_seconds"),
        ({"remote_keep": 0}, "keep"),
        ({"peers_tier": "local"}, "unique"),
    ],
)
def test_bad_config_is_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        P.PeersThenRemote(**kwargs)
