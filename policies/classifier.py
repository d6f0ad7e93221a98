"""Short/long prefill classification."""

from __future__ import annotations

from dataclasses import dataclass

from policies.types import RequestClass, RequestView


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
