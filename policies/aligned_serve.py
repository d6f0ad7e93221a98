"""AlignedServe batch-level scheduling (Bai et al., SIGMOD 2026; DESIGN §3): refill the running batch
from a candidate request buffer, then switch in the next candidate batch; on KV shortage evict the
longest request, the old batch's longest while a switch is under way.

The paper's body was not available to us; this is our reading of DESIGN §3 and issue 8, with
every open choice stated. Requests here are in-flight decodes (already prefilled); each sits in
exactly one place:

* waiting: a :class:`~policies.aligned_quadtree.QuadTree` by context length (KV in CPU memory);
* the candidate batch buffer: up to ``batch_buffer_size`` batches from
  :meth:`QuadTree.search` (B_max = ``block_budget``, K_min = ``min_batch``), first in first out;
* the candidate request buffer: up to ``request_buffer_size`` waiting requests nearest the
  running batch's length band (:meth:`QuadTree.nearest`, within ``refill_reach_tokens``);
  the band is the median context of the batch last switched in, plus one per iteration;
* running: the GPU batch, as two trees, the current batch and the old one (survivors of every
  batch switched out, still decoding). Their contexts grow by one token per iteration.

``decide(now)`` does, in order:

1. after a completion, or when nothing runs: refill from the request buffer, in buffer order,
   each request whose blocks fit in ``block_budget`` minus the running blocks; then, if fewer
   than ``min_batch`` requests run and a candidate batch exists, switch: the current batch
   becomes the old one (its members keep running), the next candidate batch becomes current,
   and the request buffer goes back to waiting (it was chosen for the old band);
2. while the running blocks exceed ``block_budget``: evict the longest request of the old
   batch, or of the current batch once the old one is empty (ties: the largest rid); evicted
   requests wait again from ``now``;
3. top up the request buffer, then the batch buffer.

Switching and refilling happen only after completions (or when idle), never after evictions,
so memory pressure cannot make the scheduler swap the same requests in and out on every call.
Starvation: a request that has waited longer than ``starvation_tokens * tpot_slo_ms`` (it is
that many tokens behind a stream paced at the TPOT SLO) steers the next batch search to itself
(see :mod:`policies.aligned_quadtree`). Pure: no I/O, no clock but ``now``, no randomness.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator

from policies.aligned_quadtree import QuadTree

_Waiting = tuple[str, int, float]  # rid, context tokens, waiting since


class AlignedServeConfig(BaseModel):
    """Parameters of :class:`AlignedServeScheduler` (lengths in tokens, budgets in KV blocks)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    block_budget: int = Field(4096, ge=1, description="B_max: KV blocks the running batch may hold")
    min_batch: int = Field(16, ge=1, description="K_min: fewest requests a searched batch should have")
    block_tokens: int = Field(16, ge=1, description="tokens per KV block (the engine's page size)")
    leaf_tokens: int = Field(64, ge=1, description="width of a quad-tree leaf's context-length range")
    max_context_tokens: int = Field(32768, ge=1)
    tpot_slo_ms: float = Field(100.0, gt=0, description="per-token latency objective")
    starvation_tokens: float = Field(50.0, gt=0, description="tokens behind the TPOT SLO at which a waiting request starves")
    batch_buffer_size: int = Field(2, ge=1)
    request_buffer_size: int = Field(16, ge=0)
    refill_reach_tokens: int = Field(512, ge=0, description="farthest a refill's context may be from the running band")

    @model_validator(mode="after")
    def _check(self) -> "AlignedServeConfig":
        if self.max_context_tokens > self.block_budget * self.block_tokens:
            raise ValueError("max_context_tokens must fit in block_budget * block_tokens: a longer request could never run")
        return self

    @property
    def starvation_s(self) -> float:
        """Waiting time after which a request starves: ``starvation_tokens * tpot_slo_ms / 1000`` seconds."""
        return self.starvation_tokens * self.tpot_slo_ms / 1e3


@dataclass(frozen=True, slots=True)
class BatchDecision:
    """Net changes to the running batch: ``admit`` to load onto the GPU, ``evict`` to move off it
    (back to waiting); ``switched``: the next candidate batch became the current one."""

    admit: tuple[str, ...] = ()
    evict: tuple[str, ...] = ()
    switched: bool = False


