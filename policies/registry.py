"""Names to policies: the one place that builds a classifier, a scheduler, a decode placement and the pool controller from the configuration."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from policies.backlog_scheduler import BacklogScheduler
from policies.classifier import Classifier, CostModelClassifier, PrefillCostModel, ThresholdClassifier
from policies.controller import PressureController, PressureControllerConfig
from policies.decode_placement import AlignedPlacement, DecodePlacement, LeastLoadPlacement, PlacementScheduler
from policies.laps import LapsScheduler
from policies.pd_controller import PDPressureController
from policies.pool_router import PoolRouter
from policies.router_baselines import BucketPicker, CacheAwarePicker, RoundRobinPicker
from policies.scheduler import ImmediateScheduler, Scheduler
from policies.ttft_model import EngineTraits

if TYPE_CHECKING:
    from laps.config import SchedulingConfig


def make_classifier(scheduling: SchedulingConfig) -> Classifier:
    """The fitted cost model's boundary when ``scheduling.cost_model`` is set, else the fixed threshold."""
    fit = scheduling.cost_model
    if fit is None:
        return ThresholdClassifier(scheduling.short_threshold_tokens)
    return CostModelClassifier(PrefillCostModel(fit.alpha, fit.beta, fit.gamma_w, fit.gamma_r, fit.memory_floor_s))


def _laps(scheduling: SchedulingConfig, engines: Optional[EngineTraits]) -> Scheduler:
    if engines is None:
        raise ValueError("scheduling.policy laps predicts TTFT per engine and needs the engines' traits "
                         "(laps.cost.engine_traits builds them from the config)")
    return LapsScheduler(scheduling.laps, engines)


POLICIES: dict[str, Callable[[SchedulingConfig, Optional[EngineTraits]], Scheduler]] = {
    "laps": _laps,
    "pools": lambda s, c: ImmediateScheduler(PoolRouter()),
    "least_load": lambda s, c: ImmediateScheduler(PoolRouter(unified=True)),
    "round_robin": lambda s, c: ImmediateScheduler(RoundRobinPicker()),
    "cache_aware": lambda s, c: ImmediateScheduler(CacheAwarePicker()),
    "bucket": lambda s, c: ImmediateScheduler(BucketPicker()),
    "aligned": lambda s, c: PlacementScheduler(AlignedPlacement(s.aligned)),
    "backlog": lambda s, c: BacklogScheduler(s.backlog),
}
"""Scheduling policies by ``scheduling.policy`` name: ``laps``, the length-aware pools without a
window, the router baselines over all engines (``least_load`` is unified FCFS), and ``aligned``
(AlignedServe decode placement over all engines), ``backlog`` (Sorted-F / MC-SF / FCFS
admission against each engine's KV pool)."""


def make_scheduler(scheduling: SchedulingConfig, engines: EngineTraits | None = None) -> Scheduler:
    """A fresh scheduler named by ``scheduling.policy``, with its configured parameters.

    ``engines``: what the policies that predict TTFT (``laps``) must know of the engines
    (see :func:`laps.cost.engine_traits`).

    Raises:
        ValueError: ``laps`` without ``engines``.
    """
    return POLICIES[scheduling.policy](scheduling, engines)


def make_decode_placement(scheduling: SchedulingConfig) -> DecodePlacement:
    """A fresh placement named by ``scheduling.decode_placement`` (``least_load`` or ``aligned``,
    the latter with ``scheduling.aligned``)."""
    if scheduling.decode_placement == "aligned":
        return AlignedPlacement(scheduling.aligned)
    return LeastLoadPlacement()


def make_controller(config: PressureControllerConfig, sizes_decode: bool) -> PressureController:
    """The pool controller: the PD one that also sizes the decode pool when ``sizes_decode``
    (:meth:`laps.config.Config.controller_sizes_decode`), else the short/long one."""
    return PDPressureController(config) if sizes_decode else PressureController(config)
