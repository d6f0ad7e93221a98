"""Calibration of the engine model against published measurements (DESIGN.md §6).

Every anchor names the model it was measured on and where it was published, and
is compared with that model's preset (all on one H200):

* forward-pass times (:data:`PASS_ANCHORS`, LAPS slides, Qwen2.5-7B): single
  prefills of 16, 256, 1024 and 2048 tokens and a batch of 8 × 64-token prefills;
* the interference pair (:data:`INTERFERENCE_ANCHORS`, LAPS slides): 8 × 64-token
  prefills in one pass, then the same batch with one of them replaced by a
  2048-token prefill (7 × 64 + 1 × 2048), on Qwen2.5-7B (19 → 567 ms; the 19 ms is
  the last pass anchor) and Qwen2.5-32B (74 → 2,289 ms);
* P90 TTFT of short requests at concurrency 8/16/32, alone and mixed with long
  ones (:data:`TTFT_ANCHORS`, LAPS paper Figs. 1 and 3: "a single H200 GPU,
  Qwen2.5-32B"), which :func:`closed_loop` reproduces on one engine model.

:func:`fit_latency` fits the latency model's ``compute_efficiency``,
``memory_efficiency`` to the pass anchors by bounded least squares on
log(predicted / published); the defaults of
:class:`~engines.sim.latency.LatencyModel` are its result. The anchors
contradict each other (256 → 5.4 ms and 1024 → 13.7 ms need ≈1 PFLOP/s, the
whole dense-bf16 peak, while 2048 → 51.6 ms implies 0.53 PFLOP/s, and 8 × 64
tokens → 19 ms is slower than one 1024-token pass), so no roofline fits all and
the fit is a compromise that splits the misses: the report says how far each
lands. The interference and TTFT anchors are not fitted. :func:`padded_batch`
prices a pass as an engine that pads its batch to the longest sequence would run
it, next to the ragged pass SGLang runs (``bench/sim_calibration.py`` says why).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import numpy as np
from scipy.optimize import least_squares

from engines.sim.calibration_file import CALIBRATED_FIELDS
from engines.sim.latency import LatencyModel, SeqShape

if TYPE_CHECKING:  # only a type here: the GPU check imports this module without the engine's packages
    from engines.sim.core import EngineCore

SLIDES = "LAPS slides"
PAPER_FIGURES = "LAPS paper Figs. 1, 3"


@dataclass(frozen=True, slots=True)
class PassAnchor:
    """A forward pass over ``batch`` ((new, cached) shapes) that took ``seconds`` on ``model`` (a preset name), per ``source``."""

    name: str
    batch: tuple[SeqShape, ...]
    seconds: float
    model: str
    source: str


@dataclass(frozen=True, slots=True)
class TtftAnchor:
    """A P90 TTFT (seconds) of short requests at ``concurrency``, alone or ``mixed`` with long ones, on ``model``, per ``source``."""

    name: str
    concurrency: int
    mixed: bool
    p90_s: float
    model: str
    source: str


SHORT_BATCH = ((64, 0),) * 8
MIXED_BATCH = ((64, 0),) * 7 + ((2048, 0),)

PASS_ANCHORS: tuple[PassAnchor, ...] = (
    PassAnchor("prefill 16", ((16, 0),), 4.9e-3, "qwen2.5-7b", SLIDES),
    PassAnchor("prefill 256", ((256, 0),), 5.4e-3, "qwen2.5-7b", SLIDES),
    PassAnchor("prefill 1024", ((1024, 0),), 13.7e-3, "qwen2.5-7b", SLIDES),
    PassAnchor("prefill 2048", ((2048, 0),), 51.6e-3, "qwen2.5-7b", SLIDES),
    PassAnchor("8 x prefill 64", SHORT_BATCH, 19e-3, "qwen2.5-7b", SLIDES),
)
"""Published forward-pass times that :func:`fit_latency` fits (LAPS slides, Qwen2.5-7B, H200; DESIGN §6)."""

INTERFERENCE_ANCHORS: tuple[PassAnchor, ...] = (
    PassAnchor("8 x prefill 64", SHORT_BATCH, 74e-3, "qwen2.5-32b", SLIDES),
    PassAnchor("7 x prefill 64 + 2048", MIXED_BATCH, 567e-3, "qwen2.5-7b", SLIDES),
    PassAnchor("7 x prefill 64 + 2048", MIXED_BATCH, 2289e-3, "qwen2.5-32b", SLIDES),
)
"""The rest of the interference pair (LAPS slides, H200): reported, not fitted. Qwen2.5-7B's
8 × 64 (19 ms) is in :data:`PASS_ANCHORS`."""

TTFT_ANCHORS: tuple[TtftAnchor, ...] = tuple(
    TtftAnchor(f"P90 TTFT short {'mixed' if mixed else 'alone'} c={c}", c, mixed, ms / 1e3, "qwen2.5-32b", PAPER_FIGURES)
    for mixed, values in ((False, (45, 48, 52)), (True, (125, 165, 205)))
    for c, ms in zip((8, 16, 32), values)
)
"""Published P90 TTFT of short requests (LAPS paper Figs. 1 and 3: one H200, Qwen2.5-32B)."""

FIT_BOUNDS: dict[str, tuple[float, float]] = dict.fromkeys(CALIBRATED_FIELDS, (0.3, 1.0))
"""Bounds of the fitted parameters: fractions of the measured GEMM and copy rates."""


def padded_batch(batch: Sequence[SeqShape]) -> tuple[SeqShape, ...]:
    """``batch`` as a padded (non-ragged) engine runs it: every sequence as long as the longest,
    (max L, max H) each; a batch of equal sequences is unchanged."""
    longest = (max(new for new, _ in batch), max(cached for _, cached in batch))
    return (longest,) * len(batch)


def _check_model(anchors: Sequence[PassAnchor | TtftAnchor], model: LatencyModel) -> None:
    """Raises ValueError when an anchor was measured on another model than ``model``'s."""
    other = sorted({a.model for a in anchors} - {model.model.name})
    if other:
        raise ValueError(f"anchors measured on {', '.join(other)} cannot be compared with the {model.model.name} model")


