"""Pressure controller: move one engine from the calmer pool to the busier when their P90 pressures differ by more than τ (LAPS Algorithm 2).

Our reading of LAPS Algorithm 2 (DESIGN §2.7):

* each serving engine e has a pressure
  ψ_e = a·B_e/1000 + b·V_e − c·U_e, where B_e is its queue backlog in prompt
  tokens (its share of the gateway's pool queue plus the uncached tokens
  waiting inside the engine), V_e its recent share of TTFT SLO violations and
  U_e its KV-cache token usage (see :class:`EngineSignals` for the sources);
* a pool's pressure Ψ is the ``pool_quantile`` (P90 by default) of its
  engines' ψ, linearly interpolated between order statistics (numpy's
  default): one outlier engine does not swing it, a pool-wide backlog does;
* the receiver is the pool with the higher Ψ, the donor the other one; one
  donor engine moves when Ψ_receiver − Ψ_donor > τ (strictly: hysteresis), no
  move is in progress, the donor keeps at least ``min_pool_size`` engines,
  and ``now ≥ t_done + T_cool``, t_done being when the last move finished
  (:meth:`PressureController.on_move_done`), so pressures measured on the new
  split settle before the next move;
* the engine that moves is the donor's least loaded movable one (an
  ``external`` engine counts in its pool's pressure but cannot be
  restarted): fewest running requests, then fewest backlog tokens, then the
  smallest id (deterministic), so the drain that precedes its restart is the
  shortest; a donor with no movable engine gives none;
* a pool with no serving engine (an engine moved out by hand, or down) has
  no pressure; it is refilled first: when it was empty at the previous
  decision too (so one missed load poll moves nothing), the other pool's
  least loaded movable engine (as above) moves into it if that pool keeps at
  least ``min_pool_size`` engines and no move is in progress, without
  waiting for hysteresis or the cooldown (an empty pool cannot serve its
  class at all); otherwise nothing moves.

Where the paper's details are not public, these rules are ours; the tests pin
them down on scripted pressure sequences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from pydantic import BaseModel, ConfigDict, Field

from policies.types import RequestClass

POOLS: tuple[RequestClass, RequestClass] = ("short", "long")


class PressureControllerConfig(BaseModel):
    """Parameters of :class:`PressureController` (times in seconds)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    queue_weight: float = Field(1.0, ge=0, description="a: pressure per 1000 backlog tokens")
    sla_weight: float = Field(4.0, ge=0, description="b: pressure of a TTFT SLO-violation share of 1")
    utilisation_weight: float = Field(1.0, ge=0, description="c: pressure relief of a full KV cache")
    pool_quantile: float = Field(0.9, ge=0, le=1, description="the quantile of engine pressures that is the pool's pressure")
    hysteresis: float = Field(0.5, ge=0, description="τ: move only when the pools' pressures differ by more than this")
    cooldown_s: float = Field(60.0, ge=0, description="T_cool: no move until this long after the last move finished")
    min_pool_size: int = Field(1, ge=1, description="never shrink a pool below this many engines")


@dataclass(frozen=True, slots=True)
class EngineSignals:
    """One serving engine's pressure inputs, as the runner reads them at one moment.

    The runner passes engines that serve a pool now (healthy, not switching
    roles). From the gateway's own counters: ``pool``, ``gateway_queued_tokens``
    (new tokens of the requests the gateway holds for the engine's pool,
    divided evenly among the pool's serving engines: the gateway queues per
    pool, not per engine) and ``ttft_slo_violation_share`` (of the requests
    this engine gave a first token in the recent window, the share whose TTFT
    exceeded their SLO; 0 when there were none). From the engine's
    ``EngineLoad`` (``/v1/loads``): ``engine_waiting_tokens``
    (``waiting_uncached_tokens``), ``running_requests`` and ``kv_token_usage``
    (``token_usage``, in [0, 1]). ``movable``: the runner can restart it
    with another role (not an ``external`` engine).
    """

    engine_id: str
    pool: RequestClass
    gateway_queued_tokens: float = 0.0
    engine_waiting_tokens: int = 0
    ttft_slo_violation_share: float = 0.0
    running_requests: int = 0
    kv_token_usage: float = 0.0
    movable: bool = True

    def __post_init__(self) -> None:
        if self.pool not in POOLS:
            raise ValueError(f"engine {self.engine_id}: pool must be one of {POOLS}, not {self.pool!r}")
        if min(self.gateway_queued_tokens, self.engine_waiting_tokens, self.running_requests) < 0:
            raise ValueError(f"engine {self.engine_id}: queued tokens and running requests must not be negative")
        if not (0 <= self.ttft_slo_violation_share <= 1 and 0 <= self.kv_token_usage <= 1):
            raise ValueError(f"engine {self.engine_id}: ttft_slo_violation_share and kv_token_usage must lie in [0, 1]")

    @property
    def backlog_tokens(self) -> float:
        """B: prompt tokens queued for this engine, in the gateway and inside the engine."""
        return self.gateway_queued_tokens + self.engine_waiting_tokens


