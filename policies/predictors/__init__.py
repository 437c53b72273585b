"""Preemption-rate and availability predictors, each reporting its uncertainty."""

from pcframe.policies.predictors.base import Estimate, Prediction, Predictor, poisson_interval
from pcframe.policies.predictors.ewma import EwmaRate
from pcframe.policies.predictors.gamma_poisson import GammaPoissonRate
from pcframe.policies.predictors.hazard import HazardByTimeOfDay
from pcframe.policies.predictors.poisson import WindowedPoisson

__all__ = [
    "Estimate",
    "EwmaRate",
    "GammaPoissonRate",
    "HazardByTimeOfDay",
    "Prediction",
    "Predictor",
    "WindowedPoisson",
    "poisson_interval",
]
