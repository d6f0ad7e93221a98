"""Fitting the LAPS prefill cost model to measured (L, H, seconds) samples.

DESIGN §2.3 writes T(L,H) = α·L(L+2H) + β·L + γw·L + γr·H as a sum, but a sum
cannot tell β from γw: both multiply L. A forward pass is bounded by the slower
of compute and memory traffic (roofline), so we fit

    T(L, H) = c + max(α·L(L+2H) + β·L, m0 + γw·L + γr·H)

with non-negative coefficients by least squares on relative error (scipy's
trust-region reflective solver, several starts), where c is the fixed
per-request overhead seen on both sides (HTTP, scheduling, launch) and m0 the
per-pass weight read (see :class:`PrefillCostModel`). The kink of the max is
what identifies β, γw and m0; the boundary L_m(H) then follows from
:meth:`PrefillCostModel.boundary_tokens`. Samples should span both sides of
the kink: small and large L, several H.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy.optimize import least_squares

from policies.classifier import PrefillCostModel

MIN_SAMPLES = 6  # one per parameter: alpha, beta, gamma_w, gamma_r, m0, c


@dataclass(frozen=True)
class CostFit:
    """A fitted model, its fixed overhead ``overhead_s`` and the fit's RMS relative error."""

    model: PrefillCostModel
    overhead_s: float
    rms_relative_error: float

    def predict_s(self, new_tokens, cached_tokens):
        """Predicted seconds for L and H (numbers or arrays of one shape)."""
        return self.overhead_s + np.maximum(self.model.compute_s(new_tokens, cached_tokens), self.model.memory_s(new_tokens, cached_tokens))


def fit_cost_model(samples: Sequence[tuple[int, int, float]]) -> CostFit:
    """Least-squares fit of ``c + max(compute, memory)`` to ``(L, H, seconds)`` samples.

    Raises:
        ValueError: fewer than :data:`MIN_SAMPLES` samples, or a sample with L < 1, H < 0 or time <= 0.
    """
    data = np.asarray(samples, dtype=float)
    if data.ndim != 2 or data.shape[0] < MIN_SAMPLES or data.shape[1] != 3:
        raise ValueError(f"need at least {MIN_SAMPLES} samples of (new_tokens, cached_tokens, seconds)")
    L, H, t = data.T
    if (L < 1).any() or (H < 0).any() or (t <= 0).any():
        raise ValueError("samples need L >= 1, H >= 0 and a positive time")
    # Parameters in scaled units so that all are O(1) for the solver.
    scale = np.array([1e-10, 1e-5, 1e-8, 1e-8, 1e-3, 1e-3])

    def residuals(p: np.ndarray) -> np.ndarray:
        a, b, gw, gr, m0, c = p * scale
        pred = c + np.maximum(a * L * (L + 2 * H) + b * L, m0 + gw * L + gr * H)
        return (pred - t) / t

    best = None
    for start in ([1, 1, 1, 1, 1, 1], [0.1, 0.1, 0.1, 0.1, 0.1, 0.1], [10, 10, 10, 10, 10, 10], [1, 5, 10, 1, 5, 0.5]):
        result = least_squares(residuals, np.array(start, dtype=float), bounds=(0, np.inf), method="trf")
        if best is None or result.cost < best.cost:
            best = result
    a, b, gw, gr, m0, c = (float(v) for v in best.x * scale)
    rms = float(np.sqrt(np.mean(residuals(best.x) ** 2)))
    return CostFit(PrefillCostModel(alpha=a, beta=b, gamma_w=gw, gamma_r=gr, memory_floor_s=m0), c, rms)
