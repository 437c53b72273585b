"""``pcframe-tune``: Optuna over the engine's knobs, measured on this machine.

Optuna's own study API driven from Hydra's compose API (the hydra-optuna-sweeper plugin
does not support hydra-core 1.3 with Optuna 5 and cannot prune): each trial turns its
parameters into ``engine.<knob>=<value>`` overrides, composes the config, builds the engine
and measures it with :func:`measure`. See docs/tuning.md.
"""

from pcframe.apps.tuning.measure import Measurement, measure
from pcframe.apps.tuning.report import (
    best_trial,
    limit_lines,
    plot,
    trials_table,
    write_tuned_config,
)
from pcframe.apps.tuning.space import (
    Knob,
    base_params,
    engine_values,
    fixed_knobs,
    overrides,
    parse_space,
    suggest,
)
from pcframe.apps.tuning.storage import open_storage
from pcframe.apps.tuning.study import OBJECTIVES, Tuner

__all__ = [
    "OBJECTIVES",
    "Knob",
    "Measurement",
    "Tuner",
    "base_params",
    "best_trial",
    "engine_values",
    "fixed_knobs",
    "limit_lines",
    "measure",
    "open_storage",
    "overrides",
    "parse_space",
    "plot",
    "suggest",
    "trials_table",
    "write_tuned_config",
]
