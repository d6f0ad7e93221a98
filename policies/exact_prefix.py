"""Exact prefix caches from the engines' own KV cache events, with the estimate as the fallback.

SGLang (0.5.23, ``--kv-events-config``) publishes what its radix cache does:
``BlockStored`` (pages inserted: their engine hashes, the hash of the page
before the first, their token ids), ``BlockRemoved`` (pages evicted, by engine
hash) and ``AllBlocksCleared`` (``/flush_cache``, start-up). The gateway's
I/O shell decodes them into the plain events below; this module stays pure.

:class:`EngineBlocks` is one engine's cache rebuilt from its events, keyed by
our own chained hash of the token ids (engine hash formats do not matter): a
page ending ``n`` tokens into a prompt is keyed ``hash((K, ids[b : n]))``,
``K`` being the :func:`policies.prefix_index.block_keys` key of the first
``b = block_tokens * floor((n - 1) / block_tokens)`` tokens (0 for none), so a
page that ends a block is keyed by that block's own chain key. The cached set
is prefix-closed (a radix cache only evicts leaves, and a store names its
parent), so the hit of a prompt is found by binary search: over its block
keys, then over the page ends inside the next block, O(log(prompt / page))
dict look-ups. Pages must divide blocks (``block_tokens % page_tokens == 0``).
Memory: two dict entries per page (~270 bytes with page size 1, measured with
tracemalloc over 1M pages), holding the page's block key and its tokens since
the block start.

H is what the engine will report as ``cached_tokens``: SGLang matches at most
``prompt - 1`` tokens (``Req._compute_max_prefix_len``: one token is always
computed for the logits), rounded down to its page size.

:class:`PrefixCaches` is what the gateway and the virtual-time simulator
ask for H: exact for an engine whose events it follows, else the estimate of
:class:`policies.prefix_index.PrefixIndex`, which keeps learning from every
answer meanwhile so that a stream that stops falls back onto a warm estimate. Its
``in_flight`` (:class:`policies.in_flight_prefix.InFlightPrefills`) holds the
prompts being prefilled, which no cache shows whole yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from policies.in_flight_prefix import InFlightPrefills
from policies.prefix_index import BlockChain, PrefixIndex, leading_keys_in


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Pages added to an engine's cache: ``block_hashes[i]`` covers ``token_ids[i * block_size : (i + 1) * block_size]``;
    ``parent_block_hash`` is the page before the first one (None: the first page of a prompt)."""

    block_hashes: Sequence[int]
    parent_block_hash: int | None
    token_ids: Sequence[int]
    block_size: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Pages evicted from an engine's cache, by engine hash."""

    block_hashes: Sequence[int]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine's cache was emptied (``/flush_cache``, or a fresh cache at start-up)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventsOutOfStep(ValueError):
    """Events that do not fit the cache built so far (a store under an unknown page, a removal of one never stored,
    a page of the wrong size): some were missed, so the engine's cache is no longer known."""


class EngineBlocks:
    """One engine's prefix cache, rebuilt from its events (module doc).

    Args:
        block_tokens: tokens per chain block (``scheduling.prefix_block_tokens``).
        page_tokens: the engine's page size (SGLang ``--page-size``); must divide ``block_tokens``.

    Raises:
        ValueError: ``page_tokens`` < 1 or not a divisor of ``block_tokens``.
    """

    def __init__(self, block_tokens: int, page_tokens: int = 1) -> None:
        if page_tokens < 1 or block_tokens % page_tokens:
            raise ValueError(f"the engine's page size ({page_tokens}) must divide the prefix block size ({block_tokens})")
        self.block_tokens = block_tokens
        self.page_tokens = page_tokens
        self._pages: dict[int, tuple[int, tuple[int, ...]]] = {}  # engine hash -> (block key before, ids since it)
        self._present: dict[int, int] = {}  # our key of a cached page end -> pages keyed so

    def __len__(self) -> int:
        """Pages cached."""
        return len(self._pages)

    def apply(self, events: Iterable[KVEvent]) -> None:
        """Apply ``events`` in order.

        Raises:
            EventsOutOfStep: an event does not fit (class doc); the events before it are applied.
        """
        for event in events:
            if isinstance(event, BlockStored):
                self._store(event)
            elif isinstance(event, BlockRemoved):
                self._remove(event.block_hashes)
            else:
                self.clear()

    def clear(self) -> None:
        self._pages.clear()
        self._present.clear()

    def _store(self, event: BlockStored) -> None:
        size, b = event.block_size, self.block_tokens
        if size != self.page_tokens or len(event.token_ids) != size * len(event.block_hashes):
            raise EventsOutOfStep(f"BlockStored of {len(event.block_hashes)} page(s) of {size} token(s) with {len(event.token_ids)} "
                                  f"token ids, but the engine's page size is {self.page_tokens}")
        if event.parent_block_hash is None:
            base, ids = 0, ()
        else:
            parent = self._pages.get(event.parent_block_hash)
            if parent is None:
                raise EventsOutOfStep(f"BlockStored under page {event.parent_block_hash}, which is not cached")
            base, ids = parent
        tokens = tuple(event.token_ids)
        pages, present = self._pages, self._present
        count = present.get
        for i, engine_hash in enumerate(event.block_hashes):
            ids = ids + tokens[i * size : (i + 1) * size]
            if len(ids) == b:
                base = key = hash((base, ids))
                ids = ()
            else:
                key = hash((base, ids))
            if engine_hash in pages:
                continue  # already cached (stored twice under one hash): nothing changes
            pages[engine_hash] = (base, ids)
            present[key] = count(key, 0) + 1

    def _remove(self, engine_hashes: Sequence[int]) -> None:
        for engine_hash in engine_hashes:
            page = self._pages.pop(engine_hash, None)
            if page is None:
                raise EventsOutOfStep(f"BlockRemoved of page {engine_hash}, which is not cached")
            base, ids = page
            key = hash((base, ids)) if ids else base
            left = self._present[key] - 1
            if left:
                self._present[key] = left
            else:
                del self._present[key]

    def cached_tokens(self, chain: BlockChain) -> int:
        """H of the prompt ``chain``: its leading tokens cached here, as the engine will count them (module doc)."""
        present, keys, b, p = self._present, chain.keys, self.block_tokens, self.page_tokens
        n = leading_keys_in(keys, present)  # whole blocks cached (the set is prefix-closed)
        base = keys[n - 1] if n else 0
        start = n * b
        rest = chain.ids[start : start + b - 1]
        lo, hi = 0, len(rest) // p  # pages of the next block: lo known cached, hi + 1 known not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hash((base, tuple(rest[: mid * p]))) in present:
                lo = mid
            else:
                hi = mid - 1
        limit = (chain.tokens - 1) // p * p if chain.tokens else 0
        return min(start + lo * p, limit)


