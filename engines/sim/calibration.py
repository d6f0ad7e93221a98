"""Calibration of the engine model against published measurements (DESIGN.md §6).

Two kinds of anchors, both from the LAPS slides (Qwen2.5-7B on one H200):

* forward-pass times (:data:`PASS_ANCHORS`): single prefills of 16, 256, 1024
  and 2048 tokens and a batch of 8 × 64-token prefills;
* P90 TTFT of short requests at concurrency 8/16/32, alone and mixed with long
  ones (:data:`TTFT_ANCHORS`), which :func:`interference` reproduces on one
  engine model.

:func:`fit_latency` fits the latency model's ``compute_efficiency``,
``memory_efficiency`` to the pass anchors by bounded least squares on
log(predicted / published); the defaults of
:class:`~engines.sim.latency.LatencyModel` are its result. The anchors
contradict each other (256 → 5.4 ms and 1024 → 13.7 ms need ≈1 PFLOP/s, the
whole dense-bf16 peak, while 2048 → 51.6 ms implies 0.53 PFLOP/s, and 8 × 64
tokens → 19 ms is slower than one 1024-token pass), so no roofline fits all:
the report says how far each lands. The TTFT anchors are not fitted.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
from scipy.optimize import least_squares

from engines.sim.core import EngineCore
from engines.sim.latency import LatencyModel, SeqShape


@dataclass(frozen=True, slots=True)
class PassAnchor:
    """A published forward-pass time: ``batch`` of (new, cached) shapes took ``seconds``."""

    name: str
    batch: tuple[SeqShape, ...]
    seconds: float


@dataclass(frozen=True, slots=True)
class TtftAnchor:
    """A published P90 TTFT (seconds) of short requests at ``concurrency``, alone or ``mixed`` with long ones."""

    name: str
    concurrency: int
    mixed: bool
    p90_s: float


PASS_ANCHORS: tuple[PassAnchor, ...] = (
    PassAnchor("prefill 16", ((16, 0),), 4.9e-3),
    PassAnchor("prefill 256", ((256, 0),), 5.4e-3),
    PassAnchor("prefill 1024", ((1024, 0),), 13.7e-3),
    PassAnchor("prefill 2048", ((2048, 0),), 51.6e-3),
    PassAnchor("8 x prefill 64", ((64, 0),) * 8, 19e-3),
)
"""Published forward-pass times (LAPS slides, Qwen2.5-7B, H200; DESIGN §6)."""

TTFT_ANCHORS: tuple[TtftAnchor, ...] = tuple(
    TtftAnchor(f"P90 TTFT short {'mixed' if mixed else 'alone'} c={c}", c, mixed, ms / 1e3)
    for mixed, values in ((False, (45, 48, 52)), (True, (125, 165, 205)))
    for c, ms in zip((8, 16, 32), values)
)
"""Published P90 TTFT of short requests (LAPS slides; DESIGN §6)."""

FIT_BOUNDS = {"compute_efficiency": (0.3, 1.0), "memory_efficiency": (0.3, 1.0)}
"""Bounds of the fitted parameters: fractions of the measured GEMM and copy rates."""


def pass_anchor_rows(model: LatencyModel, anchors: Sequence[PassAnchor] = PASS_ANCHORS) -> list[dict]:
    """``{"name", "published_ms", "model_ms", "error_pct"}`` for each pass anchor under ``model``."""
    rows = []
    for a in anchors:
        predicted = model.predict(a.batch)
        rows.append({"name": a.name, "published_ms": a.seconds * 1e3, "model_ms": predicted * 1e3,
                     "error_pct": (predicted / a.seconds - 1) * 100})
    return rows


def fit_latency(model: LatencyModel, anchors: Sequence[PassAnchor] = PASS_ANCHORS) -> LatencyModel:
    """``model`` with the :data:`FIT_BOUNDS` parameters fitted to ``anchors``.

    Minimises Σ log(predicted / published)² (relative errors weigh alike at
    5 ms and 50 ms) within the bounds, starting from ``model``'s values;
    scipy's trust-region reflective least squares.
    """
    names = list(FIT_BOUNDS)
    lower = np.array([FIT_BOUNDS[n][0] for n in names])
    upper = np.array([FIT_BOUNDS[n][1] for n in names])

    def build(x: np.ndarray) -> LatencyModel:
        return dataclasses.replace(model, **{n: float(v) for n, v in zip(names, x)})

    def residuals(x: np.ndarray) -> np.ndarray:
        m = build(x)
        return np.array([math.log(m.predict(a.batch) / a.seconds) for a in anchors])

    start = np.clip(np.array([getattr(model, n) for n in names]), lower, upper)
    result = least_squares(residuals, start, bounds=(lower, upper))
    return build(result.x)


@dataclass(frozen=True, slots=True)
class ClosedLoopResult:
    """TTFTs (seconds) of one closed-loop run, by request class, and the simulated time it covered."""

    ttft_short: tuple[float, ...]
    ttft_long: tuple[float, ...]
    sim_time_s: float

    @staticmethod
    def p90(values: Sequence[float]) -> float | None:
        """The 90th percentile (numpy's linear interpolation), None when empty."""
        return float(np.percentile(values, 90)) if values else None


def closed_loop(make_core: Callable[[], EngineCore], draw: Callable[[random.Random], tuple[list[int], bool]],
                concurrency: int, requests: int, seed: int, max_new_tokens: int = 1) -> ClosedLoopResult:
    """Run ``concurrency`` clients against one fresh engine in virtual time; TTFT per request.

    Each client sends a request (``draw(rng)`` gives its prompt ids and
    whether it is long), waits for it to finish, and sends the next at once,
    until ``requests`` have been sent in all; ``max_new_tokens`` per request
    (1: prefill only, as the LAPS paper measures TTFT). Deterministic in
    ``seed``. Raises ValueError as :meth:`EngineCore.add_request`.
    """
    rng = random.Random(seed)
    core = make_core()
    now, sent = 0.0, 0
    info: dict[str, tuple[float, bool]] = {}
    short: list[float] = []
    long: list[float] = []
    ids = itertools.count()

    def send() -> None:
        nonlocal sent
        prompt, is_long = draw(rng)
        rid = f"c{next(ids)}"
        core.add_request(rid, prompt, max_new_tokens, ignore_eos=True, now=now)
        info[rid] = (now, is_long)
        sent += 1

    for _ in range(min(concurrency, requests)):
        send()
    while core.has_work():
        result = core.step(now)
        if result.idle:
            raise RuntimeError("engine stalled with work queued")
        now += result.duration_s
        for ev in result.events:
            start, is_long = info[ev.rid]
            if ev.first_token:
                (long if is_long else short).append(now - start)
            if ev.finished and sent < requests:
                send()
    return ClosedLoopResult(tuple(short), tuple(long), now)


def ttft_anchor_rows(make_core: Callable[[], EngineCore], shorts: Sequence[Sequence[int]],
                     longs: Sequence[Sequence[int]], long_share: float, requests: int, seed: int,
                     anchors: Sequence[TtftAnchor] = TTFT_ANCHORS) -> list[dict]:
    """``{"name", "published_ms", "model_ms", "error_pct"}`` for each TTFT anchor, from :func:`closed_loop` runs.

    "alone": every request is drawn from ``shorts``; "mixed": each request is
    drawn from ``longs`` with probability ``long_share``, else from ``shorts``.
    ``model_ms`` is the P90 TTFT of the short requests.
    """
    rows = []
    for a in anchors:
        share = long_share if a.mixed else 0.0

        def draw(rng: random.Random, share: float = share) -> tuple[list[int], bool]:
            is_long = rng.random() < share
            return list(rng.choice(longs if is_long else shorts)), is_long

        result = closed_loop(make_core, draw, a.concurrency, requests, seed)
        p90 = ClosedLoopResult.p90(result.ttft_short)
        assert p90 is not None
        rows.append({"name": a.name, "published_ms": a.p90_s * 1e3, "model_ms": p90 * 1e3,
                     "error_pct": (p90 / a.p90_s - 1) * 100})
    return rows
