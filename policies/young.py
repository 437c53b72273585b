"""Young's interval τ = √(2·C·M), with C learned from the engine's measurements."""

from __future__ import annotations

from typing import Any, Literal

from pcframe.policies.base import PolicyContext
from pcframe.policies.periodic import SecondsIntervalPolicy, mtbf_from
from pcframe.policies.registry import register
from pcframe.policies.theory import young_interval

CostKind = Literal["stall", "duration"]


def checkpoint_cost(policy: SecondsIntervalPolicy, ctx: PolicyContext, kind: CostKind) -> float:
    """C of the interval formulas: the training stall (async saves) or the full save time."""
    if kind == "stall":
        return policy.costs.save_stall(ctx)
    if kind == "duration":
        return policy.costs.save_duration(ctx)
    raise ValueError(f"cost={kind!r} must be 'stall' or 'duration'")


@register()
class Young(SecondsIntervalPolicy):
    """First-order optimal interval for checkpoint cost C and mean time between failures M.

    Args:
        mtbf: M in seconds; replaced by ``1 / ctx.preemption_rate`` when the engine supplies a
            rate and ``use_context_rate`` is true.
        cost: which measurement is C: ``stall`` (seconds training is blocked, right for
            asynchronous saves) or ``duration`` (seconds until durable, for blocking saves).
        **kw: clamps and priors of :class:`~pcframe.policies.periodic.SecondsIntervalPolicy`.
    """

    name = "young"

    def __init__(
        self,
        mtbf: float = 3600.0,
        cost: CostKind = "stall",
        use_context_rate: bool = True,
        **kw: Any,
    ) -> None:
        if not mtbf > 0:
            raise ValueError(f"{type(self).__name__}: mtbf={mtbf} must be > 0 seconds")
        if cost not in ("stall", "duration"):
            raise ValueError(f"cost={cost!r} must be 'stall' or 'duration'")
        super().__init__(**kw)
        self.mtbf = float(mtbf)
        self.cost = cost
        self.use_context_rate = use_context_rate

    def target_interval(self, ctx: PolicyContext) -> float:
        m = mtbf_from(ctx, self.mtbf, self.use_context_rate)
        return young_interval(checkpoint_cost(self, ctx, self.cost), m)
