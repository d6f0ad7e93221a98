"""Names to policies: the one place that builds a classifier and a scheduler from the configuration."""

from __future__ import annotations

from typing import TYPE_CHECKING

from policies.classifier import Classifier, CostModelClassifier, PrefillCostModel, ThresholdClassifier
from policies.laps import LapsScheduler
from policies.scheduler import ImmediateScheduler, Scheduler

if TYPE_CHECKING:
    from laps.config import SchedulingConfig


def make_classifier(scheduling: SchedulingConfig) -> Classifier:
    """The fitted cost model's boundary when ``scheduling.cost_model`` is set, else the fixed threshold."""
    fit = scheduling.cost_model
    if fit is None:
        return ThresholdClassifier(scheduling.short_threshold_tokens)
    return CostModelClassifier(PrefillCostModel(fit.alpha, fit.beta, fit.gamma_w, fit.gamma_r, fit.memory_floor_s))


def make_scheduler(scheduling: SchedulingConfig) -> Scheduler:
    """A fresh scheduler named by ``scheduling.policy``, with its configured parameters."""
    if scheduling.policy == "laps":
        return LapsScheduler(scheduling.laps)
    return ImmediateScheduler()
