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

from policies.types import Pool, RequestClass

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
    decode_queue_weight: float = Field(0.05, ge=0, description="w: PD decode pressure per request waiting for decode admission")
    decode_load_threshold: float = Field(0.8, ge=0, lt=1, description="ℓ0: PD decode load (KV use or running/capacity) above which a decode engine is under pressure")
    decode_load_weight: float = Field(1.0, ge=0, description="k: PD decode pressure of a decode engine at full load")


@dataclass(frozen=True, slots=True)
class EngineSignals:
    """One serving engine's pressure inputs, as the runner reads them at one moment.

    The runner passes engines that serve a pool now (healthy, not switching
    roles); an engine of the PD ``decode`` pool is read only by
    :class:`policies.pd_controller.PDPressureController` (this controller leaves it out). From the gateway's own counters: ``pool``, ``gateway_queued_tokens``
    (new tokens of the requests the gateway holds for the engine's pool,
    divided evenly among the pool's serving engines: the gateway queues per
    pool, not per engine) and ``ttft_slo_violation_share`` (of the requests
    this engine gave a first token in the recent window, the share whose TTFT
    exceeded their SLO; 0 when there were none). From the engine's
    ``EngineLoad`` (``/v1/loads``): ``engine_waiting_tokens``
    (``waiting_uncached_tokens``), ``running_requests`` and ``kv_token_usage``
    (``token_usage``, in [0, 1]), and for a decode engine also
    ``waiting_requests`` (``num_waiting_reqs``: its KV arrived, not yet in the
    running batch) and ``max_running_requests`` (its capacity; ``None``:
    unknown). On a decode engine ``ttft_slo_violation_share`` is the share of
    its first tokens that were late although their prefill was done in time
    (the lateness that is the decode side's). ``movable``: the runner can
    restart or flip it with another role (not an ``external`` engine).
    """

    engine_id: str
    pool: Pool
    gateway_queued_tokens: float = 0.0
    engine_waiting_tokens: int = 0
    ttft_slo_violation_share: float = 0.0
    running_requests: int = 0
    kv_token_usage: float = 0.0
    waiting_requests: int = 0
    max_running_requests: int | None = None
    movable: bool = True

    def __post_init__(self) -> None:
        if self.pool not in (*POOLS, "decode"):
            raise ValueError(f"engine {self.engine_id}: pool must be one of {(*POOLS, 'decode')}, not {self.pool!r}")
        if min(self.gateway_queued_tokens, self.engine_waiting_tokens, self.running_requests, self.waiting_requests) < 0:
            raise ValueError(f"engine {self.engine_id}: queued tokens, running and waiting requests must not be negative")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ValueError(f"engine {self.engine_id}: max_running_requests must be >= 1 (or None: unknown)")
        if not (0 <= self.ttft_slo_violation_share <= 1 and 0 <= self.kv_token_usage <= 1):
            raise ValueError(f"engine {self.engine_id}: ttft_slo_violation_share and kv_token_usage must lie in [0, 1]")

    @property
    def backlog_tokens(self) -> float:
        """B: prompt tokens queued for this engine, in the gateway and inside the engine."""
        return self.gateway_queued_tokens + self.engine_waiting_tokens


@dataclass(frozen=True, slots=True)
class Move:
    """Drain ``engine_id`` out of ``from_pool`` and restart (or, across PD sides, flip) it with ``to_pool``'s role."""

    engine_id: str
    from_pool: Pool
    to_pool: Pool


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
        by_pool, was_empty = self._observe(engines)
        if self.in_progress is not None:
            return None
        return self._start(self._pool_move(by_pool, was_empty, now))

    def _observe(self, engines: Sequence[EngineSignals]) -> tuple[dict[RequestClass, list[EngineSignals]], RequestClass | None]:
        """Sort the short and long engines into their pools and note the pools' sizes and pressures for :meth:`stats`;
        the pools and the pool found empty by the previous decision (``None``: none, or both)."""
        by_pool = {pool: [e for e in engines if e.pool == pool] for pool in POOLS}
        self._pool_sizes = {pool: len(members) for pool, members in by_pool.items()}
        self._pool_pressures = {pool: self.pool_pressure(members) if members else math.nan for pool, members in by_pool.items()}
        empty = [pool for pool in POOLS if not by_pool[pool]]
        was_empty, self._empty_pool = self._empty_pool, empty[0] if len(empty) == 1 else None
        return by_pool, was_empty

    def _cooling(self, now: float) -> bool:
        """Whether the last move ended less than ``cooldown_s`` before ``now``."""
        return self._last_done_s is not None and now < self._last_done_s + self.config.cooldown_s

    def _start(self, move: Move | None) -> Move | None:
        """Record ``move`` (if any) as in progress and counted."""
        if move is not None:
            self.in_progress = move
            self.moves += 1
        return move

    def _pool_move(self, by_pool: dict[RequestClass, list[EngineSignals]], was_empty: RequestClass | None, now: float) -> Move | None:
        """The short↔long move the rules give (no move in progress), or ``None``."""
        c = self.config
        empty = [pool for pool in POOLS if not by_pool[pool]]
        if empty:
            if len(empty) == 2 or was_empty != empty[0]:
                return None
            receiver = empty[0]
            donor = "long" if receiver == "short" else "short"
        else:
            if self._cooling(now):
                return None
            short, long = self._pool_pressures["short"], self._pool_pressures["long"]
            donor, receiver = ("short", "long") if long > short else ("long", "short")
            if abs(long - short) <= c.hysteresis:
                return None
        engine = self.donor_engine(by_pool[donor])
        return None if engine is None else Move(engine.engine_id, donor, receiver)

    def donor_engine(self, pool: Sequence[EngineSignals]) -> EngineSignals | None:
        """The engine ``pool`` gives up: its least loaded movable one, or ``None`` when it keeps no more than
        ``min_pool_size`` engines or has no movable one (ties: fewest running requests, then backlog tokens,
        then waiting requests, then the smallest id)."""
        movable = [e for e in pool if e.movable]
        if len(pool) <= self.config.min_pool_size or not movable:
            return None
        return min(movable, key=lambda e: (e.running_requests, e.backlog_tokens, e.waiting_requests, e.engine_id))

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
