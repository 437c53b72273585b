"""Tuning targets: the storage a study measures on, set up for real and torn down after.

A target is a named preset (``pcframe-tune tune/target=<name>``, ``conf/tune/target/``):

* ``disk``: ``storage.directory`` on this machine's disk as it is;
* ``throttled``: the same disk capped to a network disk's rate by the cgroup v1 blkio
  throttle (:mod:`~pcframe.apps.tuning.throttle`; this process moves into the cgroup);
* ``tmpfs``: ``storage.directory`` in RAM (``/dev/shm``): no disk at all;
* ``s3``: primary on tmpfs plus a remote tier on an S3 server on loopback
  (:mod:`~pcframe.apps.tuning.loopback_s3`); a checkpoint counts as done once uploaded.

:func:`open_target` checks that the machine can provide the target (one-line
:class:`ConfigError` naming the key and the fix otherwise), sets it up, and undoes it on exit.
:func:`storage_identity` describes where a directory really is (device, file system, blkio
throttle), recorded in the tuned config and compared by ``pcframe-run``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from pcframe.apps.limits import measure_limits
from pcframe.apps.tuning.loopback_s3 import LoopbackS3, check_s3_possible, put_rate
from pcframe.apps.tuning.throttle import (
    BlkioThrottle,
    block_device_of,
    check_throttle_possible,
    current_limits,
)
from pcframe.errors import ConfigError
from pcframe.store.mounts import file_system_type

KEY = "tune.target"
RAM_FILE_SYSTEMS = ("tmpfs", "ramfs")


class TargetKind(StrEnum):
    DISK = "disk"
    THROTTLED = "throttled"
    TMPFS = "tmpfs"
    S3 = "s3"


SETTINGS = {
    TargetKind.DISK: (),
    TargetKind.THROTTLED: ("write_bps", "read_bps"),
    TargetKind.TMPFS: (),
    TargetKind.S3: (),
}


@dataclass(frozen=True)
class TargetSpec:
    """A validated ``tune.target`` node."""

    name: str
    kind: TargetKind
    write_bps: int | None = None
    read_bps: int | None = None

    @classmethod
    def from_config(cls, node: Mapping[str, Any] | None) -> TargetSpec | None:
        if node is None:
            return None
        node = dict(node)
        kind = node.get("kind")
        if kind not in {k.value for k in TargetKind}:
            raise ConfigError(
                f"{KEY}.kind={kind!r} is invalid: use one of "
                f"{', '.join(k.value for k in TargetKind)} (or pick a preset: tune/target=disk)"
            )
        kind = TargetKind(kind)
        allowed = ("name", "kind", *SETTINGS[kind])
        unknown = [k for k in node if k not in allowed]
        if unknown:
            raise ConfigError(
                f"{KEY}.{unknown[0]} is not a setting of a {kind} target; use {', '.join(allowed)}"
            )
        rates = {}
        for key in SETTINGS[kind]:
            value = node.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(f"{KEY}.{key}={value!r}: give bytes per second, e.g. 52428800")
            if value is not None and value < 1 << 20:
                raise ConfigError(
                    f"{KEY}.{key}={value}: below 1 MiB/s a checkpoint takes minutes; give "
                    "bytes per second, e.g. 52428800 (50 MiB/s)"
                )
            rates[key] = value
        if kind == TargetKind.THROTTLED and not rates.get("write_bps"):
            raise ConfigError(f"{KEY}.write_bps is required for a throttled target, e.g. 52428800")
        return cls(str(node.get("name") or kind.value), kind, **rates)


@dataclass(frozen=True)
class Limit:
    """A target's own ceilings: one memcpy, and where the bytes finally go (disk or server)."""

    memcpy_bps: float
    write_bps: float
    write_low: float
    write_high: float
    what: str  # "disk write (O_DIRECT + fsync)", "S3 PUT (loopback)"


