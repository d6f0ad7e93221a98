"""Decode-side placement: which engine decodes a request (AlignedServe's grouping at the gateway).

Where several engines decode (data-parallel engines, or the decode engines of a PD deployment),
the gateway chooses one per request. A :class:`DecodePlacement` makes that choice from the
request's context length (history + prompt, tokens) and the engines' :class:`EngineView`, and
learns from progress reports. Two placements exist, chosen by ``scheduling.decode_placement``
(:func:`policies.registry.make_decode_placement`):

* ``least_load``, :class:`LeastLoadPlacement`: the healthy engine with the fewest requests in
  flight (ties: fewer in-flight prompt tokens, then the earlier engine);
* ``aligned``, :class:`AlignedPlacement`: keep each engine's running set in a narrow
  context-length band (AlignedServe, Bai et al., SIGMOD 2026; DESIGN §3), under a load-balance
  guard and the AlignedServe starvation guard.

For data-parallel engines (no PD) :class:`PlacementScheduler` runs a placement as a
``scheduling.policy`` (``aligned`` in :data:`policies.registry.POLICIES`): it dispatches at once,
like every router baseline, and forwards first tokens and completions to the placement.

Pure: no I/O, no clock but ``now`` (seconds on the caller's clock), no randomness.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Protocol, Sequence

from pydantic import BaseModel, ConfigDict, Field

from policies.scheduler import ImmediateScheduler
from policies.types import EngineView, RequestView

class DecodePlacement(Protocol):
    """Chooses the engine that decodes a request; told how its requests progress.

    Call order per request: ``pick`` once (when the request is routed: at arrival for
    data-parallel engines; in PD mode at dispatch too, when the request goes to its prefill
    engine and its decode engine at once), then any number of ``on_progress``, then
    ``on_done`` exactly once (finished, failed or cancelled) if ``pick`` returned an engine.
    ``on_progress`` and ``on_done`` for unknown rids are ignored.
    """

    def pick(self, rid: str, context_tokens: int, engines: Sequence[EngineView], now: float, *, reports_progress: bool = True) -> str | None:
        """The engine id that will decode ``rid`` (``context_tokens`` >= 0: its KV context when
        decoding starts), or ``None`` when no engine is healthy. ``reports_progress`` false: the
        runner hears of ``rid``'s first token only when its whole answer is in (a non-streaming
        request), so a long wait for it is no sign of starvation."""
        ...

    def on_progress(self, rid: str, generated_tokens: int, now: float) -> None:
        """``rid`` has generated ``generated_tokens`` tokens by ``now`` (1 at its first token)."""
        ...

    def on_done(self, rid: str, now: float) -> None:
        """``rid`` left its engine (finished, failed or cancelled)."""
        ...


def _least_loaded(engines: Sequence[EngineView]) -> EngineView:
    """Fewest in flight, then fewest in-flight prompt tokens, then the earliest in ``engines``."""
    return min(engines, key=lambda e: (e.in_flight, e.in_flight_prompt_tokens))


@dataclass
class LeastLoadPlacement:
    """Least load: the healthy engine with the fewest requests in flight (see the module docstring).

    Stateless: the load comes from the views, which the runner keeps current.
    """

    NAME = "least_load"

    def pick(self, rid: str, context_tokens: int, engines: Sequence[EngineView], now: float, *, reports_progress: bool = True) -> str | None:
        healthy = [e for e in engines if e.healthy]
        return _least_loaded(healthy).id if healthy else None

    def on_progress(self, rid: str, generated_tokens: int, now: float) -> None:
        """Nothing to learn: the views carry the load."""

    def on_done(self, rid: str, now: float) -> None:
        """Nothing to learn: the views carry the load."""


class AlignedPlacementConfig(BaseModel):
    """Parameters of :class:`AlignedPlacement` (``scheduling.aligned``).

    ``tpot_estimate_ms``: assumed time per output token, to estimate how far a request has
    decoded between progress reports. Balance slack: an engine may take a band placement while
    its in-flight count is at most ``least + max(balance_slack_requests, balance_slack_ratio *
    least)`` and its estimated KV context (sum over its requests, tokens) at most ``least_kv +
    max(kv_slack_tokens, kv_slack_ratio * least_kv)`` (``least``, ``least_kv``: the smallest
    among the healthy engines). ``tpot_slo_ms`` and ``starvation_tokens``: the AlignedServe
    starvation threshold (:attr:`policies.aligned_serve.AlignedServeConfig.starvation_s`, same
    meaning).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    tpot_estimate_ms: float = Field(20.0, gt=0)
    balance_slack_requests: int = Field(8, ge=0)
    balance_slack_ratio: float = Field(4.0, ge=0)
    kv_slack_tokens: int = Field(16384, ge=0)
    kv_slack_ratio: float = Field(0.25, ge=0)
    tpot_slo_ms: float = Field(100.0, gt=0)
    starvation_tokens: float = Field(50.0, gt=0)

    @property
    def starvation_s(self) -> float:
        """Waiting time after which a request starves: ``starvation_tokens * tpot_slo_ms / 1000`` s."""
        return self.starvation_tokens * self.tpot_slo_ms / 1e3


