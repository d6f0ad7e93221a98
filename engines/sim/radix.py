"""A radix tree over token ids: SGLang's prefix cache (``mem_cache/radix_cache.py``) at page size 1.

Each node holds the KV of the tokens on its edge. Requests lock the path they
use (``lock_ref`` counts users); unlocked leaves are evicted least-recently
used first. Recency is a logical access counter, not a clock, so the tree is
deterministic. Sizes are in tokens.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Sequence


class RadixNode:
    """One edge of the tree: ``key`` is its token ids; ``lock_ref`` > 0 pins it and its ancestors."""

    __slots__ = ("children", "parent", "key", "lock_ref", "last_access")

    def __init__(self, key: tuple[int, ...], parent: RadixNode | None) -> None:
        self.children: dict[int, RadixNode] = {}
        self.parent = parent
        self.key = key
        self.lock_ref = 0
        self.last_access = 0


class RadixCache:
    """Prefix cache over token-id sequences with lock references and LRU eviction of unlocked leaves."""

    def __init__(self) -> None:
        self.root = RadixNode((), None)
        self.root.lock_ref = 1  # the root is never evicted
        self._clock = 0
        self.total_size = 0
        self.protected_size = 0

    @property
    def evictable_size(self) -> int:
        """Tokens held by unlocked nodes (freeable by :meth:`evict`)."""
        return self.total_size - self.protected_size

    def reset(self) -> None:
        """Drop every entry (the caller guarantees nothing is locked)."""
        self.__init__()

    def _touch(self) -> int:
        self._clock += 1
        return self._clock

    def peek_prefix(self, ids: Sequence[int]) -> int:
        """Length of the longest cached prefix of ``ids``, changing nothing (no split, no access time)."""
        node, pos = self.root, 0
        while pos < len(ids):
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
        stamp = self._touch()
        node, pos = self.root, 0
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            n = _common_len(child.key, ids, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = stamp
            node = child
            pos += n
            if n < len(child.key):
                break
        return pos, node

    def insert(self, ids: Sequence[int]) -> tuple[RadixNode, int]:
        """Cache ``ids``: (the node ending at its last token, tokens newly added to the tree)."""
        stamp = self._touch()
        node, pos, added = self.root, 0, 0
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                leaf = RadixNode(tuple(ids[pos:]), node)
                leaf.last_access = stamp
                node.children[ids[pos]] = leaf
                added += len(leaf.key)
                self.total_size += len(leaf.key)
                return leaf, added
            n = _common_len(child.key, ids, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = stamp
            node = child
            pos += n
        return node, added

    def lock(self, node: RadixNode) -> None:
        """Pin ``node`` and its ancestors against eviction."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: RadixNode) -> None:
        """Undo one :meth:`lock` of ``node``.

        Raises:
            RuntimeError: if a node on the path is not locked.
        """
        while node is not self.root:
            if node.lock_ref == 0:
                raise RuntimeError("unlock of an unlocked radix node")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.protected_size -= len(node.key)
            node = node.parent  # type: ignore[assignment]

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` tokens from unlocked leaves, least recently used first.

        Returns the tokens freed (less than asked only when nothing else is evictable).
        """
        order = itertools.count()  # tie-breaker: traversal order, deterministic
        heap = [(n.last_access, next(order), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            freed += len(leaf.key)
            self.total_size -= len(leaf.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, next(order), parent))
        return freed

    def _leaves(self) -> list[RadixNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                out.append(node)
        return out

    def _split(self, child: RadixNode, n: int) -> RadixNode:
        """Cut ``child``'s edge after ``n`` tokens; return the new upper node."""
        parent = child.parent
        assert parent is not None
        upper = RadixNode(child.key[:n], parent)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        parent.children[child.key[0]] = upper
        child.key = child.key[n:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper


def _common_len(key: tuple[int, ...], ids: Sequence[int], start: int) -> int:
    n = min(len(key), len(ids) - start)
    i = 0
    while i < n and key[i] == ids[start + i]:
        i += 1
    return i