@dataclass
class ActiveTarget:
    """A target while it is set up: where to write, which tiers to attach."""

    spec: TargetSpec | None
    directory: Path
    server: LoopbackS3 | None = field(default=None, repr=False)

    def tiers(self, label: str) -> dict[str, Any] | None:
        """Replica tiers for one measurement named ``label`` (a fresh remote prefix)."""
        if self.server is None:
            return None
        return {"s3": self.server.tier(f"{label}-{os.getpid()}")}

    @property
    def name(self) -> str:
        return self.spec.name if self.spec else "unnamed"

    def identity(self) -> dict[str, Any]:
        """What the tuned config records: the target and where its storage really is."""
        found = storage_identity(self.directory)
        found["name"] = self.name
        found["kind"] = self.spec.kind.value if self.spec else None
        found["remote"] = "s3 (loopback moto server)" if self.server else None
        return found

    def remote_lines(self, nbytes: int) -> list[str]:
        """The remote tier's own limit, for the lines ``pcframe-tune`` prints (s3 only)."""
        if self.server is None or nbytes <= 0:
            return []
        median, low, high = put_rate(self.server, nbytes)
        return [
            f"remote tier limit: one S3 PUT of {max(nbytes, 1 << 20) / 1e6:.1f} MB to the "
            "loopback server: "
            f"{median / 1e9:.2f} GB/s ({low / 1e9:.2f}..{high / 1e9:.2f})"
        ]

    def limits(self, nbytes: int, repeats: int = 3) -> Limit:
        """Measure this target's limits for a checkpoint of ``nbytes`` (inside the target)."""
        machine = measure_limits(self.directory, nbytes, repeats=repeats)
        if self.server is not None:
            median, low, high = put_rate(self.server, nbytes, repeats)
            return Limit(machine.memcpy.median, median, low, high, "S3 PUT (loopback)")
        disk = machine.disk_write
        how = "O_DIRECT" if machine.direct else "buffered"
        return Limit(machine.memcpy.median, disk.median, disk.low, disk.high, f"{how} + fsync")


def storage_identity(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Device, file system and this process's blkio limits for ``directory``.

    A directory that does not exist yet (``pcframe-run`` makes its output folder later) is
    described by its nearest existing parent: that is where it will be created.
    """
    path = Path(directory).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    device = block_device_of(path)
    write_bps, read_bps = current_limits(device)
    return {
        "device": device,
        "fs_type": file_system_type(path),
        "write_bps": write_bps,
        "read_bps": read_bps,
    }


def _refuse_wrong_file_system(spec: TargetSpec, directory: Path) -> None:
    fs = file_system_type(directory) or "an unknown file system"
    in_ram = fs in RAM_FILE_SYSTEMS
    if spec.kind in (TargetKind.TMPFS, TargetKind.S3) and not in_ram:
        raise ConfigError(
            f"{KEY}={spec.name}: storage.directory={directory} is on {fs}, not tmpfs; "
            "set storage.directory to a folder under /dev/shm"
        )
    if spec.kind in (TargetKind.DISK, TargetKind.THROTTLED) and in_ram:
        raise ConfigError(
            f"{KEY}={spec.name}: storage.directory={directory} is in RAM ({fs}), not on a "
            "disk; set storage.directory to a folder on the disk, e.g. /var/tmp/pcframe-tune"
        )


def check_target(spec: TargetSpec | None, directory: str | os.PathLike[str]) -> None:
    """Refuse, before anything is set up, a target this machine cannot provide."""
    if spec is None:
        return
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _refuse_wrong_file_system(spec, directory)
    if spec.kind == TargetKind.THROTTLED:
        check_throttle_possible(directory, f"{KEY}={spec.name}")
    if spec.kind == TargetKind.S3:
        check_s3_possible(f"{KEY}={spec.name}")


@contextlib.contextmanager
def open_target(
    spec: TargetSpec | None, directory: str | os.PathLike[str]
) -> Iterator[ActiveTarget]:
    """Set ``spec`` up on ``directory`` (``storage.directory``); undo it on exit."""
    directory = Path(directory)
    check_target(spec, directory)
    directory.mkdir(parents=True, exist_ok=True)
    if spec is None or spec.kind in (TargetKind.DISK, TargetKind.TMPFS):
        yield ActiveTarget(spec, directory)
    elif spec.kind == TargetKind.THROTTLED:
        with BlkioThrottle(block_device_of(directory), spec.write_bps, spec.read_bps):
            yield ActiveTarget(spec, directory)
    else:
        with LoopbackS3() as server:
            yield ActiveTarget(spec, directory, server=server)


def target_differences(recorded: Mapping[str, Any], directory: str | os.PathLike[str]) -> list[str]:
    """How the storage at ``directory`` differs from the target a config was tuned for."""
    here = storage_identity(directory)
    problems = []
    if recorded.get("fs_type") and recorded["fs_type"] != here["fs_type"]:
        problems.append(f"file system {recorded['fs_type']} there, {here['fs_type']} here")
    elif recorded.get("device") and recorded["device"] != here["device"]:
        problems.append(f"device {recorded['device']} there, {here['device']} here")
    for key, label in (("write_bps", "write limit"), ("read_bps", "read limit")):
        there, now = recorded.get(key), here[key]
        if there != now:
            problems.append(f"{label} {_rate(there)} there, {_rate(now)} here")
    if recorded.get("remote"):
        problems.append(f"remote tier {recorded['remote']} there, none here")
    if problems:
        problems[0] = f"target {recorded.get('name')!r} ({os.fspath(directory)}): {problems[0]}"
    return problems


def _rate(bps: int | None) -> str:
    return "none (full speed)" if bps is None else f"{bps / 2**20:.0f} MiB/s (blkio throttle)"