@dataclass(slots=True)
class _Placed:
    engine_id: str
    tokens: int  # context tokens at ``at_s``
    at_s: float  # pick time, or the last progress report's time
    started: bool  # a token has been reported: the context grows from ``at_s`` on
    generated: int
    first_token_s: float | None
    version: int


class AlignedPlacement:
    """Place each request where it widens its engine's context-length spread least.

    Each engine's running set is tracked by estimated context: a request's context is
    ``context_tokens`` at ``pick``, then ``context + generated`` at its last ``on_progress``,
    plus one token per ``tpot_estimate_ms`` since (the estimate only grows once decoding started).

    Rule, per ``pick`` of a request with context ``c``, over the healthy engines:

    1. guards: an engine is *eligible* unless it is over the balance slack in requests or in
       estimated KV tokens (see
       :class:`AlignedPlacementConfig`) or *starving*: it holds a request that has waited longer
       than ``starvation_s`` since ``pick`` without a token (only requests picked with
       ``reports_progress``: a non-streaming one reports its first token with its last), or whose last progress report was
       more than ``starvation_tokens`` behind a stream paced at ``tpot_slo_ms`` from its first
       token (AlignedServe's threshold, :mod:`policies.aligned_serve`). With no eligible engine
       the request goes to the least-loaded healthy engine (the guards never refuse a request);
    2. band: among the eligible, the engine with the least padding waste added, in tokens: with
       ``n`` requests whose longest estimated context is ``M``, adding ``c`` wastes ``M - c`` if
       ``c <= M`` (the new request is shorter than the band) and ``n * (c - M)`` otherwise (it
       lengthens the band for all ``n``); an empty engine wastes 0. This is the growth of the
       ``n * max(s) - sum(s)`` term that the spread-aware decode model charges
       (:mod:`engines.sim.latency`). Ties: fewer in flight, then fewer in-flight prompt tokens,
       then the earlier engine.

    The quad-tree search of :mod:`policies.aligned_quadtree` chooses a batch out of a *waiting*
    pool; a gateway placement has no pool to search (each request is placed on arrival and the
    engine admits in its own order), so only the band goal and the starvation threshold carry
    over. Cost per ``pick``: O(engines · log(requests)) amortised (a lazy max-heap per engine).
    """

    NAME = "aligned"

    def __init__(self, config: AlignedPlacementConfig | None = None) -> None:
        self.config = config or AlignedPlacementConfig()
        self._rate_per_s = 1e3 / self.config.tpot_estimate_ms
        self._placed: dict[str, _Placed] = {}
        self._by_engine: dict[str, dict[str, None]] = {}
        # Per engine, a max-heap of (-origin, version, rid); origin = context at time 0 if the
        # request had always grown at the assumed rate, so the longest context now is
        # max(origin) + now * rate for started requests. Stale entries are skipped lazily.
        self._grow_heap: dict[str, list[tuple[float, int, str]]] = {}
        self._still_heap: dict[str, list[tuple[int, int, str]]] = {}  # (-tokens, version, rid), not started
        self._unstarted: dict[str, dict[str, float]] = {}  # engine -> rid -> pick time, pick order
        self._lagging: dict[str, set[str]] = {}
        # Per engine [started count, Σ origin of started, Σ tokens of not started]: KV estimate in O(1).
        self._kv: dict[str, list[float]] = {}
        self._versions = itertools.count()
        self.band_placements_total = 0
        self.guarded_placements_total = 0

    # -- the DecodePlacement interface ----------------------------------------------------------

    def pick(self, rid: str, context_tokens: int, engines: Sequence[EngineView], now: float, *, reports_progress: bool = True) -> str | None:
        """See :class:`DecodePlacement`; ``ValueError`` for a negative ``context_tokens`` or a rid already placed."""
        if context_tokens < 0:
            raise ValueError(f"context_tokens must be >= 0, got {context_tokens}")
        if rid in self._placed:
            raise ValueError(f"request {rid!r} is already placed")
        healthy = [e for e in engines if e.healthy]
        if not healthy:
            return None
        eligible = self._eligible(healthy, now)
        if eligible:
            chosen = min(eligible, key=lambda e: (self.waste_tokens(e.id, context_tokens, now), e.in_flight, e.in_flight_prompt_tokens)).id
            self.band_placements_total += 1
        else:
            chosen = _least_loaded(healthy).id
            self.guarded_placements_total += 1
        self._place(rid, chosen, context_tokens, now, reports_progress)
        return chosen

    def on_progress(self, rid: str, generated_tokens: int, now: float) -> None:
        p = self._placed.get(rid)
        if p is None:
            return
        self._count(p, -1)
        if p.first_token_s is None:
            p.first_token_s = now
            self._unstarted[p.engine_id].pop(rid, None)
        p.tokens += generated_tokens - p.generated
        p.generated, p.at_s, p.started = generated_tokens, now, True
        p.version = next(self._versions)
        self._count(p, 1)
        self._push(self._grow_heap[p.engine_id], (-(p.tokens - now * self._rate_per_s), p.version, rid), True)
        paced = (now - p.first_token_s) * 1e3 / self.config.tpot_slo_ms
        lagging = self._lagging[p.engine_id]
        if paced - (generated_tokens - 1) > self.config.starvation_tokens:
            lagging.add(rid)
        else:
            lagging.discard(rid)

    def on_done(self, rid: str, now: float) -> None:
        p = self._placed.pop(rid, None)
        if p is None:
            return
        self._count(p, -1)
        del self._by_engine[p.engine_id][rid]
        self._unstarted[p.engine_id].pop(rid, None)
        self._lagging[p.engine_id].discard(rid)

    # -- queries ------------------------------------------------------------------------------

    def context_tokens(self, rid: str, now: float) -> float:
        """``rid``'s estimated context at ``now`` (tokens; ``KeyError`` if not placed)."""
        p = self._placed[rid]
        return p.tokens + ((now - p.at_s) * self._rate_per_s if p.started else 0.0)

    def longest_tokens(self, engine_id: str, now: float) -> float:
        """The longest estimated context among ``engine_id``'s requests at ``now`` (0 if none)."""
        best = 0.0
        grow = self._grow_heap.get(engine_id, [])
        while grow and not self._current(grow[0][2], grow[0][1], True):
            heapq.heappop(grow)
        if grow:
            best = -grow[0][0] + now * self._rate_per_s
        still = self._still_heap.get(engine_id, [])
        while still and not self._current(still[0][2], still[0][1], False):
            heapq.heappop(still)
        if still:
            best = max(best, float(-still[0][0]))
        return best

    def kv_tokens(self, engine_id: str, now: float) -> float:
        """Σ estimated context over ``engine_id``'s requests at ``now`` (tokens; 0 if none)."""
        started, origins, still = self._kv.get(engine_id, (0, 0.0, 0.0))
        return origins + started * now * self._rate_per_s + still

    def waste_tokens(self, engine_id: str, context_tokens: int, now: float) -> float:
        """Padding waste (tokens) that placing a ``context_tokens`` request on ``engine_id`` adds
        (see the class docstring): ``M - c`` if ``c <= M``, else ``n * (c - M)``; 0 when empty."""
        n = len(self._by_engine.get(engine_id, ()))
        if n == 0:
            return 0.0
        longest = self.longest_tokens(engine_id, now)
        return longest - context_tokens if context_tokens <= longest else n * (context_tokens - longest)

    def starving(self, engine_id: str, now: float) -> bool:
        """Whether ``engine_id`` holds a starving request (see the class docstring)."""
        if self._lagging.get(engine_id):
            return True
        waiting = self._unstarted.get(engine_id)
        oldest = next(iter(waiting.values()), None) if waiting else None
        return oldest is not None and now - oldest > self.config.starvation_s

    # -- internals ----------------------------------------------------------------------------

    def _eligible(self, healthy: Sequence[EngineView], now: float) -> list[EngineView]:
        c = self.config
        least = min(e.in_flight for e in healthy)
        cap = least + max(c.balance_slack_requests, c.balance_slack_ratio * least)
        kv = {e.id: self.kv_tokens(e.id, now) for e in healthy}
        least_kv = min(kv.values())
        kv_cap = least_kv + max(c.kv_slack_tokens, c.kv_slack_ratio * least_kv)
        return [e for e in healthy if e.in_flight <= cap and kv[e.id] <= kv_cap and not self.starving(e.id, now)]

    def _place(self, rid: str, engine_id: str, context_tokens: int, now: float, reports_progress: bool) -> None:
        version = next(self._versions)
        self._placed[rid] = _Placed(engine_id, context_tokens, now, False, 0, None, version)
        self._by_engine.setdefault(engine_id, {})[rid] = None
        self._grow_heap.setdefault(engine_id, [])
        self._push(self._still_heap.setdefault(engine_id, []), (-context_tokens, version, rid), False)
        unstarted = self._unstarted.setdefault(engine_id, {})
        if reports_progress:  # only then can a long wait for its first token mean starvation
            unstarted[rid] = now
        self._lagging.setdefault(engine_id, set())
        self._count(self._placed[rid], 1)

    def _count(self, p: _Placed, sign: int) -> None:
        """Add (``sign`` 1) or remove (-1) ``p`` in its engine's KV sums."""
        sums = self._kv.setdefault(p.engine_id, [0, 0.0, 0.0])
        if p.started:
            sums[0] += sign
            sums[1] += sign * (p.tokens - p.at_s * self._rate_per_s)
        else:
            sums[2] += sign * p.tokens

    def _push(self, heap: list, entry: tuple, started: bool) -> None:
        """Push ``entry``; drop the stale entries once they outnumber the live ones (bounded memory)."""
        heapq.heappush(heap, entry)
        if len(heap) > 2 * len(self._by_engine[self._placed[entry[2]].engine_id]) + 16:
            heap[:] = [e for e in heap if self._current(e[2], e[1], started)]
            heapq.heapify(heap)

    def _current(self, rid: str, version: int, started: bool) -> bool:
        p = self._placed.get(rid)
        return p is not None and p.version == version and p.started == started


