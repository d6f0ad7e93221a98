"""Names to policies: the one place that builds a classifier and a scheduler from the configuration."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from policies.backlog_scheduler import BacklogScheduler
from policies.classifier import Classifier, CostModelClassifier, PrefillCostModel, ThresholdClassifier
from policies.decode_placement import AlignedPlacement, PlacementScheduler
from policies.laps import LapsScheduler
from policies.pool_router import PoolRouter
from policies.router_baselines import BucketPicker, CacheAwarePicker, RoundRobinPicker
from policies.scheduler import ImmediateScheduler, Scheduler

if TYPE_CHECKING:
    from laps.config import SchedulingConfig


def make_classifier(scheduling: SchedulingConfig) -> Classifier:
    """The fitted cost model's boundary when ``scheduling.cost_model`` is set, else the fixed threshold."""
    fit = scheduling.cost_model
    if fit is None:
        return ThresholdClassifier(scheduling.short_threshold_tokens)
    return CostModelClassifier(PrefillCostModel(fit.alpha, fit.beta, fit.gamma_w, fit.gamma_r, fit.memory_floor_s))


POLICIES: dict[str, Callable[[SchedulingConfig], Scheduler]] = {
    "laps": lambda s: LapsScheduler(s.laps),
    "pools": lambda s: ImmediateScheduler(PoolRouter()),
    "least_load": lambda s: ImmediateScheduler(PoolRouter(unified=True)),
    "round_robin": lambda s: ImmediateScheduler(RoundRobinPicker()),
    "cache_aware": lambda s: ImmediateScheduler(CacheAwarePicker()),
    "bucket": lambda s: ImmediateScheduler(BucketPicker()),
    "aligned": lambda s: PlacementScheduler(AlignedPlacement(s.aligned)),
    "backlog": lambda s: BacklogScheduler(s.backlog),
}
"""Scheduling policies by ``scheduling.policy`` name: ``laps``, the length-aware pools without a
window, the router baselines over all engines (``least_load`` is unified FCFS), and ``aligned``
(AlignedServe decode placement over all engines), ``backlog`` (Sorted-F / MC-SF / FCFS
admission against each engine's KV pool)."""


def make_scheduler(scheduling: SchedulingConfig) -> Scheduler:
    """A fresh scheduler named by ``scheduling.policy``, with its configured parameters."""
    return POLICIES[scheduling.policy](scheduling)
