"""Real preemption injection: a supervisor SIGKILLs a training process on a schedule.

:mod:`~pcframe.apps.preemption.schedule` turns a ``failure`` config (Poisson, a recorded spot
trace, or explicit times) into kill times; :class:`Supervisor` runs ``python -m
pcframe.apps.training`` as a child, kills it at those times without any cooperation from it,
restarts it, and measures what the preemptions cost (lost steps, restart time, goodput);
:mod:`~pcframe.apps.preemption.plan` fits a schedule to the machine from an uninterrupted
reference run and refuses one under which no kill would land or nothing would commit.
"""

from pcframe.apps.preemption.plan import KillPlan, Measured, check_plan, plan
from pcframe.apps.preemption.schedule import (
    derived,
    kill_times,
    poisson_times,
    resolve_trace,
    trace_times,
)
from pcframe.apps.preemption.supervisor import (
    ChildSpec,
    KillClock,
    Life,
    SupervisedRun,
    Supervisor,
    compare_finals,
)
from pcframe.errors import SupervisorError

__all__ = [
    "ChildSpec",
    "KillClock",
    "KillPlan",
    "Life",
    "Measured",
    "SupervisedRun",
    "Supervisor",
    "SupervisorError",
    "check_plan",
    "compare_finals",
    "derived",
    "kill_times",
    "plan",
    "poisson_times",
    "resolve_trace",
    "trace_times",
]
