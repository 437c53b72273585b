"""Prediction-driven hybrid (after EuroMLSys '26): on-demand when spot availability is
predicted low, more spot VMs when it is predicted high."""

from __future__ import annotations

import math
from typing import Any

from pcframe.policies.registry import register
from pcframe.policies.resource.base import (
    ResourceContext,
    ResourceDecision,
    ResourcePolicy,
    checked_vms,
)


@register()
class HybridAvailability(ResourcePolicy):
    """Mode from predicted availability a, with a hysteresis band [low, high].

    * a < ``low``: ``base_vms`` on-demand VMs;
    * a > ``high``: spot, scaled from ``base_vms`` at ``high`` to ``max_spot_vms`` at a = 1;
    * in between: keep the current mode (no flapping on a noisy prediction).

    With ``pessimistic`` the lower end of the availability interval is used when deciding
    for spot and the upper end when deciding for on-demand: switching needs confidence.
    ``min_dwell`` seconds must pass between two mode switches (each costs a restart).
    """

    name = "hybrid_availability"

    def __init__(
        self,
        low: float = 0.3,
        high: float = 0.7,
        base_vms: int = 1,
        max_spot_vms: int = 4,
        pessimistic: bool = False,
        min_dwell: float = 0.0,
    ) -> None:
        if not 0.0 <= low <= high <= 1.0:
            raise ValueError(f"need 0 <= low={low} <= high={high} <= 1")
        checked_vms("base_vms", base_vms)
        checked_vms("max_spot_vms", max_spot_vms)
        if max_spot_vms < base_vms:
            raise ValueError(f"need 1 <= base_vms={base_vms} <= max_spot_vms={max_spot_vms}")
        if not min_dwell >= 0:  # NaN too
            raise ValueError(f"min_dwell={min_dwell} must be >= 0 seconds")
        self.low, self.high = low, high
        self.base_vms, self.max_spot_vms = base_vms, max_spot_vms
        self.pessimistic = pessimistic
        self.min_dwell = float(min_dwell)
        self._mode: str | None = None
        self._since: float | None = None

    def _spot_vms(self, a: float) -> int:
        if self.high >= 1.0:
            return self.base_vms
        frac = (a - self.high) / (1.0 - self.high)
        return self.base_vms + math.floor(frac * (self.max_spot_vms - self.base_vms) + 1e-9)

    def decide(self, ctx: ResourceContext) -> ResourceDecision:
        est = ctx.availability
        if est is None:
            mode, a_spot, why = self._mode or "spot", 1.0, "no availability prediction"
        else:
            a_spot = est.lower if self.pessimistic else est.value
            a_od = est.upper if self.pessimistic else est.value
            if a_od < self.low:
                mode, why = "on_demand", f"availability {a_od:.2f} < {self.low}"
            elif a_spot > self.high:
                mode, why = "spot", f"availability {a_spot:.2f} > {self.high}"
            else:
                mode, why = self._mode or "spot", "inside the hysteresis band"
        if (
            self._mode is not None
            and mode != self._mode
            and self._since is not None
            and ctx.now - self._since < self.min_dwell
        ):
            mode, why = self._mode, f"held for min_dwell {self.min_dwell:.0f} s"
        if mode != self._mode:
            self._mode, self._since = mode, ctx.now
        if mode == "on_demand":
            return ResourceDecision(on_demand=self.base_vms, reason=why)
        n = self._spot_vms(a_spot) if a_spot > self.high else self.base_vms
        return ResourceDecision(spot=max(min(n, self.max_spot_vms), self.base_vms), reason=why)

    def state_dict(self) -> dict[str, Any]:
        return {"mode": self._mode, "since": self._since}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._mode = state.get("mode")
        self._since = state.get("since")
