"""Daly's interval: the minimiser of expected wall time under exponential failures."""

from __future__ import annotations

import functools
from typing import Any, Literal

from pcframe.policies.base import PolicyContext
from pcframe.policies.periodic import mtbf_from
from pcframe.policies.registry import register
from pcframe.policies.theory import daly_interval_exact, daly_interval_series
from pcframe.policies.young import Young, checkpoint_cost

Form = Literal["exact", "series"]


@functools.lru_cache(maxsize=256)
def daly_interval(cost: float, mtbf: float, form: Form) -> float:
    """Daly's optimum in either form. Cached: the learned C and M change only when a save
    completes or the prediction moves, while policies ask at every step."""
    if form == "exact":
        return daly_interval_exact(cost, mtbf)
    if form == "series":
        return daly_interval_series(cost, mtbf)
    raise ValueError(f"form={form!r} must be 'exact' (Lambert W) or 'series'")


@register()
class Daly(Young):
    """Like :class:`~pcframe.policies.young.Young` but with Daly's optimum.

    Args:
        form: ``exact`` (τ* = M·(1 + W₀(−e^(−1−C/M)))) or ``series`` (Daly's expansion).
        Other arguments as for :class:`~pcframe.policies.young.Young`.
    """

    name = "daly"

    def __init__(self, mtbf: float = 3600.0, form: Form = "exact", **kw: Any) -> None:
        if form not in ("exact", "series"):
            raise ValueError(f"form={form!r} must be 'exact' (Lambert W) or 'series'")
        super().__init__(mtbf=mtbf, **kw)
        self.form = form

    def target_interval(self, ctx: PolicyContext) -> float:
        m = mtbf_from(ctx, self.mtbf, self.use_context_rate)
        return daly_interval(checkpoint_cost(self, ctx, self.cost), m, self.form)
