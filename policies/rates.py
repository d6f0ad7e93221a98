"""An exponentially decaying event rate, for estimates that must follow the traffic (arrivals, finishes)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class DecayingRate:
    """Events per second, exponentially decayed with time constant ``tau_s`` (seconds; weights are event sizes)."""

    tau_s: float
    value: float = 0.0
    last_s: float = 0.0

    def at(self, now: float) -> float:
        """The rate at ``now`` (seconds on the caller's clock, not before the last :meth:`add`)."""
        return self.value * math.exp(-(now - self.last_s) / self.tau_s)

    def add(self, now: float, weight: float) -> None:
        """An event of size ``weight`` at ``now``."""
        self.value = self.at(now) + weight / self.tau_s
        self.last_s = now
