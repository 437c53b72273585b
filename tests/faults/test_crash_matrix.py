"""SIGKILL at every crash point in every mode; the directory always recovers.

Modes (:data:`tests.faults.harness.MODES`): raw tensors, zstd codecs, int8_block on the Adam
moment stand-in, xor_delta_zstd deltas (keep_last=1, full_every=3), persist="mmap", a local
replica tier, a remote replica tier on a real S3-compatible server (moto, loopback) and two
ranks with ``DistributedCheckpointer`` (real gloo process groups).

For each (mode, point) a child saves in a loop and SIGKILLs itself at the point
(``PCFRAME_CRASH_AT``). Then:

* every committed version (primary, replica, every rank's shard, every global record)
  verifies and holds exactly one step (the stamp optimizer writes the step into every
  parameter);
* no version the child was told is committed is lost; LATEST (GLOBAL) names a committed
  version and is not behind one;
* a fresh writer starts clean, restores the newest committed version and commits again,
  numbered above everything before.

The default suite runs each point once in raw mode and each mode at its own points
(``Mode.fast_points``); the whole cross product, at an early and a late pass of each point,
is marked ``campaign`` (not in the default run: ``pytest -m campaign``).
"""

from __future__ import annotations

import signal
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.faults.harness import (
    DEFAULT_NTH,
    MODES,
    check_directory,
    check_global,
    crash_rank,
    leftovers,
    remote_versions,
    resume_in_process,
    run_children,
)


def _cases() -> list[Any]:
    cases = []
    for mode in MODES.values():
        for point in mode.points:
            nth = DEFAULT_NTH[point]
            fast = point in mode.fast_points
            marks = () if fast else (pytest.mark.campaign,)
            cases.append(
                pytest.param(mode.name, point, nth, marks=marks, id=f"{mode.name}-{point}")
            )
            if nth != 1:  # the very first pass too: often nothing is committed yet
                cases.append(
                    pytest.param(
                        mode.name,
                        point,
                        1,
                        marks=(pytest.mark.campaign,),
                        id=f"{mode.name}-{point}-first",
                    )
                )
    return cases


def config_for(mode: str, tmp_path: Path, request: pytest.FixtureRequest) -> dict[str, Any]:
    config: dict[str, Any] = {"mode": mode, "root": str(tmp_path / "ckpt")}
    tier = MODES[mode].tier
    if tier == "local":
        config["replica"] = str(tmp_path / "replica")
    elif tier == "remote":
        server = request.getfixturevalue("moto_server")  # tests/faults/conftest.py
        config["remote_url"] = f"s3://ckpt-{uuid.uuid4().hex[:12]}/run"
        config["storage_options"] = server.storage_options()
    return config


def check_replica(config: dict[str, Any], tmp_path: Path, primary: dict[int, int]) -> None:
    """Every version the replica lists verifies and is one the primary committed."""
    tier = MODES[config["mode"]].tier
    if tier == "local":
        replica = check_directory(Path(config["replica"]), {})
    elif tier == "remote":
        replica = remote_versions(config["remote_url"], config["storage_options"], tmp_path)
    else:
        return
    newest = max(primary, default=0)
    for version, step in replica.items():
        assert version <= newest, f"replica has v{version}, newer than the primary's {newest}"
        if version in primary:
            assert primary[version] == step


@pytest.mark.parametrize(("mode", "point", "nth"), _cases())
@pytest.mark.slow
def test_sigkill_at_crash_point(mode, point, nth, tmp_path, request):
    config = config_for(mode, tmp_path, request)
    rank = crash_rank(point) if MODES[mode].ranks > 1 else 0
    crashed = run_children("save", config, f"{point}:{nth}", rank=rank)
    assert not crashed.timed_out, f"the saver hung\n{crashed.tail()}"
    assert crashed.returncodes[rank] == -signal.SIGKILL, (
        f"did not crash at {point}:{nth} by itself\n{crashed.tail()}"
    )
    root = Path(config["root"])
    told = crashed.committed
    if MODES[mode].ranks > 1:
        steps = check_global(root, told)
        expected = steps[max(steps)] if steps else None
        resumed = run_children("resume", config)
        assert resumed.returncodes == [0, 0], resumed.tail()
        for r in range(2):
            result = resumed.result(r)
            assert result["step"] == expected, (result, sorted(steps))
            assert result["stamped"] and result["status"] == "committed", result
        after = check_global(root, {})
        assert max(after) > max(steps, default=0)
        assert max(after) > max(told, default=0)
        return
    steps = check_directory(root, told)
    check_replica(config, tmp_path, steps)
    expected = steps[max(steps)] if steps else None
    resume_in_process(config, expected)
    assert not leftovers(root)
    check_directory(root, {})
    check_replica(config, tmp_path, check_directory(root, {}))