def pass_anchor_rows(model: LatencyModel, anchors: Sequence[PassAnchor] = PASS_ANCHORS) -> list[dict]:
    """One row per anchor: ``{"name", "model", "source", "published_ms", "model_ms", "error_pct",
    "padded_ms", "padded_error_pct"}``, the model's ragged pass and, when padding changes the batch,
    its :func:`padded_batch` (else both padded keys are None).

    Raises:
        ValueError: an anchor was measured on another model than ``model``'s.
    """
    _check_model(anchors, model)
    rows = []
    for a in anchors:
        predicted = model.predict(a.batch)
        padded = padded_batch(a.batch)
        padded_s = model.predict(padded) if padded != a.batch else None
        rows.append({"name": a.name, "model": a.model, "source": a.source, "published_ms": a.seconds * 1e3,
                     "model_ms": predicted * 1e3, "error_pct": (predicted / a.seconds - 1) * 100,
                     "padded_ms": None if padded_s is None else padded_s * 1e3,
                     "padded_error_pct": None if padded_s is None else (padded_s / a.seconds - 1) * 100})
    return rows


def median_abs_error_pct(rows: Sequence[Mapping]) -> dict[str, float]:
    """Median |``error_pct``| of ``rows`` by their ``model``."""
    by_model: dict[str, list[float]] = {}
    for r in rows:
        by_model.setdefault(r["model"], []).append(abs(r["error_pct"]))
    return {m: statistics.median(errors) for m, errors in by_model.items()}


def fit_latency(model: LatencyModel, anchors: Sequence[PassAnchor] = PASS_ANCHORS,
                bounds: Mapping[str, tuple[float, float]] = FIT_BOUNDS) -> LatencyModel:
    """``model`` with the ``bounds`` parameters (:data:`FIT_BOUNDS`' names) fitted to ``anchors``.

    Minimises Σ log(predicted / published)² (relative errors weigh alike at
    5 ms and 50 ms) within the bounds, starting from ``model``'s values;
    scipy's trust-region reflective least squares over the parameters' logs
    (they are rates' scales: a step that halves one is as long as one that
    doubles it, so a fit that starts orders of magnitude away, as a CPU
    run's does, gets there).

    Raises:
        ValueError: an anchor was measured on another model than ``model``'s.
    """
    _check_model(anchors, model)
    names = list(bounds)
    lower = np.log([bounds[n][0] for n in names])
    upper = np.log([bounds[n][1] for n in names])

    def build(x: np.ndarray) -> LatencyModel:
        return dataclasses.replace(model, **{n: math.exp(v) for n, v in zip(names, x)})

    def residuals(x: np.ndarray) -> np.ndarray:
        m = build(x)
        return np.array([math.log(m.predict(a.batch) / a.seconds) for a in anchors])

    start = np.clip(np.log([getattr(model, n) for n in names]), lower, upper)
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
    """``{"name", "model", "source", "published_ms", "model_ms", "error_pct"}`` for each TTFT anchor,
    from :func:`closed_loop` runs.

    "alone": every request is drawn from ``shorts``; "mixed": each request is
    drawn from ``longs`` with probability ``long_share``, else from ``shorts``.
    ``model_ms`` is the P90 TTFT of the short requests.

    Raises:
        ValueError: an anchor was measured on another model than the one ``make_core``'s engine models.
    """
    _check_model(anchors, make_core().latency)
    rows = []
    for a in anchors:
        share = long_share if a.mixed else 0.0

        def draw(rng: random.Random, share: float = share) -> tuple[list[int], bool]:
            is_long = rng.random() < share
            return list(rng.choice(longs if is_long else shorts)), is_long

        result = closed_loop(make_core, draw, a.concurrency, requests, seed)
        p90 = ClosedLoopResult.p90(result.ttft_short)
        assert p90 is not None
        rows.append({"name": a.name, "model": a.model, "source": a.source, "published_ms": a.p90_s * 1e3,
                     "model_ms": p90 * 1e3, "error_pct": (p90 / a.p90_s - 1) * 100})
    return rows
