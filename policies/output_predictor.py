"""Output-length prediction for backlog scheduling (Sorted-F, MC-SF need o_i before a request runs).

A request's output length is predicted from what the gateway knows when it arrives:
its ``max_tokens`` cap and the token counts of the conversation's earlier assistant
replies (``RequestView.reply_tokens``; the request's own messages carry that history, so
no per-conversation state is kept).

``history`` (the default): a shrunk mean of the earlier replies,
``(w * prior + sum(replies)) / (w + k)`` for k earlier replies, with pseudo-count
``w = prior_weight`` and ``prior = prior_tokens`` (empirical-Bayes shrinkage of a
per-conversation mean towards the global level), rounded half up and clipped to
``[1, max_tokens]``. The first turn gets the prior. ``max_tokens``: the cap itself (exact
when clients send the true reply length, as with ``--ignore-eos`` and the ``hh-rlhf``
workload's lengths; the oracle of the paper's known-length tables), the history estimate
when no cap was sent.

Default parameters, fitted on the even-numbered conversations of the ``hh-rlhf`` data set
(Qwen2.5 tokens, ``loadgen.workloads.load_hh_rlhf``) and measured on the odd ones by
``bench/output_predictor_error.py``: prior 28 tokens (the median reply; MAE-optimal for
a constant), weight 2 (the best of 0.5/1/2/4/8 on the training half).

Pure: no I/O, no clock. Lengths are output tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

PredictorSource = Literal["history", "max_tokens"]
HH_RLHF_PRIOR_TOKENS = 28.0
HH_RLHF_PRIOR_WEIGHT = 2.0


@dataclass(frozen=True)
class OutputPredictor:
    """Predicts output tokens from ``max_tokens`` and earlier reply lengths (module doc).

    Raises ValueError on ``prior_tokens < 1``, ``prior_weight <= 0`` or an unknown ``source``.
    """

    source: PredictorSource = "history"
    prior_tokens: float = HH_RLHF_PRIOR_TOKENS
    prior_weight: float = HH_RLHF_PRIOR_WEIGHT

    def __post_init__(self) -> None:
        if self.source not in ("history", "max_tokens"):
            raise ValueError(f"unknown predictor source {self.source!r}; choose history or max_tokens")
        if self.prior_tokens < 1:
            raise ValueError(f"prior_tokens must be >= 1, got {self.prior_tokens}")
        if self.prior_weight <= 0:
            raise ValueError(f"prior_weight must be > 0, got {self.prior_weight}")

    def history_estimate(self, reply_tokens: Sequence[int]) -> float:
        """(w * prior + sum(reply_tokens)) / (w + len(reply_tokens)), tokens (unclipped)."""
        return (self.prior_weight * self.prior_tokens + sum(reply_tokens)) / (self.prior_weight + len(reply_tokens))

    def predict(self, max_tokens: int | None, reply_tokens: Sequence[int] = ()) -> int:
        """Predicted output tokens, >= 1 and <= ``max_tokens`` when a cap is given."""
        if self.source == "max_tokens" and max_tokens is not None:
            return max_tokens
        estimate = max(1, math.floor(self.history_estimate(reply_tokens) + 0.5))
        return estimate if max_tokens is None else min(estimate, max_tokens)


def reply_token_counts(messages: Iterable[Mapping[str, Any]], encode: Callable[[str], Sequence[int]]) -> tuple[int, ...]:
    """Token counts of the assistant messages in ``messages`` (``{"role", "content"}`` dicts with
    text content), oldest first, with ``encode`` (a tokenizer's ``encode``)."""
    return tuple(len(encode(m["content"])) for m in messages if m["role"] == "assistant")
