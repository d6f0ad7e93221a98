"""The routing rules of SGLang's own router (PyPI ``sglang-router`` 0.3.x), as :class:`Picker` baselines.

They route over *all* engines (no short/long pools), one request at a time,
the moment it arrives (run them inside :class:`~policies.scheduler.ImmediateScheduler`).
Rules as documented in the router's source (DESIGN §5):

* round_robin: the next healthy worker in turn;
* cache_aware: loads are in-flight request counts; the system is imbalanced iff
  (max − min) > ``balance_abs_threshold`` (64) and max > ``balance_rel_threshold``
  (1.5) × min; imbalanced → the least-loaded worker; balanced → the worker with
  the longest prefix match if the match ratio exceeds ``cache_threshold`` (0.3),
  else the worker with the smallest tree. The router keeps an approximate radix
  tree of request *characters* per worker; here the match is the gateway's
  token-block prefix estimate (``RequestView.cached_by_engine``) and the tree
  size is the tokens this picker has sent to each worker, trimmed LRU-style to
  ``max_tree_tokens`` (the router evicts every 60 s past its ``max_tree_size``);
* bucket (PD prefill): each worker owns a range of request lengths; the ranges
  are equal-count quantiles of the lengths seen in the last ``window_s`` (5 s),
  re-learned every ``window_s``; imbalanced → least-loaded. The router measures
  characters; we measure prompt tokens.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from policies.types import EngineView, RequestView


def _least_loaded(engines: Sequence[EngineView]) -> str:
    return min(engines, key=lambda e: e.in_flight).id


def _imbalanced(engines: Sequence[EngineView], abs_threshold: int, rel_threshold: float) -> bool:
    loads = [e.in_flight for e in engines]
    return max(loads) - min(loads) > abs_threshold and max(loads) > rel_threshold * min(loads)


@dataclass
class RoundRobinPicker:
    """round_robin: healthy engines in turn (their order in the view list)."""

    NAME = "round_robin"
    _next: int = 0

    def pick(self, request: RequestView, engines: Sequence[EngineView], now: float) -> str | None:
        healthy = [e for e in engines if e.healthy]
        if not healthy:
            return None
        chosen = healthy[self._next % len(healthy)]
        self._next += 1
        return chosen.id


@dataclass
class CacheAwarePicker:
    """cache_aware: prefix match above a threshold when balanced, least load when not (module docstring)."""

    NAME = "cache_aware"
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_tokens: int = 2**21
    tree_tokens: dict[str, int] = field(default_factory=dict)

    def pick(self, request: RequestView, engines: Sequence[EngineView], now: float) -> str | None:
        healthy = [e for e in engines if e.healthy]
        if not healthy:
            return None
        if _imbalanced(healthy, self.balance_abs_threshold, self.balance_rel_threshold):
            chosen = _least_loaded(healthy)
        else:
            best = max(healthy, key=lambda e: request.cached_by_engine.get(e.id, 0))
            ratio = request.cached_by_engine.get(best.id, 0) / max(request.prompt_tokens, 1)
            chosen = best.id if ratio > self.cache_threshold else min(healthy, key=lambda e: self.tree_tokens.get(e.id, 0)).id
        # The request updates the chosen worker's tree whichever rule chose it.
        grown = self.tree_tokens.get(chosen, 0) + request.prompt_tokens - request.cached_by_engine.get(chosen, 0)
        self.tree_tokens[chosen] = min(grown, self.max_tree_tokens)
        return chosen


@dataclass
class BucketPicker:
    """bucket: per-engine length ranges from recent lengths' quantiles, least load when imbalanced (module docstring)."""

    NAME = "bucket"
    window_s: float = 5.0
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    boundaries: list[int] = field(default_factory=list)
    _recent: deque = field(default_factory=deque)
    _learned_at: float | None = None

    def pick(self, request: RequestView, engines: Sequence[EngineView], now: float) -> str | None:
        healthy = [e for e in engines if e.healthy]
        if not healthy:
            return None
        self._recent.append((now, request.prompt_tokens))
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent.popleft()
        if self._learned_at is None or now - self._learned_at >= self.window_s or len(self.boundaries) != len(healthy) - 1:
            self._relearn(len(healthy), now)
        if _imbalanced(healthy, self.balance_abs_threshold, self.balance_rel_threshold):
            return _least_loaded(healthy)
        return healthy[bisect.bisect_right(self.boundaries, request.prompt_tokens)].id

    def _relearn(self, workers: int, now: float) -> None:
        lengths = sorted(n for _, n in self._recent)
        self.boundaries = [lengths[len(lengths) * k // workers] for k in range(1, workers)]
        self._learned_at = now
