"""A radix tree over token ids: SGLang's prefix cache (``mem_cache/radix_cache.py``) at page size 1.

Each node holds the KV of the tokens on its edge. Requests lock the path they
use (``lock_ref`` counts users); unlocked leaves are evicted least-recently
used first, and a parent left without children joins the candidates (as in
SGLang's ``RadixCache.evict``). Matching and inserting stamp every node on the
path as used now. Recency is a logical access counter, not a clock, so the
tree is deterministic. Sizes are in tokens; keys are tuples of token ids.

Eviction does not scan the tree: every node that becomes an unlocked leaf, or
is touched while it is one, is pushed on a heap keyed ``(last_access, seq)``;
an entry is stale (skipped when popped) unless it is the node's latest push and
the node is still an attached, unlocked leaf. The heap is rebuilt from the
leaves when stale entries outnumber live nodes, so eviction costs
O(k log n) for k evicted leaves.

With ``events`` (a list), the tree records what SGLang's radix cache publishes
as KV cache events (``mem_cache/events.py`` in 0.5.23), at page size 1: a new
leaf is a :class:`~policies.exact_prefix.BlockStored` of its tokens (one page
each, under its parent's last page), an evicted leaf a
:class:`~policies.exact_prefix.BlockRemoved` of its pages,
:meth:`RadixCache.reset` (and a new tree) an
:class:`~policies.exact_prefix.AllBlocksCleared`; a split changes no page and
records nothing. Page hashes are opaque ids, as SGLang's are to a consumer:
SGLang chains SHA-256 over the tokens, here each new leaf takes the next run of
a counter (a node's pages are ``first_hash + i``), so recording costs O(1)
Python work per insertion or eviction, not per token.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Sequence

from policies.exact_prefix import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

Key = tuple[int, ...]


class RadixNode:
    """One edge of the tree: ``key`` is its token ids; ``lock_ref`` > 0 pins it and its ancestors."""

    __slots__ = ("children", "parent", "key", "lock_ref", "last_access", "heap_seq", "first_hash")

    def __init__(self, key: Key, parent: RadixNode | None) -> None:
        self.children: dict[int, RadixNode] = {}
        self.parent = parent
        self.key = key
        self.lock_ref = 0
        self.last_access = 0
        self.heap_seq = -1  # seq of this node's latest eviction-heap entry
        self.first_hash = 0  # with events: the hash of the page of its first token; page i's is first_hash + i


class RadixCache:
    """Prefix cache over token-id tuples with lock references and LRU eviction of unlocked leaves.

    ``events``: where to record KV cache events (module doc); None records none.
    """

    def __init__(self, events: list[KVEvent] | None = None) -> None:
        self.events = events
        self._next_hash = 1
        if events is not None:
            events.append(AllBlocksCleared())
        self.root = RadixNode((), None)
        self.root.lock_ref = 1  # the root is never evicted
        self._clock = 0
        self._seq = itertools.count()
        self._heap: list[tuple[int, int, RadixNode]] = []
        self._nodes = 1
        self.total_size = 0
        self.protected_size = 0

    @property
    def evictable_size(self) -> int:
        """Tokens held by unlocked nodes (freeable by :meth:`evict`)."""
        return self.total_size - self.protected_size

    def reset(self) -> None:
        """Drop every entry (the caller guarantees nothing is locked)."""
        self.__init__(self.events)

    def peek_prefix(self, ids: Sequence[int]) -> int:
        """Length of the longest cached prefix of ``ids``, changing nothing (no split, no access time)."""
        ids = tuple(ids)  # no copy when it already is one
        node, pos, n_ids = self.root, 0, len(ids)
        while pos < n_ids:
            child = node.children.get(ids[pos])
            if child is None:
                break
            n = _common_len(child.key, ids, pos)
            pos += n
            if n < len(child.key):
                break
            node = child
        return pos

    def match_prefix(self, ids: Sequence[int]) -> tuple[int, RadixNode]:
        """Longest cached prefix of ``ids``: (its length, the node ending exactly there).

        Splits an edge matched part-way so the returned node ends at the match;
        marks the path as used now.
        """
        return self._walk(ids, split=True)

    def touch_prefix(self, ids: Sequence[int]) -> None:
        """Mark the cached prefix of ``ids`` as used now, without splitting (SGLang's waiting-prefix refresh)."""
        self._walk(ids, split=False)

    def _walk(self, ids: Sequence[int], split: bool) -> tuple[int, RadixNode]:
        """Follow ``ids`` down the tree, stamping each node on the path; (matched length, last node)."""
        ids = tuple(ids)  # no copy when it already is one
        self._clock += 1
        stamp = self._clock
        node, pos, n_ids = self.root, 0, len(ids)
        while pos < n_ids:
            child = node.children.get(ids[pos])
            if child is None:
                break
            n = _common_len(child.key, ids, pos)
            if split and n < len(child.key):
                child = self._split(child, n)
            child.last_access = stamp
            node = child
            pos += n
            if n < len(child.key):
                break
        self._touched(node)
        return pos, node

    def insert(self, ids: Sequence[int]) -> tuple[RadixNode, int]:
        """Cache ``ids``: (the node ending at its last token, tokens newly added to the tree)."""
        ids = tuple(ids)  # no copy when it already is one
        self._clock += 1
        stamp = self._clock
        node, pos, n_ids = self.root, 0, len(ids)
        while pos < n_ids:
            child = node.children.get(ids[pos])
            if child is None:
                leaf = RadixNode(ids[pos:], node)
                leaf.last_access = stamp
                if self.events is not None:
                    leaf.first_hash, self._next_hash = self._next_hash, self._next_hash + len(leaf.key)
                    self.events.append(BlockStored(_pages(leaf), self._last_page(node), leaf.key, 1))
                node.children[ids[pos]] = leaf
                added = n_ids - pos
                self.total_size += added
                self._nodes += 1
                self._push(leaf)
                return leaf, added
            n = _common_len(child.key, ids, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = stamp
            node = child
            pos += n
        self._touched(node)
        return node, 0

    def lock(self, node: RadixNode) -> None:
        """Pin ``node`` and its ancestors against eviction."""
        root = self.root
        while node is not root:
            if node.lock_ref == 0:
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: RadixNode) -> None:
        """Undo one :meth:`lock` of ``node``.

        Raises:
            RuntimeError: if a node on the path is not locked.
        """
        root = self.root
        while node is not root:
            if node.lock_ref == 0:
                raise RuntimeError("unlock of an unlocked radix node")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.protected_size -= len(node.key)
                if not node.children:
                    self._push(node)
            node = node.parent  # type: ignore[assignment]

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` tokens from unlocked leaves, least recently used first.

        Returns the tokens freed (less than asked only when nothing else is evictable).
        """
        freed = 0
        heap = self._heap
        while freed < num_tokens and heap:
            _, seq, leaf = heapq.heappop(heap)
            parent = leaf.parent
            if seq != leaf.heap_seq or parent is None or leaf.children or leaf.lock_ref:
                continue  # stale entry
            del parent.children[leaf.key[0]]
            leaf.parent = None
            freed += len(leaf.key)
            self.total_size -= len(leaf.key)
            if self.events is not None:
                self.events.append(BlockRemoved(_pages(leaf)))
            self._nodes -= 1
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                self._push(parent)
        return freed

    def _last_page(self, node: RadixNode) -> int | None:
        """The hash of ``node``'s last page (None: the root, which has none)."""
        return None if node is self.root else node.first_hash + len(node.key) - 1

    def _touched(self, node: RadixNode) -> None:
        """Re-key ``node`` in the eviction heap after its access time changed, if it is an unlocked leaf."""
        if node is not self.root and not node.children and node.lock_ref == 0:
            self._push(node)

    def _push(self, node: RadixNode) -> None:
        seq = next(self._seq)
        node.heap_seq = seq
        heapq.heappush(self._heap, (node.last_access, seq, node))
        if len(self._heap) > 2 * self._nodes + 1024:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        heap = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root and node.lock_ref == 0:
                seq = next(self._seq)
                node.heap_seq = seq
                heap.append((node.last_access, seq, node))
        heapq.heapify(heap)
        self._heap = heap

    def _split(self, child: RadixNode, n: int) -> RadixNode:
        """Cut ``child``'s edge after ``n`` tokens; return the new upper node."""
        parent = child.parent
        assert parent is not None
        upper = RadixNode(child.key[:n], parent)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        upper.first_hash = child.first_hash
        parent.children[child.key[0]] = upper
        child.key = child.key[n:]
        child.first_hash += n
        child.parent = upper
        upper.children[child.key[0]] = child
        self._nodes += 1
        return upper


def _common_len(key: Key, ids: Key, start: int) -> int:
    """Length of the common prefix of ``key`` and ``ids[start:]``; slices compare in C, halving on a mismatch."""
    n = min(len(key), len(ids) - start)
    if key[:n] == ids[start : start + n]:
        return n
    lo, hi = 0, n  # key[:lo] matches, key[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if key[lo:mid] == ids[start + lo : start + mid]:
            lo = mid
        else:
            hi = mid
    return lo



def _pages(node: RadixNode) -> range:
    """The page hashes of ``node``'s tokens (page size 1)."""
    return range(node.first_hash, node.first_hash + len(node.key))
