"""Prompts with a trace's prefix structure: one real-text token block per hash id (Mooncake's 512-token blocks).

Mooncake's traces give each request its prompt length and one hash id per
512-token block of the prompt; equal ids at the same position are equal
blocks (the prefix KV an engine can reuse). :class:`BlockPrompts` turns such a
row into a single user message whose templated chat (the tokenizer's chat
template, default system turn included) has exactly ``input_length`` tokens,
and whose token blocks are equal exactly where the ids are equal:

* the text is real text (by default :func:`loadgen.workloads.real_text_corpus`:
  ShareGPT and Arena prompts), split at whitespace into *units*, joined again
  by single spaces. With a byte-level BPE whose pre-tokenizer splits before a
  space that is followed by a non-space (GPT-2/tiktoken style, as Qwen's
  ``QWEN_PAT_STR``), the tokens of such a text are the concatenation of each
  unit's tokens (``" " + unit``; the message's first unit without the space),
  so a block's tokens do not depend on its neighbours;
* each hash id gets its own start in the corpus the first time it is seen
  (the j-th id ``(base + j * stride) mod units``, base and a stride coprime
  to the corpus size drawn with the ``rng``, so distinct ids start at distinct
  units until the corpus is used up); its block is the units from there, in order, that fit the
  block's token count, skipping a unit that would overshoot (so the count is
  exact; the 1-token units such as `` the`` always fit);
* block 0 holds the template's opening tokens (system turn, ``user`` header)
  and the first ``512 − opening`` content tokens; the template's closing
  tokens (``<|im_end|>``, the generation prompt: 5 for ChatML) end the last
  block. So the last block of a prompt equals another prompt's block of the
  same id only when both are last blocks of equal length (a block id that is
  a prompt's last block in one request and a middle block in another
  matches except for those closing tokens; 8 of the 12,031 FAST25
  conversation rows), and a prompt ending 1–4 tokens into a block has its
  closing tokens spill into the block before.

The construction is checked once, when a :class:`BlockPrompts` is made, on a
three-block probe; a tokenizer for which it does not hold is refused.
"""

from __future__ import annotations

import math
import random
import unicodedata
from collections.abc import Sequence

from laps.tokenizer import ChatTokenizer

DEFAULT_BLOCK_TOKENS = 512


def _template_split(tokenizer: ChatTokenizer) -> tuple[list[int], list[int]]:
    """The chat template's token ids before and after a single user message's content."""
    a = tokenizer.encode_chat([{"role": "user", "content": "A"}])
    b = tokenizer.encode_chat([{"role": "user", "content": "B"}])
    head = 0
    while head < min(len(a), len(b)) and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < min(len(a), len(b)) - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    return a[:head], a[len(a) - tail:]


class BlockPrompts:
    """Single user messages built block by block from real text (see the module doc).

    Raises (constructor):
        ValueError: ``texts`` holds no word, no unit of the text is one token
            (then exact counts cannot be guaranteed), or ``tokenizer`` does not
            tokenize the joined units unit by unit (the probe failed).
    """

    def __init__(self, tokenizer: ChatTokenizer, rng: random.Random, texts: Sequence[str],
                 block_tokens: int = DEFAULT_BLOCK_TOKENS) -> None:
        self._tok = tokenizer
        self.block_tokens = block_tokens
        self._units = [u for t in texts for u in unicodedata.normalize("NFC", t).split()]
        if not self._units:
            raise ValueError("BlockPrompts needs a text corpus with at least one word")
        distinct = set(self._units)
        spaced = {u: len(tokenizer.encode(" " + u)) for u in distinct}
        first = {u: len(tokenizer.encode(u)) for u in distinct}
        self._spaced = [spaced[u] for u in self._units]
        self._first = [first[u] for u in self._units]
        if 1 not in self._spaced:
            raise ValueError("BlockPrompts needs a text corpus with one-token words")
        self._starts: dict[int, int] = {}
        self._base, self._stride = self._draw_walk(rng)
        self._head, self._tail = _template_split(tokenizer)
        self.min_tokens = len(self._head) + len(self._tail) + 1
        if self.block_tokens <= len(self._head):
            raise ValueError(f"blocks of {block_tokens} tokens cannot hold the chat template's {len(self._head)} opening tokens")
        self._probe()

    def _draw_walk(self, rng: random.Random) -> tuple[int, int]:
        """A random first start and a stride coprime to the number of units (so the walk visits every unit)."""
        n = len(self._units)
        stride = rng.randrange(n // 3, 2 * n // 3 + 1) if n > 2 else 1
        while math.gcd(stride, n) != 1:
            stride += 1
        return rng.randrange(n), stride

    def _block(self, hash_id: int, tokens: int, opening: bool) -> str:
        """The text of block ``hash_id`` with exactly ``tokens`` content tokens (``opening``: the message's first)."""
        start = self._starts.get(hash_id)
        if start is None:
            start = self._starts[hash_id] = (self._base + len(self._starts) * self._stride) % len(self._units)
        pieces, total, i, n = [], 0, start, len(self._units)
        while total < tokens:
            k = i % n
            first_unit = opening and not pieces
            cost = self._first[k] if first_unit else self._spaced[k]
            if total + cost <= tokens:
                pieces.append(self._units[k] if first_unit else " " + self._units[k])
                total += cost
            i += 1
        return "".join(pieces)

    def block_lengths(self, input_length: int, blocks: int) -> list[int]:
        """Content tokens of each block of a prompt of ``input_length`` templated tokens in ``blocks`` blocks.

        Block 0 gives room to the template's opening tokens, the end to its
        closing tokens; blocks left with no content (all closing tokens) are
        dropped from the list.
        """
        content = input_length - len(self._head) - len(self._tail)
        lengths = []
        for k in range(blocks):
            room = self.block_tokens - (len(self._head) if k == 0 else 0)
            take = min(room, content)
            if take <= 0:
                break
            lengths.append(take)
            content -= take
        if content > 0:  # more tokens than the ids cover: the last block takes the rest
            lengths[-1] += content
        return lengths

    def make(self, input_length: int, hash_ids: Sequence[int]) -> str:
        """A user message whose templated chat is exactly ``input_length`` tokens, block ``k`` from ``hash_ids[k]``.

        Raises:
            ValueError: ``input_length`` < :attr:`min_tokens` (template plus one token), or no ``hash_ids``.
        """
        if input_length < self.min_tokens:
            raise ValueError(f"input_length {input_length} tokens is below the template minimum {self.min_tokens}")
        if not hash_ids:
            raise ValueError("a prompt needs at least one hash id")
        lengths = self.block_lengths(input_length, len(hash_ids))
        return "".join(self._block(h, n, k == 0) for k, (h, n) in enumerate(zip(hash_ids, lengths)))

    def _probe(self) -> None:
        """Check the construction on a three-block prompt (raises ``ValueError`` when it does not hold)."""
        probe_starts, self._starts = self._starts, {}
        try:
            length = 2 * self.block_tokens + self.block_tokens // 3
            lengths = self.block_lengths(length, 3)
            blocks = [self._block(h, n, h == 0) for h, n in enumerate(lengths)]
            want = self._head + [t for b in blocks for t in self._tok.encode(b)] + self._tail
            got = self._tok.encode_chat([{"role": "user", "content": "".join(blocks)}])
        finally:
            self._starts = probe_starts
        if got != want or len(got) != length:
            raise ValueError(f"tokenizer {self._tok.name}: real text joined by spaces does not tokenize word by word, "
                             f"so block prompts cannot keep equal blocks equal (probe: {len(got)} tokens, {length} wanted)")
