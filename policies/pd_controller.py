"""Sizing the decode pool of a PD deployment: move one engine between the prefill and decode sides by their pressures.

A :class:`PDPressureController` is the short/long
:class:`~policies.controller.PressureController` plus one rule that it tries
first, for deployments whose engines can flip between prefill and decode
(``pd.role_switch``; SGLang 0.5.23 ``POST /pd_role_switch``, DESIGN §5):

* a decode engine d has a pressure
  φ_d = w·Q_d + b·V_d + k·max(0, L_d − ℓ0)/(1 − ℓ0), where Q_d is the number
  of requests waiting on it for decode admission (their KV is there, the
  running batch has no room yet), V_d the share of its recent first tokens
  that were late although their prefill was done by the deadline (the
  lateness that is the decode side's), L_d = max(U_d, R_d/R_max) its load (KV
  token usage, running requests over its ``max_running_requests``; U_d alone
  when the capacity is unknown), ℓ0 the load from which it counts
  (``decode_load_threshold``: below it a decode engine is not under pressure,
  however full), b the ``sla_weight`` of the prefill pressure, and w, k
  ``decode_queue_weight``, ``decode_load_weight``;
* the decode side's pressure Ψ_D is the ``pool_quantile`` of the decode
  engines' φ; the prefill side's Ψ_P the same quantile of the prefill
  engines' ψ (:meth:`~policies.controller.PressureController.pressure`, short
  and long pools together: both prefill for the same decode side);
* when Ψ_D − Ψ_P > τ (strictly), a prefill engine moves to the decode pool:
  from the prefill pool of lower pressure (ties: the larger pool, then
  ``short``) that keeps at least ``min_pool_size`` engines and has a movable
  one, else from the other prefill pool if it can; its least loaded movable
  engine (:meth:`~policies.controller.PressureController.donor_engine`);
* when Ψ_P − Ψ_D > τ, the decode pool's least loaded movable engine moves
  to the prefill pool of higher pressure (ties: ``short``), if the decode
  pool keeps at least ``min_pool_size`` engines;
* both only when no move is in progress and the cooldown since the last move
  (any move, short↔long included) has passed; a decode pool with no serving
  engine at this decision and the one before is refilled at once (as an empty
  prefill pool is), from the prefill pool that can give one as above;
* otherwise the short↔long rules decide (the prefill engines only).

The weights are ours (not the LAPS paper's, which sizes no decode pool): one
request waiting for decode admission weighs w = 0.05 (20 of them = 1, as 1,000
backlog tokens on the prefill side), a decode engine at full load weighs k = 1.
The tests pin the rule down on scripted pressure sequences.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from policies.controller import POOLS, EngineSignals, Move, PressureController, PressureControllerConfig, quantile
from policies.types import RequestClass


class PDPressureController(PressureController):
    """:class:`~policies.controller.PressureController` that also sizes the decode pool (see the module docstring).

    :meth:`decide` takes the decode engines' signals (pool ``decode``) along with the prefill engines'.
    """

    NAME = "pd-pressure"

    def __init__(self, config: PressureControllerConfig | None = None) -> None:
        super().__init__(config)
        self._decode_size = 0
        self._decode_pressure = math.nan
        self._prefill_pressure = math.nan
        self._decode_was_empty = False

    def decode_pressure(self, signals: EngineSignals) -> float:
        """φ = w·Q + b·V + k·max(0, L − ℓ0)/(1 − ℓ0) for one decode engine."""
        c = self.config
        load = signals.kv_token_usage
        if signals.max_running_requests is not None:
            load = max(load, min(1.0, signals.running_requests / signals.max_running_requests))
        over = max(0.0, load - c.decode_load_threshold) / (1 - c.decode_load_threshold)
        return c.decode_queue_weight * signals.waiting_requests + c.sla_weight * signals.ttft_slo_violation_share + c.decode_load_weight * over

    def decide(self, engines: Sequence[EngineSignals], now: float) -> Move | None:
        """The move to make at ``now``, or ``None``: the side rule first, then the short↔long rules (module docstring)."""
        by_pool, was_empty = self._observe(engines)
        decode = [e for e in engines if e.pool == "decode"]
        prefill = [e for pool in POOLS for e in by_pool[pool]]
        q = self.config.pool_quantile
        self._decode_size = len(decode)
        self._decode_pressure = quantile([self.decode_pressure(e) for e in decode], q) if decode else math.nan
        self._prefill_pressure = quantile([self.pressure(e) for e in prefill], q) if prefill else math.nan
        decode_was_empty, self._decode_was_empty = self._decode_was_empty, not decode
        if self.in_progress is not None:
            return None
        return self._start(self._side_move(by_pool, decode, decode_was_empty, now) or self._pool_move(by_pool, was_empty, now))

    def _side_move(self, by_pool: dict[RequestClass, list[EngineSignals]], decode: list[EngineSignals],
                   decode_was_empty: bool, now: float) -> Move | None:
        """The prefill↔decode move the side rule gives (no move in progress), or ``None``."""
        if not decode:
            return self._to_decode(by_pool) if decode_was_empty else None
        if self._cooling(now) or not (by_pool["short"] or by_pool["long"]):
            return None
        gap = self._decode_pressure - self._prefill_pressure
        if gap > self.config.hysteresis:
            return self._to_decode(by_pool)
        if -gap > self.config.hysteresis:
            engine = self.donor_engine(decode)
            pressures = {pool: p for pool, p in self._pool_pressures.items() if by_pool[pool]}
            receiver = max(POOLS, key=lambda pool: (pressures.get(pool, -math.inf), pool == "short"))
            return None if engine is None else Move(engine.engine_id, "decode", receiver)
        return None

    def _to_decode(self, by_pool: dict[RequestClass, list[EngineSignals]]) -> Move | None:
        """A prefill engine for the decode pool: from the calmer prefill pool that can give one (module docstring)."""
        order = sorted((pool for pool in POOLS if by_pool[pool]),
                       key=lambda pool: (self._pool_pressures[pool], -len(by_pool[pool]), pool != "short"))
        for pool in order:
            engine = self.donor_engine(by_pool[pool])
            if engine is not None:
                return Move(engine.engine_id, pool, "decode")
        return None

    def stats(self) -> dict[str, float]:
        """:meth:`PressureController.stats` plus the decode pool's size and pressure (Ψ_D) and the prefill side's (Ψ_P)."""
        return {**super().stats(), "pool_size_decode": self._decode_size, "pool_pressure_decode": self._decode_pressure,
                "pool_pressure_prefill": self._prefill_pressure}