class PrefixCaches:
    """H per engine: exact where the engine's events are followed (:meth:`follow`), else ``estimate``'s.

    The estimate learns from every answer (:meth:`insert`, :meth:`observe`) either way. ``in_flight``: the prefills
    in flight, which the runner starts at dispatch and ends at the first token or the end.
    """

    def __init__(self, estimate: PrefixIndex) -> None:
        self.estimate = estimate
        self.in_flight = InFlightPrefills(estimate.block_tokens)
        self._exact: dict[str, EngineBlocks] = {}

    @property
    def block_tokens(self) -> int:
        return self.estimate.block_tokens

    def is_exact(self, engine_id: str) -> bool:
        return engine_id in self._exact

    def follow(self, engine_id: str, page_tokens: int = 1) -> EngineBlocks:
        """Start following ``engine_id`` from an empty cache (its events from a clear, or from its first); H becomes exact.

        Raises:
            ValueError: as :class:`EngineBlocks`.
        """
        blocks = self._exact[engine_id] = EngineBlocks(self.block_tokens, page_tokens)
        return blocks

    def unfollow(self, engine_id: str) -> None:
        """Stop following ``engine_id`` (its stream stopped or missed events): its H is the estimate's again."""
        self._exact.pop(engine_id, None)

    def apply(self, engine_id: str, events: Iterable[KVEvent]) -> bool:
        """Apply ``engine_id``'s events when it is followed; False when they do not fit (it is then unfollowed)."""
        blocks = self._exact.get(engine_id)
        if blocks is None:
            return False
        try:
            blocks.apply(events)
        except EventsOutOfStep:
            self.unfollow(engine_id)
            return False
        return True

    def cached_tokens(self, engine_id: str, chain: BlockChain) -> int:
        """H of the prompt ``chain`` on ``engine_id``."""
        blocks = self._exact.get(engine_id)
        if blocks is not None:
            return blocks.cached_tokens(chain)
        return self.estimate.cached_tokens(engine_id, chain.keys)

    def insert(self, engine_id: str, keys: Sequence[int]) -> None:
        """The estimate's :meth:`~policies.prefix_index.PrefixIndex.insert`."""
        self.estimate.insert(engine_id, keys)

    def insert_prefilled(self, engine_id: str, keys: Sequence[int], routed_cached_tokens: int) -> None:
        """The estimate's :meth:`~policies.prefix_index.PrefixIndex.insert_prefilled`."""
        self.estimate.insert_prefilled(engine_id, keys, routed_cached_tokens)

    def observe(self, engine_id: str, keys: Sequence[int], reported_cached_tokens: int | None,
                routed_cached_tokens: int | None = None) -> None:
        """The estimate's :meth:`~policies.prefix_index.PrefixIndex.observe`."""
        self.estimate.observe(engine_id, keys, reported_cached_tokens, routed_cached_tokens)

    def set_capacity(self, engine_id: str, kv_tokens: int) -> None:
        """The estimate's :meth:`~policies.prefix_index.PrefixIndex.set_capacity`."""
        self.estimate.set_capacity(engine_id, kv_tokens)

    def forget_engine(self, engine_id: str) -> None:
        """``engine_id`` restarted or changed role: forget its cache, estimated and exact (following resumes with its
        new events), and its prefills in flight."""
        self.estimate.forget_engine(engine_id)
        self.unfollow(engine_id)
        self.in_flight.forget_engine(engine_id)
