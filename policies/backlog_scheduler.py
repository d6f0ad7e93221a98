"""Backlog scheduling in the gateway: Sorted-F, MC-SF or FCFS admission against each engine's KV pool.

Wang, Ye, Zhou (arXiv 2508.06133) order a backlog so that memory-feasible batches with
small F(X) = sum o_i / |X|^2 run first (``policies.sorted_f``); MC-SF admits the shortest
predicted output first; FCFS in arrival order (``policies.backlog_baselines``). Here the
backlog is the gateway's queue: a request is dispatched only when its reservation
``s_i + ô_i`` (prompt tokens plus predicted output tokens, ``policies.output_predictor``)
fits what is left of its engine's budget ``M = memory_fraction * kv_capacity_tokens``
(the engine's ``max_total_tokens``); the reservation is released when the request
completes or is cancelled. A reservation is clipped to M, so a request longer than M
still runs, alone. Holding the whole ``s_i + ô_i`` from dispatch to completion is the
paper's s_i + j per-step memory at its peak j = o_i: the gateway sees neither tokens
nor steps, only dispatch and completion, and it is the reservation SGLang itself makes
(``min(max_new, 4096)`` per running request with ``ignore_eos``).

A request's candidate engines are the healthy engines of its class's pool, or every
healthy engine when the pool has none (as :class:`~policies.pool_router.PoolRouter`);
requests with the same candidates form one backlog (one engine, or a unified fleet: one
backlog for both classes). Admission (Phase 2 of Sorted-F, and how the paper's baselines
admit): per backlog, in the policy's order, stop at the first request that fits no
candidate (no skipping, so the order is kept); among the candidates with room, the one
with the most room left (ties: configuration order). Requests of a higher
:attr:`~policies.types.RequestView.priority` go first, each priority in the policy's order.

Orders: ``fcfs`` arrival order; ``mc_sf`` ascending ô (ties arrival); ``sorted_f`` the
receding horizon of Sorted-F-Online (§5): Phase 1 over the ``lookahead`` earliest
waiting requests, the others after them in ascending s_i + ô_i; the plan is kept until
``replan_every`` of its requests were dispatched or the backlog grew ``replan_growth``
times since it was made (the paper's "every ~10 iterations or +50%", in dispatches since
the gateway sees no iterations; or once every planned request was dispatched); arrivals
in between join behind the plan in ascending s_i + ô_i. A planned request that was
cancelled just drops out. Phase 1 runs only when some engine has room and the backlog
holds more than one request, so neither a full engine nor light load (each request
alone in its backlog) costs planning.

An engine without a reported capacity takes ``default_memory_tokens``; when that is
unset too, it has no budget and requests go to it at once (the router's behaviour).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from policies.backlog_baselines import fcfs_order, mc_sf_order
from policies.output_predictor import HH_RLHF_PRIOR_TOKENS, HH_RLHF_PRIOR_WEIGHT, OutputPredictor, PredictorSource
from policies.sorted_f import sorted_f_order
from policies.types import Decision, Dispatch, EngineView, RequestView


class BacklogConfig(BaseModel):
    """Parameters of :class:`BacklogScheduler` (sizes in tokens)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: Literal["sorted_f", "mc_sf", "fcfs"] = Field("sorted_f", description="admission order")
    solver: Literal["auto", "dp", "swap", "quantile"] = Field("quantile", description="Sorted-F Phase-1 solver")
    predictor: PredictorSource = Field("history", description="output-length predictor source")
    prior_tokens: float = Field(HH_RLHF_PRIOR_TOKENS, ge=1)
    prior_weight: float = Field(HH_RLHF_PRIOR_WEIGHT, gt=0)
    memory_fraction: float = Field(1.0, gt=0, le=1, description="share of each engine's KV pool the gateway reserves")
    default_memory_tokens: int | None = Field(None, ge=1, description="M for an engine that reports no capacity")
    lookahead: int = Field(300, ge=1)
    replan_every: int = Field(10, ge=1)
    replan_growth: float = Field(1.5, gt=1)


@dataclass(frozen=True, slots=True)
class _Waiting:
    view: RequestView
    seq: int
    prompt_tokens: int
    output_tokens: int

    @property
    def footprint(self) -> int:
        return self.prompt_tokens + self.output_tokens


def clip_to_budget(prompt_tokens: int, output_tokens: int, memory_tokens: int) -> tuple[int, int]:
    """(s, o) clipped so that s >= 0, o >= 1 and s + o <= M, prompt first kept (M >= 2 tokens)."""
    s = min(prompt_tokens, memory_tokens - 1)
    return s, max(1, min(output_tokens, memory_tokens - s))


