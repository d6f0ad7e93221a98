"""AlignedServe prefix-aware batch search (Bai et al., SIGMOD 2026; DESIGN §3): a quad-tree over KV
context length whose nodes count (requests, KV blocks); density-first descent to a batch of at
least K_min requests within B_max blocks, borrowing from the nearest leaves when too few.

The paper's body was not available to us (only its abstract); the rules below follow DESIGN §3
and issue 8, and where those leave a choice open the choice is ours and is stated here.

Tree. The root covers context lengths [0, leaf_tokens * 4**depth), the smallest such range that
holds ``max_context_tokens``; every internal node splits its range into 4 equal children, so the
leaves (level ``depth``) are ``leaf_tokens`` wide. All nodes exist (a complete tree in per-level
arrays), so a node is ``(level, index)`` and its children are ``4*index .. 4*index + 3``. A request
of context c tokens (c >= 1) lives in leaf ``c // leaf_tokens`` and holds ``ceil(c / block_tokens)``
KV blocks; prefix blocks shared between requests are counted once per request (an upper bound).
Every node keeps, exactly, the number of requests and of blocks in its subtree and a starvation
stamp: the earliest ``since`` (time the request started waiting) in its subtree, ``inf`` if empty.
Insert and remove cost O(depth); ``grow`` (a decoding request gains tokens) costs nothing while
the request keeps its leaf and block count, O(depth) when its block count changes, and when it
crosses into another leaf only the nodes below the two leaves' lowest common ancestor move their
request count (ancestors above it only change their block count). Stamps are recomputed only on
the paths where the earliest request left.

Search (``search``), from the root:

* case 1: the node fits (blocks <= B_max) and holds >= K_min requests: take its whole subtree;
* case 2: the node is over budget: descend into the child with the highest density, requests per
  KV block (ties: the left child). Since children split by length, a left child's requests are
  never longer, so this descent goes to the shortest non-empty range; at a leaf still over
  budget, take its requests oldest first while they fit;
* case 3: the node fits but holds < K_min requests: take it, then borrow from the nearest
  non-empty leaves outside it until the batch has K_min requests or nothing else fits.
  Borrowing widens a contiguous leaf window one leaf at a time: the candidate on each side is
  the nearest non-empty leaf (found through the counters: up to the first ancestor with a
  non-empty sibling on that side, then down its near edge); the one fewer leaves away wins,
  ties go left (shorter contexts). From a left leaf requests are taken longest first, from a
  right leaf shortest first (closest to the window), each one that still fits; the right side
  closes at the first request that does not fit, since everything further right is longer.
  Borrowing stops at exactly K_min requests: it widens the batch's length spread only as far as
  needed. If the whole tree cannot supply K_min, the batch is smaller.

Starvation: when the root's stamp is older than ``now - starvation_s`` (some request has waited
longer than the threshold) the descent follows the child holding the oldest request instead of
the densest, so the batch is formed around the starving request; the same three cases apply.
``nearest`` (the candidate request buffer's source) reuses the window widening around a length.

Lengths are tokens, budgets KV blocks, times seconds on the caller's clock. Pure: no clock, no RNG.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction

_LEFT, _RIGHT = -1, 1


@dataclass(frozen=True, slots=True)
class NodeStats:
    """One node's counters: requests and KV blocks in its subtree, the earliest waiting-since time
    among them (``inf`` when empty), and its context-length range ``[lo_tokens, hi_tokens)``."""

    count: int
    blocks: int
    stamp: float
    lo_tokens: int
    hi_tokens: int


@dataclass(frozen=True, slots=True)
class Batch:
    """A batch chosen by :meth:`QuadTree.search` (the requests stay in the tree until removed).

    ``rids``: ascending context length, then rid; ``blocks``: their KV blocks (<= the budget);
    ``anchor``: ``(level, index)`` of the node the descent stopped at; ``borrowed``: how many
    requests came from outside the anchor (case 3); ``starved``: the descent followed the oldest
    request because it had waited past the starvation threshold.
    """

    rids: tuple[str, ...]
    blocks: int
    anchor: tuple[int, int]
    borrowed: int
    starved: bool


@dataclass(slots=True)
class _Entry:
    tokens: int
    blocks: int
    since: float
    leaf: int


class QuadTree:
    """Requests indexed by context length, with exact per-node (count, blocks, stamp) counters.

    ``max_context_tokens``: longest context accepted; ``leaf_tokens``: width of a leaf's length
    range; ``block_tokens``: tokens per KV block. Raises ``ValueError`` if any is < 1.
    """

    def __init__(self, max_context_tokens: int, leaf_tokens: int = 64, block_tokens: int = 16) -> None:
        if min(max_context_tokens, leaf_tokens, block_tokens) < 1:
            raise ValueError("max_context_tokens, leaf_tokens and block_tokens must be >= 1")
        self.max_context_tokens = max_context_tokens
        self.leaf_tokens = leaf_tokens
        self.block_tokens = block_tokens
        self.depth = 0
        while 4**self.depth <= max_context_tokens // leaf_tokens:
            self.depth += 1
        self._count = [[0] * 4**level for level in range(self.depth + 1)]
        self._blocks = [[0] * 4**level for level in range(self.depth + 1)]
        self._stamp = [[math.inf] * 4**level for level in range(self.depth + 1)]
        self._leaves: dict[int, dict[str, None]] = {}
        self._entries: dict[str, _Entry] = {}

    # -- queries ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, rid: object) -> bool:
        return rid in self._entries

    def __iter__(self) -> Iterator[str]:
        """The rids held, as a snapshot (safe to modify the tree while iterating)."""
        return iter(list(self._entries))

    @property
    def total_blocks(self) -> int:
        """KV blocks of all requests held (the root's block counter)."""
        return self._blocks[0][0]

    def blocks_for(self, tokens: int) -> int:
        """KV blocks a context of ``tokens`` tokens occupies: ceil(tokens / block_tokens)."""
        return -(-tokens // self.block_tokens)

    def tokens(self, rid: str) -> int:
        """Context length of ``rid`` in tokens; ``KeyError`` if absent."""
        return self._entries[rid].tokens

    def since(self, rid: str) -> float:
        """When ``rid`` started waiting (as given to :meth:`insert`); ``KeyError`` if absent."""
        return self._entries[rid].since

    def node(self, level: int, index: int) -> NodeStats:
        """Counters of node ``index`` (0 .. 4**level - 1) at ``level`` (0 = root .. ``depth``)."""
        width = self.leaf_tokens * 4 ** (self.depth - level)
        return NodeStats(self._count[level][index], self._blocks[level][index], self._stamp[level][index],
                         index * width, (index + 1) * width)

    def longest(self) -> str | None:
        """The request with the longest context (ties: the largest rid), or ``None`` when empty. O(depth)."""
        if not self._entries:
            return None
        index = 0
        for level in range(1, self.depth + 1):
            index = max(c for c in range(4 * index, 4 * index + 4) if self._count[level][c])
        return max(self._leaves[index], key=lambda r: (self._entries[r].tokens, r))

    # -- updates ------------------------------------------------------------------------------

    def insert(self, rid: str, tokens: int, since: float) -> None:
        """Add ``rid`` with a context of ``tokens`` tokens, waiting since ``since``.

        Raises ``ValueError`` if ``rid`` is already held or ``tokens`` is outside [1, max_context_tokens].
        """
        if rid in self._entries:
            raise ValueError(f"request {rid!r} is already in the tree")
        leaf = self._leaf_of(tokens)
        entry = _Entry(tokens, self.blocks_for(tokens), since, leaf)
        self._entries[rid] = entry
        self._leaves.setdefault(leaf, {})[rid] = None
        self._add(leaf, 1, entry.blocks, 0)
        self._stamp_in(leaf, since, 0)

    def remove(self, rid: str) -> int:
        """Remove ``rid`` and return its context length; ``KeyError`` if absent."""
        entry = self._entries.pop(rid)
        self._detach(rid, entry.leaf)
        self._add(entry.leaf, -1, -entry.blocks, 0)
        self._stamp_out(entry.leaf, entry.since, 0)
        return entry.tokens

    def grow(self, rid: str, tokens: int = 1) -> int:
        """Lengthen ``rid``'s context by ``tokens`` (a decode step adds 1) and return the new length.

        Raises ``KeyError`` if absent and ``ValueError`` past ``max_context_tokens`` (nothing changes then).
        """
        entry = self._entries[rid]
        new_tokens = entry.tokens + tokens
        new_leaf = self._leaf_of(new_tokens)
        new_blocks = self.blocks_for(new_tokens)
        old_leaf, old_blocks = entry.leaf, entry.blocks
        entry.tokens, entry.blocks, entry.leaf = new_tokens, new_blocks, new_leaf
        if new_leaf != old_leaf:
            self._detach(rid, old_leaf)
            self._leaves.setdefault(new_leaf, {})[rid] = None
            # Below the lowest common ancestor the request changes node; from it up only blocks change.
            lca = self.depth - (((old_leaf ^ new_leaf).bit_length() + 1) // 2)
            self._add(old_leaf, -1, -old_blocks, lca + 1)
            self._add(new_leaf, 1, new_blocks, lca + 1)
            self._stamp_out(old_leaf, entry.since, lca + 1)
            self._stamp_in(new_leaf, entry.since, lca + 1)
            self._add(new_leaf, 0, new_blocks - old_blocks, 0, lca)
        elif new_blocks != old_blocks:
            self._add(new_leaf, 0, new_blocks - old_blocks, 0)
        return new_tokens

    # -- search -------------------------------------------------------------------------------

    def search(self, block_budget: int, min_requests: int, now: float, starvation_s: float = math.inf) -> Batch | None:
        """Density-first batch of >= ``min_requests`` requests within ``block_budget`` KV blocks.

        See the module docstring for the three cases, the borrowing rule and starvation
        (a request waiting since before ``now - starvation_s`` steers the descent). The tree is
        not modified. Returns ``None`` when the tree is empty; the batch has fewer than
        ``min_requests`` requests only when no more fit or exist. ``ValueError`` if the budget
        or ``min_requests`` is < 1.
        """
        if block_budget < 1 or min_requests < 1:
            raise ValueError("block_budget and min_requests must be >= 1")
        if not self._entries:
            return None
        starved = now - self._stamp[0][0] > starvation_s
        level, index = 0, 0
        while self._blocks[level][index] > block_budget and level < self.depth:
            level += 1
            kids = [c for c in range(4 * index, 4 * index + 4) if self._count[level][c]]
            if starved:
                index = min(kids, key=lambda c: self._stamp[level][c])
            else:
                index = min(kids, key=lambda c: -Fraction(self._count[level][c], self._blocks[level][c]))
        taken: list[str] = []
        if self._blocks[level][index] <= block_budget:
            taken.extend(self._subtree(level, index))
            budget = block_budget - self._blocks[level][index]
        else:
            budget = block_budget
            for rid in sorted(self._leaves[index], key=lambda r: (self._entries[r].since, self._entries[r].tokens, r)):
                if self._entries[rid].blocks <= budget:
                    taken.append(rid)
                    budget -= self._entries[rid].blocks
        own = len(taken)
        shift = 2 * (self.depth - level)
        self._widen(index << shift, ((index + 1) << shift) - 1, min_requests - own, budget, taken, None)
        rids = tuple(sorted(taken, key=lambda r: (self._entries[r].tokens, r)))
        return Batch(rids, sum(self._entries[r].blocks for r in rids), (level, index), len(rids) - own, starved)

    def nearest(self, tokens: int, count: int, reach_tokens: int) -> tuple[str, ...]:
        """Up to ``count`` requests whose context is within ``reach_tokens`` of ``tokens``, nearest first.

        The leaf holding ``tokens`` gives its requests by distance to ``tokens`` (ties: shorter,
        then rid); then the window widens leaf by leaf exactly as case-3 borrowing does, with no
        block budget. The tree is not modified.
        """
        if count < 1 or not self._entries:
            return ()
        leaf = min(max(tokens, 0), self.max_context_tokens) // self.leaf_tokens
        taken: list[str] = []
        own = self._leaves.get(leaf, {})
        for rid in sorted(own, key=lambda r: (abs(self._entries[r].tokens - tokens), self._entries[r].tokens, r)):
            if len(taken) < count and abs(self._entries[rid].tokens - tokens) <= reach_tokens:
                taken.append(rid)
        self._widen(leaf, leaf, count - len(taken), math.inf, taken, (tokens - reach_tokens, tokens + reach_tokens))
        return tuple(taken)

    # -- internals ----------------------------------------------------------------------------

    def _leaf_of(self, tokens: int) -> int:
        if not 1 <= tokens <= self.max_context_tokens:
            raise ValueError(f"context of {tokens} tokens is outside [1, {self.max_context_tokens}]")
        return tokens // self.leaf_tokens

    def _detach(self, rid: str, leaf: int) -> None:
        members = self._leaves[leaf]
        del members[rid]
        if not members:
            del self._leaves[leaf]

    def _add(self, leaf: int, count: int, blocks: int, top: int, bottom: int | None = None) -> None:
        """Add to the counters of ``leaf``'s ancestors at levels ``top`` .. ``bottom`` (default: the leaf)."""
        for level in range(top, (self.depth if bottom is None else bottom) + 1):
            index = leaf >> 2 * (self.depth - level)
            self._count[level][index] += count
            self._blocks[level][index] += blocks

    def _stamp_in(self, leaf: int, since: float, top: int) -> None:
        """A request waiting since ``since`` joined ``leaf``: lower the stamps up to level ``top``."""
        for level in range(self.depth, top - 1, -1):
            index = leaf >> 2 * (self.depth - level)
            if self._stamp[level][index] <= since:
                return
            self._stamp[level][index] = since

    def _stamp_out(self, leaf: int, since: float, top: int) -> None:
        """A request waiting since ``since`` left ``leaf``: recompute the stamps it may have set."""
        if self._stamp[self.depth][leaf] < since:
            return
        members = self._leaves.get(leaf, {})
        value = min((self._entries[r].since for r in members), default=math.inf)
        index = leaf
        for level in range(self.depth, top - 1, -1):
            if level < self.depth:
                index >>= 2
                value = min(self._stamp[level + 1][4 * index : 4 * index + 4])
            if self._stamp[level][index] == value:
                return
            self._stamp[level][index] = value

    def _subtree(self, level: int, index: int) -> Iterator[str]:
        stack = [(level, index)]
        while stack:
            level, index = stack.pop()
            if level == self.depth:
                yield from self._leaves[index]
            else:
                stack.extend((level + 1, c) for c in range(4 * index, 4 * index + 4) if self._count[level + 1][c])

    def _next_leaf(self, leaf: int, step: int) -> int | None:
        """The nearest non-empty leaf strictly left (``step = -1``) or right (``+1``) of ``leaf``."""
        level, index = self.depth, leaf
        while level > 0:
            sibling = index + step
            while sibling >= 0 and sibling >> 2 == index >> 2:
                if self._count[level][sibling]:
                    while level < self.depth:
                        level += 1
                        kids = [c for c in range(4 * sibling, 4 * sibling + 4) if self._count[level][c]]
                        sibling = kids[-1] if step == _LEFT else kids[0]
                    return sibling
                sibling += step
            level, index = level - 1, index >> 2
        return None

    def _widen(self, lo: int, hi: int, need: int, budget: float, taken: list[str], bounds: tuple[int, int] | None) -> None:
        """Case-3 borrowing: widen the leaf window [lo, hi], appending to ``taken`` until ``need`` more are taken.

        ``bounds``: if given, only requests with context in [bounds[0], bounds[1]] are taken.
        """
        if need <= 0:
            return
        left, right = self._next_leaf(lo, _LEFT), self._next_leaf(hi, _RIGHT)
        while need > 0 and budget >= 1:
            if bounds is not None:
                if left is not None and (left + 1) * self.leaf_tokens <= bounds[0]:
                    left = None
                if right is not None and right * self.leaf_tokens > bounds[1]:
                    right = None
            if left is None and right is None:
                return
            step = _LEFT if right is None or (left is not None and lo - left <= right - hi) else _RIGHT
            leaf = left if step == _LEFT else right
            closed = False
            # Nearest the window first: longest first from the left, shortest first from the right.
            for rid in sorted(self._leaves[leaf], key=lambda r: (step * self._entries[r].tokens, r)):
                entry = self._entries[rid]
                if need == 0:
                    break
                if bounds is not None and not bounds[0] <= entry.tokens <= bounds[1]:
                    continue
                if entry.blocks > budget:
                    closed = step == _RIGHT  # everything further right is at least as long
                    if closed:
                        break
                    continue
                taken.append(rid)
                need -= 1
                budget -= entry.blocks
            if step == _LEFT:
                lo, left = leaf, self._next_leaf(leaf, _LEFT)
            else:
                hi, right = leaf, None if closed else self._next_leaf(leaf, _RIGHT)
