"""How many shifted replays a configuration gets: as many as its own noise asks for.

A replay is one draw of the machine's restart and step times. Where a configuration's
interval is near the gaps between kills, a fraction of a second of restart decides whether
an interval's work is kept, and one replay's goodput scatters by 20 % around what the
simulator predicts: no single replay can check a 5 % error there. The prediction says how
much before the replay runs (the spread of its seeds, drawn with the calibrated spread), so
the validation sizes itself: each configuration is replayed at shifted offsets until
``SIGMAS`` x the noise of the replays' mean fits in ``TOLERANCE`` (the noise of a mean of
independent replays falls as one over the root of their number), at most ``most`` times.
A configuration that would need more is replayed its least number of times and reported as
one the replays cannot check, with the number that would.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Issue 43, item 1: a prediction within this many % of the measured goodput; a replay can
# check that only where this many standard deviations of its own noise fit inside it.
TOLERANCE = 5.0
SIGMAS = 2.0


@dataclass(frozen=True)
class Forecast:
    """One replay's prediction over its window, made before it runs: the mean goodput of
    the seeds and their standard deviation (steps/s)."""

    offset: float
    goodput: float
    spread: float


@dataclass(frozen=True)
class Sizing:
    """The offsets to replay a configuration at, whether their mean checks ``TOLERANCE``,
    the noise of that mean (%), how many offsets were forecast, and how many of them were
    added to the least the plan gave."""

    offsets: tuple[float, ...]
    checkable: bool
    noise_pct: float
    tried: int
    added: int

    def describe(self) -> str:
        return (
            f"{len(self.offsets)} replay(s) at offsets {', '.join(f'{o:g}' for o in self.offsets)}"
            f" (noise of their mean {self.noise_pct:.1f} %"
            + ("" if self.checkable else f"; even {self.tried} would not check {TOLERANCE:g} %")
            + ")"
        )


def mean_noise_pct(forecasts: Sequence[Forecast]) -> float:
    """The noise of the mean goodput of independent replays, relative to their mean
    prediction: their spreads add in quadrature."""
    mean = statistics.fmean(f.goodput for f in forecasts)
    if mean <= 0:
        return math.nan
    return 100.0 * math.sqrt(sum(f.spread**2 for f in forecasts)) / len(forecasts) / mean


def can_check(noise_pct: float) -> bool:
    return SIGMAS * noise_pct <= TOLERANCE


def replays_needed(noise_pct: float, replays: int) -> int:
    """Shifted replays for ``SIGMAS`` x the noise of their mean to fit in ``TOLERANCE``,
    given ``replays`` whose mean has ``noise_pct`` (the noise falls as one over the root of
    their number); never fewer than were run."""
    return max(replays, math.ceil(replays * (SIGMAS * noise_pct / TOLERANCE) ** 2))


def candidate_offsets(first: Sequence[float], offsets: Sequence[float], count: int) -> list[float]:
    """``count`` offsets (in mean gaps) to shift a configuration's replays by: ``first``
    (those it gets anyway), the other ``offsets``, then the points halfway between
    neighbouring ones and past the last, then a quarter of the way, and so on: each new
    one as far as may be from those already taken, so the kills fall on new phases."""
    out = list(dict.fromkeys([*first, *offsets]))
    grid = sorted(set(offsets)) or [0.0]
    step = min((b - a for a, b in itertools.pairwise(grid)), default=1.0)
    parts = 2
    while len(out) < count:
        for o in grid:
            for k in range(1, parts, 2):  # the new points of this level only
                point = round(o + step * k / parts, 6)
                if point not in out:
                    out.append(point)
        parts *= 2
    return out[:count]


def size(
    candidates: Sequence[float], least: int, most: int, forecast: Callable[[float], Forecast]
) -> Sizing:
    """Replay at the first ``least`` candidates, and at more of them (forecast one at a
    time, never run) while their mean cannot check ``TOLERANCE``, up to ``most``. When even
    ``most`` cannot, the first ``least`` are replayed all the same (they show what the
    simulator says there; the verdict says how many replays would check it)."""
    chosen = [forecast(o) for o in candidates[:least]]
    limit = min(max(most, least), len(candidates))
    while not can_check(mean_noise_pct(chosen)) and len(chosen) < limit:
        chosen.append(forecast(candidates[len(chosen)]))
    noise = mean_noise_pct(chosen)
    if can_check(noise):
        offsets = tuple(f.offset for f in chosen)
        return Sizing(offsets, True, noise, len(chosen), len(chosen) - least)
    kept = chosen[:least]
    return Sizing(tuple(f.offset for f in kept), False, mean_noise_pct(kept), len(chosen), 0)
