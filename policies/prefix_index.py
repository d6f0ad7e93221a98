"""Per-engine estimate of which prompt prefixes sit in each engine's prefix cache.

Prompts are cut into blocks of ``block_tokens`` token ids; block k's key is a
chained hash of blocks 0..k, so equal keys mean equal prefixes (as in vLLM's
and SGLang's paged prefix caches). Each engine keeps an LRU set of keys bounded
by ``max_blocks`` (mirroring its KV capacity). For a request, H = the tokens of
the longest run of leading blocks present for an engine; L = prompt - H.

The estimate is corrected by what the engine reports (``cached_tokens``)
after each prefill: a shorter hit than estimated means the engine evicted
that block and, its cache being LRU, every block older than it
(:meth:`PrefixIndex.observe`). Only blocks the request was routed by
count: a prefill's new blocks go in at its first token
(:meth:`PrefixIndex.insert_prefilled`), so that a request arriving meanwhile
finds them, and those are no sign of an eviction when the report comes.

Memory: one ``OrderedDict`` entry per block, ~``BYTES_PER_BLOCK_ENTRY`` bytes
with its key (measured by ``bench/decision_cost.py`` on CPython 3.11: 154 bytes
of RSS per block when filled once, 244 under LRU churn with 1M distinct
conversations passing through, the key being a 32-byte int; the churn adds
dict-table growth and allocator fragmentation);
:meth:`PrefixIndex.from_byte_budget` splits a byte budget evenly over the
engines. Each engine's set is further capped at its own KV pool
(:meth:`PrefixIndex.set_capacity`, from the engine's ``max_total_tokens``):
the engine cannot cache more than that, so neither should the estimate.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Container, Sequence

BYTES_PER_BLOCK_ENTRY = 250  # measured 244 under churn (module doc), so a byte budget holds in RSS
CHAIN_OVERHEAD_BYTES = 250  # a BlockChain and its two arrays' headers and over-allocation


def leading_keys_in(keys: Sequence[int], present: Container[int]) -> int:
    """How many of ``keys`` lead, all in ``present``, for a ``present`` that is prefix-closed over chains (a chained key
    in it means every key before it on its chain is too): a binary search, O(log len(keys)) look-ups."""
    n, hi = 0, len(keys)  # n known present, hi + 1 known not
    while n < hi:
        mid = (n + hi + 1) // 2
        if keys[mid - 1] in present:
            n = mid
        else:
            hi = mid - 1
    return n


def block_keys(token_ids: Sequence[int], block_tokens: int) -> list[int]:
    """Chained keys of the full blocks of ``token_ids`` (a trailing partial block has none).

    ``keys[k]`` identifies ``token_ids[: (k + 1) * block_tokens]``.
    """
    keys: list[int] = []
    prev = 0
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        prev = hash((prev, tuple(token_ids[start : start + block_tokens])))
        keys.append(prev)
    return keys


@dataclass(frozen=True, slots=True)
class BlockChain:
    """The block keys and token ids of a token sequence, extendable without re-hashing the blocks already keyed.

    ``keys`` equals :func:`block_keys` of the whole sequence (signed 64-bit
    ``hash`` values, stored compactly: 8 bytes a block); ``ids`` holds the
    sequence's token ids (4 bytes a token: what an exact prefix cache needs to
    place a hit inside a block, :mod:`policies.exact_prefix`); ``tail`` is the
    ids after the last full block; ``tokens`` is the sequence's length.
    A chain is never changed in place: :meth:`extend` returns a new one, so
    a conversation's chain can be shared by every later turn.
    """

    block_tokens: int
    keys: array = field(default_factory=lambda: array("q"))
    ids: array = field(default_factory=lambda: array("I"))

    @property
    def tokens(self) -> int:
        return len(self.ids)

    @property
    def tail(self) -> array:
        """The token ids after the last full block."""
        return self.ids[len(self.keys) * self.block_tokens:]

    def extend(self, token_ids: Sequence[int]) -> "BlockChain":
        """The chain of this sequence followed by ``token_ids``: only the new blocks are hashed (O(new tokens) hashing,
        one copy of the ids)."""
        b = self.block_tokens
        ids = array("I", self.ids)
        ids.extend(token_ids)
        data = (*self.tail, *token_ids)  # the tokens not keyed yet, sliced as a tuple (cheaper than from the array)
        keys = array("q", self.keys)
        prev = keys[-1] if keys else 0
        for start in range(0, len(data) - b + 1, b):
            prev = hash((prev, data[start : start + b]))
            keys.append(prev)
        return BlockChain(b, keys, ids)

    @property
    def nbytes(self) -> int:
        """Memory held by this chain: 8 bytes a key, 4 a token id, plus ``CHAIN_OVERHEAD_BYTES``."""
        return 8 * len(self.keys) + 4 * len(self.ids) + CHAIN_OVERHEAD_BYTES


class PrefixIndex:
    """LRU sets of block keys per engine; see the module docstring.

    Args:
        block_tokens: tokens per block (estimates are multiples of it).
        max_blocks: blocks remembered per engine; the least recently used go first.
    """

    def __init__(self, block_tokens: int = 16, max_blocks: int = 65536) -> None:
        if block_tokens < 1 or max_blocks < 1:
            raise ValueError("block_tokens and max_blocks must be >= 1")
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks
        self._engines: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}

    @classmethod
    def from_byte_budget(cls, block_tokens: int, budget_bytes: int, engines: int) -> "PrefixIndex":
        """An index whose engines together stay within ``budget_bytes`` (~BYTES_PER_BLOCK_ENTRY per block).

        Raises:
            ValueError: when the budget does not hold one block per engine.
        """
        max_blocks = budget_bytes // (BYTES_PER_BLOCK_ENTRY * max(engines, 1))
        if max_blocks < 1:
            raise ValueError(f"a prefix index budget of {budget_bytes} bytes is too small for {engines} engines")
        return cls(block_tokens, max_blocks)

    def set_capacity(self, engine_id: str, kv_tokens: int) -> None:
        """Cap ``engine_id``'s blocks at its KV pool of ``kv_tokens`` tokens (evicting LRU blocks now if over)."""
        self._capacity[engine_id] = max(1, kv_tokens // self.block_tokens)
        self._trim(engine_id)

    def capacity(self, engine_id: str) -> int:
        """Blocks ``engine_id`` may hold: the smaller of the byte-budget share and its KV pool."""
        return min(self.max_blocks, self._capacity.get(engine_id, self.max_blocks))

    def _trim(self, engine_id: str) -> None:
        blocks = self._engines.get(engine_id)
        if blocks is None:
            return
        cap = self.capacity(engine_id)
        while len(blocks) > cap:
            blocks.popitem(last=False)

    def cached_tokens(self, engine_id: str, keys: Sequence[int]) -> int:
        """H: tokens of the longest leading run of ``keys`` present on ``engine_id``."""
        blocks = self._engines.get(engine_id)
        if not blocks:
            return 0
        n = 0
        for key in keys:
            if key not in blocks:
                break
            n += 1
        return n * self.block_tokens

    def insert(self, engine_id: str, keys: Sequence[int]) -> None:
        """Record that ``engine_id`` now holds the prefix ``keys`` (most recently used)."""
        blocks = self._engines.setdefault(engine_id, OrderedDict())
        for key in keys:
            blocks[key] = None
            blocks.move_to_end(key)
        self._trim(engine_id)

    def insert_prefilled(self, engine_id: str, keys: Sequence[int], routed_cached_tokens: int) -> None:
        """A prefill of ``keys`` routed to ``engine_id`` by ``routed_cached_tokens`` has its first token: insert its
        blocks past those, so that a request arriving meanwhile finds them. The blocks it was routed by keep their
        LRU place until the engine's report (:meth:`observe`), which may say one of them was evicted."""
        self.insert(engine_id, keys[routed_cached_tokens // self.block_tokens:])

    def observe(self, engine_id: str, keys: Sequence[int], reported_cached_tokens: int | None,
                routed_cached_tokens: int | None = None) -> None:
        """Take the engine's report of a finished prefill of ``keys``, then insert ``keys``.

        ``None``: the engine reported nothing (e.g. a stream without usage); only insert.
        ``routed_cached_tokens``: what the request was routed by on ``engine_id`` (None: all of ``keys``
        counts). Only those blocks can have been evicted since; the ones the request's own prefill added
        (:meth:`insert_prefilled`) are no sign of an eviction.
        With KV events the figure is the exact one, so this estimate learns evictions only below it (it is
        what routes again only after a fall-back, and each report there corrects it).

        When the engine reports fewer cached tokens than the index held, it had
        evicted block ``keys[(reported + 1) // block_tokens]``; its cache is LRU, so every
        block used less recently than that one is gone too and is forgotten here.
        The whole prompt is then cached on the engine (it just computed it).
        """
        blocks = self._engines.get(engine_id)
        # + 1: an engine never reports a prompt's last token as cached (it computes it again for the first output
        # token), so a whole hit on a prompt of whole blocks reads one token short of its last block.
        first_missing = len(keys) if reported_cached_tokens is None else (reported_cached_tokens + 1) // self.block_tokens
        held = len(keys) if routed_cached_tokens is None else min(len(keys), routed_cached_tokens // self.block_tokens)
        if blocks and first_missing < held and keys[first_missing] in blocks:
            evicted = keys[first_missing]
            while blocks:
                key, _ = blocks.popitem(last=False)
                if key == evicted:
                    break
        self.insert(engine_id, keys)

    def forget_engine(self, engine_id: str) -> None:
        """Drop everything known about ``engine_id`` (it restarted or left); its capacity stays."""
        self._engines.pop(engine_id, None)

    def blocks(self, engine_id: str) -> int:
        """Number of blocks remembered for ``engine_id``."""
        return len(self._engines.get(engine_id, ()))
