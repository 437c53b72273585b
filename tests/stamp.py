"""An 'optimizer' for crash tests: its step writes the step count into every parameter.

A checkpoint then shows exactly which step it holds, and a version mixing two steps (a save
racing the optimizer) is visible at a glance. Child scripts import it from the repository
root, which the ``child_env`` fixture puts on ``PYTHONPATH``.
"""

from __future__ import annotations

import torch


class StepStampOptimizer(torch.optim.Optimizer):
    def __init__(self, params, moments: bool = False) -> None:
        super().__init__(params, {})
        self.count = 0
        self.moments = moments  # also keep an "exp_avg" state tensor, stamped the same way

    @torch.no_grad()
    def step(self, closure=None) -> None:
        self.count += 1
        for group in self.param_groups:
            for p in group["params"]:
                p.fill_(float(self.count))
                if self.moments:
                    self.state[p]["exp_avg"] = torch.full_like(p, float(self.count))