class BacklogScheduler:
    """The gateway's backlog scheduler (module doc): a :class:`~policies.scheduler.Scheduler`.

    Raises ValueError (from :class:`OutputPredictor`) on bad predictor parameters.
    """

    NAME = "backlog"

    def __init__(self, config: BacklogConfig | None = None) -> None:
        self.config = config or BacklogConfig()
        self.predictor = OutputPredictor(self.config.predictor, self.config.prior_tokens, self.config.prior_weight)
        self._waiting: dict[str, _Waiting] = {}
        self._held: dict[str, tuple[str, int]] = {}
        self._reserved: dict[str, int] = {}
        self._seq = 0
        self._plan: dict[tuple[str, ...], dict[str, int]] = {}
        self._plan_size: dict[tuple[str, ...], int] = {}
        self._plan_used: dict[tuple[str, ...], int] = {}
        self.plans_total = 0

    # ---- the Scheduler contract ------------------------------------------------------------------

    def submit(self, request: RequestView, now: float) -> None:
        o = self.predictor.predict(request.max_tokens, request.reply_tokens)
        self._waiting[request.rid] = _Waiting(request, self._seq, request.prompt_tokens, o)
        self._seq += 1

    def cancel(self, rid: str, now: float) -> None:
        self._waiting.pop(rid, None)
        self._release(rid)

    def on_first_token(self, rid: str, engine_id: str, now: float, reported_cached_tokens: int | None) -> None:
        """Nothing to learn: the reservation lasts until completion."""

    def on_complete(self, rid: str, engine_id: str, now: float) -> None:
        self._release(rid)

    def decide(self, engines: Sequence[EngineView], now: float) -> Decision:
        healthy = [e for e in engines if e.healthy]
        if not healthy:
            rejected = tuple(self._waiting)
            self._waiting.clear()
            return Decision(rejected=rejected)
        pools = {cls: tuple(e for e in healthy if e.pool == cls) or tuple(healthy) for cls in ("short", "long")}
        backlogs: dict[tuple[EngineView, ...], list[_Waiting]] = {}
        for w in self._waiting.values():
            backlogs.setdefault(pools[w.view.request_class], []).append(w)
        dispatches = []
        for pool, members in backlogs.items():
            dispatches += self._admit(members, pool)
        return Decision(tuple(dispatches))

    def stats(self) -> dict[str, float]:
        return {
            "queued_requests": len(self._waiting),
            "reserved_tokens": sum(self._reserved.values()),
            "backlog_plans_total": self.plans_total,
        }

    # ---- budgets and admission -------------------------------------------------------------------

    def budget(self, engine: EngineView) -> float:
        """M of ``engine`` in KV tokens (module doc); ``math.inf`` when it has none."""
        if engine.kv_capacity_tokens is not None:
            return max(2, int(engine.kv_capacity_tokens * self.config.memory_fraction))
        return self.config.default_memory_tokens or math.inf

    def reserved_tokens(self, engine_id: str) -> int:
        """Tokens currently reserved on ``engine_id`` by dispatched, unfinished requests."""
        return self._reserved.get(engine_id, 0)

    def _release(self, rid: str) -> None:
        held = self._held.pop(rid, None)
        if held is not None:
            engine_id, tokens = held
            self._reserved[engine_id] -= tokens

    def _admit(self, members: list[_Waiting], pool: tuple[EngineView, ...]) -> list[Dispatch]:
        key = tuple(e.id for e in pool)
        budgets = {e.id: self.budget(e) for e in pool}
        room = {e.id: budgets[e.id] - self.reserved_tokens(e.id) for e in pool}
        memory = max(budgets.values())
        if memory == math.inf:
            order = members
        elif max(room.values()) <= 0:
            return []
        else:
            order = self.order(key, members, int(memory))
        order = sorted(order, key=lambda w: w.view.priority_rank)  # stable: the policy's order within a priority
        dispatches = []
        for w in order:
            fits = [(room[e.id], -i, e.id) for i, e in enumerate(pool)
                    if room[e.id] >= min(w.footprint, budgets[e.id])]
            if not fits:
                break
            engine_id = max(fits)[2]
            need = int(min(w.footprint, budgets[engine_id]))
            self._held[w.view.rid] = (engine_id, need)
            self._reserved[engine_id] = self._reserved.get(engine_id, 0) + need
            room[engine_id] -= need
            del self._waiting[w.view.rid]
            self._plan_used[key] = self._plan_used.get(key, 0) + (w.view.rid in self._plan.get(key, {}))
            dispatches.append(Dispatch(engine_id, (w.view.rid,)))
        return dispatches

    # ---- orders ----------------------------------------------------------------------------------

    def order(self, key: tuple[str, ...], members: list[_Waiting], memory_tokens: int) -> list[_Waiting]:
        """``members`` (arrival order) of the backlog of engines ``key`` in the configured admission order
        under budget M (the Sorted-F plan is kept per backlog)."""
        policy = self.config.policy
        if policy == "fcfs":
            return [members[i] for i in fcfs_order(len(members))]
        if policy == "mc_sf":
            return [members[i] for i in mc_sf_order(self._lengths(members, memory_tokens)[1])]
        if len(members) == 1:
            return members  # nothing to order: at light load no request costs a plan
        plan = self._plan.get(key)
        stale = (plan is None or self._plan_used.get(key, 0) >= min(self.config.replan_every, len(plan))
                 or len(members) >= self.config.replan_growth * self._plan_size.get(key, 0))
        if stale:
            window = members[: self.config.lookahead]
            head = sorted_f_order(*self._lengths(window, memory_tokens), memory_tokens, self.config.solver)
            plan = {window[i].view.rid: rank for rank, i in enumerate(head)}
            self._plan[key], self._plan_size[key], self._plan_used[key] = plan, len(members), 0
            self.plans_total += 1
        planned = sorted((w for w in members if w.view.rid in plan), key=lambda w: plan[w.view.rid])
        rest = sorted((w for w in members if w.view.rid not in plan), key=lambda w: (w.footprint, w.seq))
        return planned + rest

    @staticmethod
    def _lengths(members: list[_Waiting], memory_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """(s, ô) arrays clipped to M (see :func:`clip_to_budget`)."""
        pairs = [clip_to_budget(w.prompt_tokens, w.output_tokens, memory_tokens) for w in members]
        return np.array([p[0] for p in pairs], np.int64), np.array([p[1] for p in pairs], np.int64)
