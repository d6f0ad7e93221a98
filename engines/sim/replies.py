"""Deterministic replies for the simulated engine: real token ids that decode to readable English.

A reply is a walk through :data:`REPLY_PASSAGE`, sentence by sentence, starting
at a sentence chosen by the request id; its natural length (before EOS) is drawn
from a lognormal with median 30 and mean 40 tokens, like chat replies, seeded by
the request id. Same rid, same reply, in every process.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from typing import Sequence

from laps.tokenizer import ChatTokenizer

REPLY_PASSAGE = (
    "The harbour town wakes before the sun, when the first boats slide out past the breakwater. "
    "Fishermen check their nets by lantern light and trade quiet jokes about the weather. "
    "By seven the bakery on the corner has filled the street with the smell of warm bread. "
    "Children walk to school along the sea wall, counting the gulls that sit on the railings. "
    "The ferry to the islands leaves at half past eight and returns just before dusk. "
    "In summer the market square fills with stalls selling cheese, honey and bright paper kites. "
    "Visitors often ask why the houses are painted in so many colours. "
    "The old answer is that sailors wanted to find their own home from far out at sea. "
    "A small museum near the church keeps maps, ship models and letters from distant ports. "
    "On winter evenings the wind rattles the shutters and people gather in the cafe by the quay. "
    "Someone usually plays the accordion, and the conversation turns to storms long past. "
    "The lighthouse keeper retired years ago, but the lamp still turns every night. "
    "When the tide is low you can walk across the sand to the little island with the chapel. "
    "Most people who visit once find a reason to come back the following year."
)
"""Original text the replies are cut from (written for this project)."""

MEDIAN_REPLY_TOKENS = 30
MEAN_REPLY_TOKENS = 40


@dataclass(frozen=True, slots=True)
class ReplyPlan:
    """The tokens a request will produce, in order, and how it ends if nothing stops it first.

    ``finish_reason``: ``"stop"`` when the last token is ``eos_token_id``,
    ``"length"`` when ``max_new_tokens`` cuts it.
    """

    token_ids: tuple[int, ...]
    finish_reason: str


class ReplyPlanner:
    """Plans replies from a passage tokenized once with ``tokenizer``.

    ``eos_token_id`` is ``<|im_end|>`` when the vocabulary has it as one token,
    else the smallest of ``tokenizer.eos_token_ids``.
    """

    def __init__(self, tokenizer: ChatTokenizer, passage: str = REPLY_PASSAGE) -> None:
        sentences = [s for s in re.split(r"(?<=[.!?])\s+", passage.strip()) if s]
        self._first = [tuple(tokenizer.encode(s)) for s in sentences]
        self._next = [tuple(tokenizer.encode(" " + s)) for s in sentences]
        im_end = tokenizer.encode("<|im_end|>")
        if len(im_end) == 1 and im_end[0] in tokenizer.eos_token_ids:
            self.eos_token_id = im_end[0]
        else:
            self.eos_token_id = min(tokenizer.eos_token_ids)
        self._mu = math.log(MEDIAN_REPLY_TOKENS)
        self._sigma = math.sqrt(2 * math.log(MEAN_REPLY_TOKENS / MEDIAN_REPLY_TOKENS))

    def natural_length(self, rid: str) -> int:
        """Text tokens (EOS excluded) request ``rid`` says before stopping: lognormal, median 30, mean ~40, ≥ 1."""
        return max(1, round(random.Random(rid).lognormvariate(self._mu, self._sigma)))

    def text_tokens(self, rid: str, count: int) -> list[int]:
        """The first ``count`` reply tokens of ``rid``: whole sentences from a rid-chosen one, cycling."""
        start = random.Random("start:" + rid).randrange(len(self._first))
        out = list(self._first[start])
        j = start
        while len(out) < count:
            j = (j + 1) % len(self._next)
            out.extend(self._next[j])
        return out[:count]

    def plan(self, rid: str, max_new_tokens: int, ignore_eos: bool) -> ReplyPlan:
        """The reply of ``rid`` under ``max_new_tokens`` (≥ 0).

        With ``ignore_eos`` it is exactly ``max_new_tokens`` text tokens; otherwise
        the natural length plus EOS, or ``max_new_tokens`` text tokens when that is shorter.
        """
        if ignore_eos:
            return ReplyPlan(tuple(self.text_tokens(rid, max_new_tokens)), "length")
        n = self.natural_length(rid)
        if n + 1 <= max_new_tokens:
            return ReplyPlan((*self.text_tokens(rid, n), self.eos_token_id), "stop")
        return ReplyPlan(tuple(self.text_tokens(rid, max_new_tokens)), "length")


class IncrementalDetokenizer:
    """Text of a growing token sequence, decoding only the new tail (linear, not quadratic).

    Special tokens (``tokenizer.eos_token_ids``) are skipped; ids whose bytes end
    mid-character wait in ``pending`` until the character completes.
    """

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self._tokenizer = tokenizer
        self._special = tokenizer.eos_token_ids
        self._pending: list[int] = []
        self.text = ""

    def add(self, token_ids: Sequence[int]) -> int:
        """Append ``token_ids``; returns the length ``text`` had before (where new text starts)."""
        before = len(self.text)
        self._pending.extend(t for t in token_ids if t not in self._special)
        if self._pending:
            chunk = self._tokenizer.decode(self._pending)
            if not chunk.endswith("\ufffd"):
                self.text += chunk
                self._pending.clear()
        return before

    def flush(self) -> str:
        """Decode whatever is pending (incomplete characters become U+FFFD); returns ``text``."""
        if self._pending:
            self.text += self._tokenizer.decode(self._pending)
            self._pending.clear()
        return self.text


def find_stop(text: str, stops: Sequence[str], start: int) -> tuple[int, str] | None:
    """Earliest occurrence of any of ``stops`` in ``text`` that ends after ``start``: (index, stop) or None."""
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, max(0, start - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best