@dataclass(frozen=True, slots=True)
class Move:
    """Drain ``engine_id`` out of ``from_pool`` and restart it with ``to_pool``'s role."""

    engine_id: str
    from_pool: RequestClass
    to_pool: RequestClass


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values``, linear between order statistics (position q·(n−1) in sorted order)."""
    if not values:
        raise ValueError("quantile of no values")
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    if low == len(ordered) - 1:
        return ordered[low]
    return ordered[low] + (position - low) * (ordered[low + 1] - ordered[low])


class PressureController:
    """Pressure-driven pool rebalancing, one engine at a time (see the module docstring).

    The runner calls :meth:`decide` with fresh signals (e.g. on every load
    poll), carries out a returned :class:`Move` (drain, restart with the other
    role, join the other pool) and then calls :meth:`on_move_done`, whether
    the switch succeeded or failed.
    """

    NAME = "pressure"

    def __init__(self, config: PressureControllerConfig | None = None) -> None:
        self.config = config or PressureControllerConfig()
        self.in_progress: Move | None = None
        self.moves = 0
        self._last_done_s: float | None = None
        self._empty_pool: RequestClass | None = None  # the pool found empty by the last decision
        self._pool_sizes: dict[RequestClass, int] = {pool: 0 for pool in POOLS}
        self._pool_pressures: dict[RequestClass, float] = {pool: math.nan for pool in POOLS}

    def pressure(self, signals: EngineSignals) -> float:
        """ψ = a·B/1000 + b·V − c·U for one engine."""
        c = self.config
        return (
            c.queue_weight * signals.backlog_tokens / 1000
            + c.sla_weight * signals.ttft_slo_violation_share
            - c.utilisation_weight * signals.kv_token_usage
        )

    def pool_pressure(self, engines: Sequence[EngineSignals]) -> float:
        """Ψ: the ``pool_quantile`` of the engines' ψ (one pool's engines, at least one)."""
        return quantile([self.pressure(e) for e in engines], self.config.pool_quantile)

    def decide(self, engines: Sequence[EngineSignals], now: float) -> Move | None:
        """The move to make at ``now``, or ``None`` (the rules are in the module docstring)."""
        c = self.config
        by_pool = {pool: [e for e in engines if e.pool == pool] for pool in POOLS}
        self._pool_sizes = {pool: len(members) for pool, members in by_pool.items()}
        self._pool_pressures = {pool: self.pool_pressure(members) if members else math.nan for pool, members in by_pool.items()}
        empty = [pool for pool in POOLS if not by_pool[pool]]
        was_empty, self._empty_pool = self._empty_pool, empty[0] if len(empty) == 1 else None
        if self.in_progress is not None:
            return None
        if empty:
            if len(empty) == 2 or was_empty != empty[0]:
                return None
            receiver = empty[0]
            donor = "long" if receiver == "short" else "short"
        else:
            if self._last_done_s is not None and now < self._last_done_s + c.cooldown_s:
                return None
            short, long = self._pool_pressures["short"], self._pool_pressures["long"]
            donor, receiver = ("short", "long") if long > short else ("long", "short")
            if abs(long - short) <= c.hysteresis:
                return None
        if len(by_pool[donor]) <= c.min_pool_size:
            return None
        movable = [e for e in by_pool[donor] if e.movable]
        if not movable:
            return None
        engine = min(movable, key=lambda e: (e.running_requests, e.backlog_tokens, e.engine_id))
        self.in_progress = Move(engine.engine_id, donor, receiver)
        self.moves += 1
        return self.in_progress

    def on_move_done(self, engine_id: str, now: float) -> None:
        """The move of ``engine_id`` ended at ``now`` (done or failed); the cooldown starts.

        Raises:
            ValueError: no move of ``engine_id`` is in progress.
        """
        if self.in_progress is None or self.in_progress.engine_id != engine_id:
            raise ValueError(f"no move of engine {engine_id} is in progress (in progress: {self.in_progress})")
        self.in_progress = None
        self._last_done_s = now

    def stats(self) -> dict[str, float]:
        """Pool sizes and pressures seen by the last :meth:`decide` (NaN: no engine), moves decided, whether one is in progress."""
        return {
            **{f"pool_size_{pool}": n for pool, n in self._pool_sizes.items()},
            **{f"pool_pressure_{pool}": p for pool, p in self._pool_pressures.items()},
            "moves": self.moves,
            "move_in_progress": int(self.in_progress is not None),
        }