class PlacementScheduler(ImmediateScheduler):
    """A :class:`DecodePlacement` as a ``scheduling.policy`` for data-parallel engines.

    Dispatches every request on arrival (:class:`ImmediateScheduler`) to the engine the placement
    picks for a context of ``prompt_tokens`` (``reports_progress``: :attr:`RequestView.stream`); a first token is reported to the placement as
    ``on_progress(rid, 1, now)``, a completion as ``on_done``.
    """

    def __init__(self, placement: DecodePlacement) -> None:
        super().__init__(_PlacementPicker(placement))
        self.placement = placement

    def on_first_token(self, rid: str, engine_id: str, now: float, reported_cached_tokens: int | None) -> None:
        self.placement.on_progress(rid, 1, now)

    def on_complete(self, rid: str, engine_id: str, now: float) -> None:
        self.placement.on_done(rid, now)

    def stats(self) -> dict[str, float]:
        stats = super().stats()
        for name in ("band_placements_total", "guarded_placements_total"):
            if hasattr(self.placement, name):
                stats[name] = float(getattr(self.placement, name))
        return stats


@dataclass(frozen=True)
class _PlacementPicker:
    """The :class:`~policies.scheduler.Picker` face of a placement (the context is the prompt)."""

    placement: DecodePlacement

    def pick(self, request: RequestView, engines: Sequence[EngineView], now: float) -> str | None:
        return self.placement.pick(request.rid, request.prompt_tokens, engines, now, reports_progress=request.stream)