class AlignedServeScheduler:
    """AlignedServe batch-level scheduler for one decode engine (see the module docstring).

    Call order: ``submit`` when a prefilled request is ready to decode; ``on_iteration`` after
    every decode step of the running batch; ``on_complete`` when a request finishes or is
    cancelled; ``decide`` after any of them, carrying out the returned :class:`BatchDecision`.
    """

    NAME = "aligned-serve"

    def __init__(self, config: AlignedServeConfig | None = None) -> None:
        self.config = c = config or AlignedServeConfig()
        self._waiting, self._old, self._current = (QuadTree(c.max_context_tokens, c.leaf_tokens, c.block_tokens) for _ in range(3))
        self._requests: dict[str, tuple[int, float]] = {}
        self._batches: deque[tuple[_Waiting, ...]] = deque()
        self._band: int | None = None
        self._completed = False

    @property
    def running(self) -> tuple[str, ...]:
        """Rids on the GPU: the old batch's survivors, then the current batch."""
        return (*self._old, *self._current)

    @property
    def running_blocks(self) -> int:
        """KV blocks the running requests hold now."""
        return self._old.total_blocks + self._current.total_blocks

    # -- events -------------------------------------------------------------------------------

    def submit(self, rid: str, context_tokens: int, now: float) -> None:
        """A prefilled request of ``context_tokens`` tokens waits to decode from ``now``.

        Raises ``ValueError`` for a rid already known or a length outside [1, max_context_tokens].
        """
        if self._holds(rid):
            raise ValueError(f"request {rid!r} is already scheduled")
        self._waiting.insert(rid, context_tokens, now)

    def on_iteration(self, now: float) -> None:
        """One decode step ran: every running context is one token longer.

        ``ValueError`` if a context would pass ``max_context_tokens`` (the runner must finish it first).
        """
        for tree in (self._old, self._current):
            for rid in tree:
                tree.grow(rid)
        if self._band is not None:
            self._band += 1

    def on_complete(self, rid: str, now: float) -> None:
        """``rid`` finished or was cancelled, wherever it is; unknown rids are ignored."""
        for tree in (self._old, self._current):
            if rid in tree:
                tree.remove(rid)
                self._completed = True
                return
        if rid in self._waiting:
            self._waiting.remove(rid)
            return
        if self._requests.pop(rid, None) is not None:
            return
        for i, batch in enumerate(self._batches):
            rest = tuple(w for w in batch if w[0] != rid)
            if len(rest) < len(batch):
                if rest:
                    self._batches[i] = rest
                else:
                    del self._batches[i]
                return

    # -- decisions ----------------------------------------------------------------------------

    def decide(self, now: float) -> BatchDecision:
        """Refill or switch (after completions), evict on shortage, top up the buffers; see the module docstring."""
        c = self.config
        admitted: list[str] = []
        evicted: list[str] = []
        switched = False
        if self._completed or not self.running:
            self._completed = False
            for rid, (tokens, since) in list(self._requests.items()):
                if self._current.blocks_for(tokens) <= c.block_budget - self.running_blocks:
                    del self._requests[rid]
                    self._current.insert(rid, tokens, since)
                    admitted.append(rid)
            if len(self.running) < c.min_batch:
                self._fill_batches(now)
                if self._batches:
                    self._switch(admitted)
                    switched = True
        while self.running_blocks > c.block_budget:
            tree = self._old if len(self._old) else self._current
            rid = tree.longest()
            self._waiting.insert(rid, tree.remove(rid), now)
            evicted.append(rid)
        self._fill_requests()
        self._fill_batches(now)
        # A request refilled and then evicted as part of the old batch in one call never moved.
        moved_back = set(admitted) & set(evicted)
        admit = tuple(r for r in admitted if r not in moved_back)
        return BatchDecision(admit, tuple(r for r in evicted if r not in moved_back), switched)

    def _switch(self, admitted: list[str]) -> None:
        for rid in self._current:
            since = self._current.since(rid)
            self._old.insert(rid, self._current.remove(rid), since)
        batch = self._batches.popleft()
        for rid, tokens, since in batch:
            self._current.insert(rid, tokens, since)
            admitted.append(rid)
        for rid, (tokens, since) in self._requests.items():
            self._waiting.insert(rid, tokens, since)
        self._requests.clear()
        self._band = sorted(tokens for _, tokens, _ in batch)[len(batch) // 2]

    def _fill_requests(self) -> None:
        need = self.config.request_buffer_size - len(self._requests)
        if self._band is None or not len(self._current) or need <= 0:
            return
        for rid in self._waiting.nearest(self._band, need, self.config.refill_reach_tokens):
            since = self._waiting.since(rid)
            self._requests[rid] = (self._waiting.remove(rid), since)

    def _fill_batches(self, now: float) -> None:
        c = self.config
        while len(self._batches) < c.batch_buffer_size and len(self._waiting):
            batch = self._waiting.search(c.block_budget, c.min_batch, now, c.starvation_s)
            self._batches.append(tuple((rid, self._waiting.tokens(rid), self._waiting.since(rid)) for rid in batch.rids))
            for rid in batch.rids:
                self._waiting.remove(rid)

    def _holds(self, rid: str) -> bool:
        return (rid in self._old or rid in self._current or rid in self._waiting or rid in self._requests
                or any(w[0] == rid for batch in self._batches for w in batch))
