"""Short/long prefill classification: a fixed threshold, or the fitted latency model's boundary."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence

from policies.types import RequestClass, RequestView


class Classifier(Protocol):
    """Decides a request's prefill class from its new and cached token counts."""

    def classify(self, request: RequestView) -> RequestClass: ...


@dataclass(frozen=True)
class ThresholdClassifier:
    """Short iff the new (uncached) prompt tokens L are fewer than ``threshold_tokens``.

    The fallback boundary of LAPS (DESIGN §2.3): 256 tokens. The LAPS authors'
    fork compares the whole prompt length instead; using L lets a follow-up
    turn on a long cached history count as short.
    """

    threshold_tokens: int = 256

    def classify(self, request: RequestView) -> RequestClass:
        return "short" if request.new_tokens < self.threshold_tokens else "long"


@dataclass(frozen=True)
class PrefillCostModel:
    """LAPS prefill latency model T(L, H) = α·L(L+2H) + β·L + γw·L + γr·H (DESIGN §2.3).

    L: new tokens, H: cached context tokens; coefficients in seconds per token
    (α per token², for attention). compute(L, H) = α·L(L+2H) + β·L,
    memory(L, H) = m0 + γw·L + γr·H. ``memory_floor_s`` (m0) is our addition:
    the weight read every forward pass pays (~3.5 ms for a 7B model on an
    H200, DESIGN §1), which is what makes short prefills memory-bound on real
    hardware; m0 = 0 gives the paper's model.
    """

    alpha: float
    beta: float
    gamma_w: float
    gamma_r: float
    memory_floor_s: float = 0.0

    def compute_s(self, new_tokens: float, cached_tokens: float) -> float:
        return self.alpha * new_tokens * (new_tokens + 2 * cached_tokens) + self.beta * new_tokens

    def memory_s(self, new_tokens: float, cached_tokens: float) -> float:
        return self.memory_floor_s + self.gamma_w * new_tokens + self.gamma_r * cached_tokens

    def prefill_s(self, batch: Sequence[tuple[int, int]]) -> float:
        """One extend pass over ``batch`` ((L_i, H_i) pairs): max(Σ compute, m0 + Σ memory terms), seconds
        (the scheduler's :class:`~policies.ttft_model.PassCost`)."""
        compute = sum(self.compute_s(new, cached) for new, cached in batch)
        memory = self.memory_floor_s + sum(self.gamma_w * new + self.gamma_r * cached for new, cached in batch)
        return max(compute, memory)

    def decode_s(self, seqs: int, context_tokens: int) -> float:
        """One decode pass: ``seqs`` sequences of one new token on ``context_tokens`` cached tokens in all, seconds."""
        compute = self.alpha * (seqs + 2 * context_tokens) + self.beta * seqs
        return max(compute, self.memory_floor_s + self.gamma_w * seqs + self.gamma_r * context_tokens)

    def boundary_tokens(self, cached_tokens: float) -> float:
        """L_m(H): the L at which compute equals memory; below it a prefill is memory-bound.

        Closed form (DESIGN §2.3), the positive root of α·L² + (2αH + β − γw)·L − (γr·H + m0) = 0:
        L_m(H) = max(0, (−b + sqrt(b² + 4·α·(γr·H + m0))) / 2α) with b = 2αH + β − γw;
        for H = 0 and m0 = 0 this is (γw − β)/α when γw > β, else 0.

        Raises:
            ValueError: if α <= 0 (no quadratic term: the boundary is undefined).
        """
        if self.alpha <= 0:
            raise ValueError("alpha must be > 0 for a compute/memory boundary")
        b = 2 * self.alpha * cached_tokens + self.beta - self.gamma_w
        c = self.gamma_r * cached_tokens + self.memory_floor_s
        root = (-b + math.sqrt(b * b + 4 * self.alpha * c)) / (2 * self.alpha)
        return max(0.0, root)


@dataclass(frozen=True)
class CostModelClassifier:
    """Short iff L < L_m(H) of a fitted :class:`PrefillCostModel` (LAPS, DESIGN §2.3)."""

    model: PrefillCostModel

    def classify(self, request: RequestView) -> RequestClass:
        return "short" if request.new_tokens < self.model.boundary_tokens(request.cached_tokens) else "long"
