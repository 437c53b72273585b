"""What this machine gives the apps: usable CPUs, the ``threads: auto`` rule, an identity.

``threads: auto`` (the default of ``pcframe-run`` and ``pcframe-tune``) is the number of CPUs
this process may use, as the kernel enforces it (the affinity mask and a cgroup CPU quota,
so a container's limit counts, not the host's core count), minus one core left to the
engine's own threads (snapshot copy, checksums, writers), and at least 1. More torch
threads than free cores only contend: on a busy 2-core machine the GPT workload ran 5-11x
slower with 2 threads than with 1.
"""

from __future__ import annotations

import math
import os
import platform
import socket
from pathlib import Path
from typing import Any

from pcframe.errors import ConfigError

ENGINE_RESERVE = 1  # cores left to the engine's threads by threads=auto
OVERSUBSCRIBE = 4  # a threads setting above this many per CPU is a slip, not a plan


def usable_cpus() -> int:
    """CPUs this process may run on: the affinity mask, capped by a cgroup CPU quota."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        count = os.cpu_count() or 1
    quota = _cgroup_quota()
    if quota is not None:
        count = min(count, max(1, math.ceil(quota)))
    return max(1, count)


def _cgroup_quota() -> float | None:
    """CPUs allowed by the cgroup (v2 ``cpu.max``, v1 ``cfs_quota_us``), ``None`` if no limit."""
    try:
        text = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if text and text[0] != "max":
            return int(text[0]) / int(text[1])
        return None
    except (OSError, ValueError, IndexError):
        pass
    try:
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def resolve_threads(value: Any, key: str = "threads") -> int:
    """The torch thread count for a ``threads`` config value: a positive number or ``auto``."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return max(1, usable_cpus() - ENGINE_RESERVE)
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(f"{key}={value!r} is invalid: give a whole number >= 1 or auto")
    try:
        threads = int(value)
    except ValueError:
        raise ConfigError(f"{key}={value!r} is invalid: give a whole number >= 1 or auto") from None
    if threads < 1:
        raise ConfigError(f"{key}={value!r} is invalid: give a whole number >= 1 or auto")
    cpus = os.cpu_count() or 1
    if threads > OVERSUBSCRIBE * cpus:  # threads=5000 started 10000 threads: others starved
        raise ConfigError(
            f"{key}={value!r} is invalid: at most {OVERSUBSCRIBE * cpus} on this machine "
            f"({cpus} CPUs; more torch threads than cores only contend), or auto"
        )
    return threads


def describe_threads(value: Any, threads: int) -> str:
    """``"1 (auto: 2 usable CPUs, 1 left to the engine)"`` or ``"4"``."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        cpus = usable_cpus()
        return f"{threads} (auto: {cpus} usable CPUs, {ENGINE_RESERVE} left to the engine)"
    return str(threads)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_gib() -> int:
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return round(pages * size / 2**30)
    except (AttributeError, ValueError, OSError):
        return 0


def machine_identity() -> dict[str, Any]:
    """What a tuned engine config depends on: CPU model and count, memory; the host name
    is recorded for people, but not compared (containers get a new one every start)."""
    return {
        "host": socket.gethostname(),
        "cpu": cpu_model(),
        "cpus": usable_cpus(),
        "memory_gib": memory_gib(),
    }


COMPARED = ("cpu", "cpus", "memory_gib")


def machine_differences(recorded: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """``["cpus 16 there, 2 here", ...]`` for the compared fields that differ."""
    return [
        f"{key} {recorded[key]!r} there, {here.get(key)!r} here"
        for key in COMPARED
        if key in recorded and recorded[key] != here.get(key)
    ]
