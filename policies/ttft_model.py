"""Predicted time to first token per engine: a small queue model of each engine's prefill backlog.

SGLang 0.5.23 runs a prefill (extend) pass whenever it can form one and decodes
only when nothing waits to be prefilled (DESIGN §5; the engine model in
``engines/sim/core.py`` does the same), so a request sent to engine e now gets
its first token after

    TTFT_e ≈ A_e(request) + P_e(request)

* ``P_e``: the request's own prefill on e, with e's own cached prefix H_e, in
  passes of at most ``chunk_tokens`` new tokens (chunked prefill); where it
  fits one chunk together with the prefills waiting on e that have not started,
  it joins their pass (SGLang's next extend pass takes every waiting request
  up to a chunk), so ``P_e`` is what its tokens add to that pass: their compute
  share of a full chunk pass, at least its pass less the fixed cost of a pass
  (:meth:`EngineQueueModel.predict_ttft_s`; measured below), unless it must
  wait for a request slot (it is admitted when one frees) or runs behind a
  prefill in flight it counts on: a pass of its own then;
* ``A_e``: the prefill work e does before it. The model keeps, per engine, the
  prefills the scheduler sent there that have no first token yet, each with its
  predicted work left, and runs them forward in time the way the engine orders
  them: first come first served, or, on ``shortest-prefill-first`` engines, the
  fewest new tokens first, chunk by chunk (a chunk in progress is never cut
  short; laps' deadline order, ``deadline_order`` in the engines' roles, is
  not modelled: see below). ``A_e`` is the work left of the prefills ordered
  before the request, plus, when it overtakes longer work there, the longest
  pass that work can
  have in progress: all of it in one pass, up to one chunk pass (the engine
  fills a pass with waiting prefills up to a chunk; where it is in that pass
  is not known here; the worst case, as short requests are judged on their
  tail TTFT); the request's own pass is then its own prefill, as laps'
  plugin makes it with short passes (a role's ``short_pass``: the pass that
  carries a short request in time holds the short threshold's tokens, not a
  whole chunk of the longer prefill); without them the engine fills that
  pass to the chunk with the longer prefill's tokens, and the model is early
  by up to a chunk pass;
* with no prefill backlog, ``A_e`` is the rest of a decode pass in progress:
  half a decode pass over e's decoding requests (those the scheduler sent there
  that have had their first token);
* admission: an engine runs at most ``max_running_requests`` requests (its
  request slots) and admits a waiting prefill only into a free one (SGLang's
  ``PrefillAdder``; ``engines/sim/core.py`` does the same). A request that finds
  its engine's slots taken, k requests ahead of it waiting for one (counting
  itself), starts no earlier than after k finishes there, at the rate requests
  have been finishing on that engine (:meth:`EngineQueueModel.slot_wait_s`; an
  exponentially decaying rate with time constant ``FINISH_RATE_WINDOW_S``, at least
  one per that time): ``A_e`` is the later of the prefill work ahead and that
  wait. Near saturation on decode-heavy traffic every engine's slots fill, and
  a prefill backlog alone sends a request to an engine where it waits for a slot.

laps' deadline order (a role's ``deadline_order``: laps' SGLang plugin,
``engines/sglang_plugin``) has the engine serve its long prefills (of at least
``scheduling.short_threshold_tokens`` new tokens) by deadline instead of
shortest first, less the longest ones wherever, by its own estimate, one would
end late (Moore's order; those follow, shortest first). The model keeps
predicting shortest first there. Modelling the order before Moore's (by
deadline only while all stayed in time; those prefills as sent while none on
the engine was past its deadline) predicted a mid-sized prompt to wait behind
every longer one sent before it, which the engine did only while it kept up,
and it cost more than it bought (README, Late requests last; seed
1: ``mixed`` at 1.2× least_load's saturation load 4.22% violations against
3.52% without it, ``chat-single`` at 2.35× 4.06% against 3.41%).

Joining a pass. SGLang's next extend pass takes every waiting request that fits a
chunk, so a short request sent where others wait unstarted costs that pass only its
tokens; one that must first wait for a request slot is admitted when a slot frees,
and runs a pass of its own. Priced as a pass of its own (as before), an engine with
a prefill waiting looked a pass's fixed cost (~5 ms) dearer than it is, and laps
sent short requests to engines that were decoding, each of them starting one more
prefill pass that held up the whole decode batch. Measured (single runs of
``bench/dominance.py``'s point configuration, loads in conversations per second or a
replay's speed-up; before → after): at steady state (``bench/steady_state.py
--points chat-single:2000 --duration 6 --out runs/ss.json``) short-class P90 TTFT 13.2 → 10.5
ms, TPOT P50 29.9 → 21.6 ms and P90 36.4 → 28.7 ms (least_load: 17.2, 15.7 and 23.0
ms); short P90 on ``hh-rlhf`` at 18,246 (0.8× least_load's saturation load) 12.4 →
10.4 ms and at 22,807 (1.0×) 21.5 → 22.5 ms (violations 0.00 → 0.00%); ``hh-rlhf`` at 27,368 (1.2×) 11.67 →
11.87% violations, seed 1 12.96 → 11.99%; ``chat-single`` at 7,700 0.03 → 0.03%.
Measured before the slot rule (which changes predictions only on engines whose
request slots are full), seed 0: short P90 on ``mixed`` at 360 12.3 → 10.5 ms,
``code-burst`` at 10× 31.1 → 28.8 ms, ``docs`` at 200 28.0 → 28.0 ms, ``azure-conv``
at 46.186× 28.7 → 29.8 ms; violations ``docs`` at 299.307 4.66 → 4.89%, ``mixed`` at
540 2.14 → 2.27%, ``azure-conv`` at 69.28× 4.38 → 3.95%, ``code-burst`` at 14× 1.13
→ 1.23%, ``mixed`` PD (6 + 2) at 336.739 / 404.086 0.19 / 2.19 → 0.12 / 2.06%; seed
1: short P90 ``mixed`` at 360 10.6 → 10.4 ms, violations ``docs`` at 299.307 4.36 →
4.57%, ``mixed`` at 540 1.72 → 1.97%, ``azure-conv`` at 69.28× 3.99 → 3.64%. Every
violation change is within one run's noise (~1 point in overload), their mean about
0.0. The backlog itself keeps each group's whole pass: with what it adds to a pass
there too, the backlog looked shorter than it runs on engines that alternate it with
decode passes of thousands of sequences, and short requests piled up where a group
waited: ``hh-rlhf`` short P90 at 18,246 was 46 ms (violations at 27,368 fell to 9.46%,
the one point where that helped). Whether a batch runs a pass of its own on an engine
where other requests decode or wait (:meth:`EngineQueueModel.holds_up_others`) is the
scheduler's tie-break among engines within one pass of the cheapest
(:mod:`policies.laps`, Passes of their own).

On ``shortest-prefill-first`` engines a request delays the longer prefills it
overtakes by what its new tokens add to their passes (``token_in_pass_s`` each, the
compute share of a token in a full chunk pass): :meth:`EngineQueueModel.displaced` counts
those that can still meet their first-token deadline (their deadline is after
now plus their own work left), for the scheduler to charge; a delay to a
prefill that misses its deadline anyway costs no deadline.

Pass times come from a :class:`PassCost`: the engine model's latency function
(:class:`engines.sim.latency.LatencyModel`) or a fitted
:class:`~policies.classifier.PrefillCostModel`; both implement it.

The model corrects itself from streamed first tokens: one that comes while the
model still had work of it left means the engine is ahead, so the prefills
the engine orders before it are taken as done too; one that comes after the
model had it done means the engine is behind by the difference, which is given
back as work left to the prefills ordered after it. Non-streamed requests
report their first token only with the whole answer, so their prefill is taken
as done when the model has done it and their report corrects nothing.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from policies.rates import DecayingRate

FINISH_RATE_WINDOW_S = 1.0
"""Time constant (seconds) of each engine's finishing rate, and one finish per this time its floor (slot_wait_s)."""

SeqShape = tuple[int, int]
"""(L new tokens, H cached tokens) of one sequence in a pass."""


class PassCost(Protocol):
    """Seconds of one forward pass (implemented by the engine model and the fitted cost model)."""

    def prefill_s(self, batch: Sequence[SeqShape]) -> float:
        """One extend pass over ``batch`` ((L_i, H_i) pairs, L_i >= 1)."""
        ...

    def decode_s(self, seqs: int, context_tokens: int) -> float:
        """One decode pass of ``seqs`` sequences (>= 1) holding ``context_tokens`` KV tokens in all."""
        ...


def isolated_prefill_s(cost: PassCost, new_tokens: int, cached_tokens: int, chunk_tokens: int) -> float:
    """Seconds to prefill one request alone: ``new_tokens`` on ``cached_tokens`` in chunks of ``chunk_tokens``.

    Chunk k extends ``min(chunk, rest)`` tokens on ``cached + k·chunk`` (SGLang's chunked prefill).
    A request with nothing new (a full cache hit) still runs one pass over its last token.
    """
    new_tokens = max(1, new_tokens)
    total, done = 0.0, 0
    while done < new_tokens:
        step = min(chunk_tokens, new_tokens - done)
        total += cost.prefill_s(((step, cached_tokens + done),))
        done += step
    return total


def _new_tokens(batch: Sequence[SeqShape]) -> int:
    """New tokens ``batch`` puts in a pass: each sequence at least one (a full cache hit still runs its last token)."""
    return sum(max(1, new) for new, _ in batch)


def batch_prefill_s(cost: PassCost, batch: Sequence[SeqShape], chunk_tokens: int) -> float:
    """Seconds to prefill ``batch`` together: one pass when it fits a chunk, else each sequence in turn (chunked)."""
    if _new_tokens(batch) <= chunk_tokens:
        return cost.prefill_s([(max(1, new), cached) for new, cached in batch])
    return sum(isolated_prefill_s(cost, new, cached, chunk_tokens) for new, cached in batch)


@dataclass(slots=True)
class _Prefill:
    engine_id: str
    key: tuple[int, int]  # service order on its engine: (new tokens, dispatch number) or (0, dispatch number)
    work_s: float  # its prefill's predicted seconds
    remaining_s: float  # of which the model has not yet seen done
    stream: bool
    chunk_s: float  # one chunk pass of it (its whole prefill when it fits one chunk)
    chunk_left_s: float = 0.0  # of the chunk in progress, when it is its engine's current entry
    deadline_s: float = math.inf  # its first-token deadline
    done_s: float | None = None  # when the model saw it done (it has no first token yet)
    behind_all: bool = False  # keyed behind everything (``dispatched``'s ``behind_all``), not where the engine runs it
    tokens: int = 0  # its group's new tokens (carried, like work_s, by the group's first request)


@dataclass(frozen=True)
class EngineTraits:
    """What the scheduler must know of the prefill engines to predict their TTFT.

    ``cost``: their pass times; ``chunk_tokens``: their ``--chunked-prefill-size``;
    ``short_first``: they all run ``--schedule-policy shortest-prefill-first``, so
    a prefill sent to a busy engine waits for the pass in progress (at most one
    chunk) and for the shorter prefills waiting there, not for the longer ones.
    """

    cost: PassCost
    chunk_tokens: int = 8192
    short_first: bool = False


class EngineQueueModel:
    """Per engine, the prefill work still ahead of a request sent now; its predicted TTFT (module doc).

    Times are seconds on the caller's clock. Memory: one entry per dispatched
    request without a first token.
    """

    def __init__(self, traits: EngineTraits) -> None:
        if traits.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {traits.chunk_tokens}")
        self.cost = traits.cost
        self.chunk_tokens = traits.chunk_tokens
        self.short_first = traits.short_first
        self.chunk_pass_s = traits.cost.prefill_s(((traits.chunk_tokens, 0),))
        self.pass_floor_s = traits.cost.prefill_s(((1, 0),))  # the shortest forward pass: the model's resolution
        # What one more new token adds to a full chunk pass (its compute share; the pass's fixed cost is paid anyway).
        self.token_in_pass_s = max(0.0, self.chunk_pass_s - self.pass_floor_s) / traits.chunk_tokens
        self._pending: dict[str, _Prefill] = {}
        self._by_engine: dict[str, dict[str, _Prefill]] = {}
        self._clock: dict[str, float] = {}  # engine -> the time its entries' remaining_s are as of
        self._current: dict[str, _Prefill] = {}  # engine -> the entry whose chunk is in progress
        self._seq = itertools.count()
        self._decoding: dict[str, int] = {}  # engine -> requests past their first token, still running
        self._decoding_rids: dict[str, str] = {}
        self._finishing: dict[str, DecayingRate] = {}  # engine -> requests finished per second there

    # -- what the scheduler asks ----------------------------------------------------------------

    def backlog_end_s(self, engine_id: str, now: float) -> float:
        """When ``engine_id``'s prefill backlog is predicted done (``now`` when it has none)."""
        return now + sum(p.remaining_s for p in self._advance(engine_id, now).values())

    def prefilling(self, engine_id: str, now: float) -> int:
        """Requests dispatched to ``engine_id`` that have no first token yet (unstreamed ones: not yet past their
        predicted first token)."""
        return len(self._advance(engine_id, now))

    def start_s(self, engine_id: str, now: float, decoding_context_tokens: int = 0, new_tokens: int | None = None) -> float:
        """When a prefill of ``new_tokens`` (None: the longest) sent to ``engine_id`` now would start: after the
        prefill work ahead of it (:meth:`_ahead_s`), or after half a decode pass when the engine only decodes."""
        entries = self._advance(engine_id, now)
        if entries:
            return now + self._ahead_s(entries, self._key(new_tokens))
        decoding = self._decoding.get(engine_id, 0)
        if decoding == 0:
            return now
        return now + 0.5 * self.cost.decode_s(decoding, decoding_context_tokens)

    def slot_wait_s(self, engine_id: str, waiting_for_slot: int, now: float) -> float:
        """Seconds from ``now`` until ``waiting_for_slot`` requests have finished on ``engine_id``, so that the last of
        that many waiting for a request slot there gets one (0 for none): at the rate requests have been finishing
        there, at least one per ``FINISH_RATE_WINDOW_S`` (module doc, admission)."""
        if waiting_for_slot <= 0:
            return 0.0
        rate = self._finishing.get(engine_id)
        return waiting_for_slot / max(rate.at(now) if rate is not None else 0.0, 1.0 / FINISH_RATE_WINDOW_S)

    def predict_ttft_s(self, engine_id: str, batch: Sequence[SeqShape], now: float, decoding_context_tokens: int = 0,
                       behind_all: bool = False, waiting_for_slot: int = 0) -> float:
        """TTFT of ``batch`` (its (L, H) on this engine) dispatched to ``engine_id`` at ``now`` (one group: on
        ``short_first`` engines it is ordered by its longest sequence's new tokens, or behind every prefill there
        with ``behind_all``: its H counts on one of them being done first). ``waiting_for_slot``: requests that would
        wait for a request slot there up to the batch's last, itself included (in flight plus the batch, less the
        engine's ``max_running_requests``; 0: a slot is free for each): it starts no earlier than
        :meth:`slot_wait_s`. Its own prefill is what it adds to the pass waiting there unstarted where it fits one
        (module doc, Joining a pass), or a pass of its own where it waits for a slot or with ``behind_all``."""
        return self._ttft_s(engine_id, batch, now, decoding_context_tokens, behind_all,
                            self.slot_wait_s(engine_id, waiting_for_slot, now), batch_prefill_s(self.cost, batch, self.chunk_tokens))

    def _ttft_s(self, engine_id: str, batch: Sequence[SeqShape], now: float, decoding_context_tokens: int,
                behind_all: bool, slot_s: float, alone_s: float) -> float:
        """:meth:`predict_ttft_s` given the wait for a request slot (``slot_s``) and the batch's prefill alone (``alone_s``)."""
        longest = None if behind_all else max((new for new, _ in batch), default=1)
        start = max(self.start_s(engine_id, now, decoding_context_tokens, longest), now + slot_s)
        # P_e (module doc): what its tokens add to the pass it joins (token_in_pass_s each, at least alone_s less the
        # pass floor), else its prefill alone
        joins = self._joins_waiting_pass(engine_id, batch, behind_all, slot_s > 0)
        own_s = max(alone_s - self.pass_floor_s, _new_tokens(batch) * self.token_in_pass_s) if joins else alone_s
        return start - now + own_s

    def _joins_waiting_pass(self, engine_id: str, batch: Sequence[SeqShape], behind_all: bool, waits_for_slot: bool) -> bool:
        """Whether ``batch`` runs in the pass of the prefills waiting unstarted on ``engine_id`` (its entries as of their
        last advance): some wait and its new tokens fit one chunk with theirs (SGLang's next extend pass takes them
        all; module doc, Joining a pass). Not where it waits for a request slot (it is admitted when one frees) or is
        keyed behind all prefill work there (``behind_all``: it counts on a prefill in flight, so runs after it)."""
        if waits_for_slot or behind_all:
            return False
        current = self._current.get(engine_id)
        waiting = [p.tokens for p in self._by_engine.get(engine_id, {}).values()
                   if p.work_s > 0 and p.remaining_s >= p.work_s and p is not current]
        return bool(waiting) and sum(waiting) + _new_tokens(batch) <= self.chunk_tokens

    def holds_up_others(self, engine_id: str, batch: Sequence[SeqShape], now: float, behind_all: bool = False,
                        waiting_for_slot: int = 0) -> bool:
        """Whether ``batch`` sent to ``engine_id`` at ``now`` would run a forward pass of its own while other requests are
        there (decoding, or prefills sent there without a first token yet): that pass holds each of them up by at
        least a pass's fixed cost (:attr:`pass_floor_s`). False where it joins the pass of the prefills waiting there
        unstarted (as :meth:`predict_ttft_s` has it: not with ``behind_all``) or where the engine has nothing else to do;
        True where it waits for a request slot (the requests in them run there, and it gets a pass of its own when one
        frees)."""
        if waiting_for_slot > 0:
            return True
        entries = self._advance(engine_id, now)
        if self._joins_waiting_pass(engine_id, batch, behind_all, False):
            return False
        return bool(entries) or self._decoding.get(engine_id, 0) > 0

    def displaced(self, engine_id: str, batch: Sequence[SeqShape], now: float, behind_all: bool = False) -> int:
        """Prefills on ``engine_id`` that ``batch`` sent now would go ahead of (so delay by its tokens) and that can
        still meet their deadline (it is after ``now`` plus their own work left): those with more new tokens, on
        ``short_first`` engines; none on FCFS ones, nor ``behind_all`` (:meth:`predict_ttft_s`)."""
        if not self.short_first or behind_all:
            return 0
        longest = max((new for new, _ in batch), default=1)
        return sum(1 for p in self._advance(engine_id, now).values()
                   if p.remaining_s > 0 and p.key[0] > longest and p.deadline_s > now + p.remaining_s)

    # -- what the scheduler tells ---------------------------------------------------------------

    def dispatched(self, engine_id: str, rids: Iterable[str], batch: Sequence[SeqShape], now: float,
                   decoding_context_tokens: int = 0, stream: bool = True, deadlines_s: Sequence[float] = (),
                   behind_all: bool = False) -> float:
        """``rids`` (shapes ``batch``) went to ``engine_id`` at ``now`` as one group; their predicted first-token time
        from the prefill work alone (no wait for a request slot: the caller knows the slots, :meth:`predict_ttft_s`),
        in the pass of the prefills waiting there where it fits one (:meth:`predict_ttft_s`), though the backlog keeps
        the group's whole pass (module doc, Joining a pass).

        ``deadlines_s``: the first-token deadlines of ``rids`` (clock seconds; none given: no deadline); the group
        counts by the earliest.

        On ``short_first`` engines the group goes ahead of the longer prefills waiting there, which
        its tokens push back (:meth:`displaced`); with ``behind_all`` behind all of them (:meth:`predict_ttft_s`), where
        the requests sent after it see it as longer work they overtake (its pass more in :meth:`_ahead_s`, and a
        prefill they displace), as they would the prefill it waits for.
        """
        # the backlog keeps the group's whole pass, not what it adds to one (module doc, Joining a pass)
        work_s = batch_prefill_s(self.cost, batch, self.chunk_tokens)
        finish = now + self._ttft_s(engine_id, batch, now, decoding_context_tokens, behind_all, 0.0, work_s)
        tokens = _new_tokens(batch)
        key = self._key(None if behind_all else max((new for new, _ in batch), default=1))
        chunk_s = work_s if tokens <= self.chunk_tokens else self.chunk_pass_s
        entries = self._by_engine.setdefault(engine_id, {})
        deadline_s = min(deadlines_s, default=math.inf)
        for i, rid in enumerate(rids):  # the group's work is carried by its first request
            p = _Prefill(engine_id, key, work_s if i == 0 else 0.0, work_s if i == 0 else 0.0, stream, chunk_s, deadline_s=deadline_s,
                         behind_all=behind_all, tokens=tokens if i == 0 else 0)
            self._pending[rid] = p
            entries[rid] = p
        return finish

    def first_token(self, rid: str, now: float) -> None:
        """``rid``'s first token came at ``now``: it decodes from now on; correct the engine's backlog.

        Early (the model still had work of it left): what the engine orders before it is done too (not for an entry
        keyed ``behind_all``: its key says nothing of what ran before it).
        Late (the model had it done at ``done_s``): the engine is ``now − done_s`` behind the model,
        which gives that much work back to the prefills ordered after it.
        """
        p = self._pending.get(rid)
        if p is None:
            return
        entries = self._advance(p.engine_id, now)
        if rid not in entries:  # unstreamed, and already taken as prefilled by the model: it decodes already
            return
        del self._pending[rid]
        del entries[rid]
        if self._current.get(p.engine_id) is p:
            del self._current[p.engine_id]
        self._decoding[p.engine_id] = self._decoding.get(p.engine_id, 0) + 1
        self._decoding_rids[rid] = p.engine_id
        if not p.stream:
            return
        if p.remaining_s > 0 and not p.behind_all:
            for q in entries.values():
                if q.key < p.key and q.remaining_s > 0:
                    q.remaining_s, q.done_s = 0.0, now
        elif p.done_s is not None and now > p.done_s:
            late_s = now - p.done_s
            for q in sorted(entries.values(), key=lambda q: q.key):
                if q.key > p.key and late_s > 0:
                    back = min(late_s, q.work_s - q.remaining_s)
                    q.remaining_s += back
                    q.done_s = None
                    late_s -= back

    def finished(self, rid: str, now: float) -> None:
        """``rid`` ended at ``now`` (answered, failed, withdrawn): it no longer counts on its engine, and its request
        slot there is free (the engine's finishing rate, :meth:`slot_wait_s`)."""
        p = self._pending.pop(rid, None)
        engine_id = self._decoding_rids.pop(rid, None)
        if p is not None:
            del self._by_engine[p.engine_id][rid]
            if self._current.get(p.engine_id) is p:
                del self._current[p.engine_id]
            engine_id = p.engine_id
        elif engine_id is not None:
            self._decoding[engine_id] -= 1
        if engine_id is not None:
            self._finishing.setdefault(engine_id, DecayingRate(FINISH_RATE_WINDOW_S)).add(now, 1.0)

    def decoding(self, engine_id: str) -> int:
        """Requests on ``engine_id`` past their first token and not yet finished."""
        return self._decoding.get(engine_id, 0)

    # -- the engine's progress ------------------------------------------------------------------

    def _key(self, new_tokens: int | None) -> tuple[int, int]:
        """Where a prefill of ``new_tokens`` sent now goes in its engine's order (None: behind everything)."""
        seq = next(self._seq)
        if not self.short_first:
            return 0, seq
        return (new_tokens if new_tokens is not None else 1 << 62), seq

    def _ahead_s(self, entries: dict[str, _Prefill], key: tuple[int, int]) -> float:
        """Prefill seconds ahead of a prefill of order ``key``: the work ordered before it, and when it
        overtakes longer work, the longest pass that work can have in progress. The engine fills a pass
        with waiting prefills up to a chunk, so that is all of the longer work in one pass (each group's
        pass, less the fixed cost of a pass for every group but one), at most one chunk pass, and at least
        the longest group's pass (where the engine is in that pass is not known here: the worst case,
        as a short request's tail TTFT is what it is judged on)."""
        ahead = sum(p.remaining_s for p in entries.values() if p.key < key)
        # one past its predicted end may still be running: every longer entry counts, whatever its remaining_s
        longer = [p for p in entries.values() if p.key > key]
        if longer:
            groups = [p for p in longer if p.work_s > 0]  # a group's work is carried by its first request
            together = sum(p.chunk_s for p in groups) - max(0, len(groups) - 1) * self.pass_floor_s
            ahead += max(max(p.chunk_s for p in longer), min(self.chunk_pass_s, together))
        return ahead

    def _advance(self, engine_id: str, now: float) -> dict[str, _Prefill]:
        """Bring ``engine_id``'s entries to ``now``: the time since the last look spent on them chunk by chunk,
        each next chunk from the first entry in order; unstreamed entries seen done count as decoding. Its entries."""
        entries = self._by_engine.get(engine_id)
        t = self._clock.get(engine_id, now)
        self._clock[engine_id] = max(now, t)
        if not entries:
            self._current.pop(engine_id, None)
            return {}
        while t < now:
            current = self._current.get(engine_id)
            if current is None or current.remaining_s <= 0 or current.chunk_left_s <= 0:
                live = [p for p in entries.values() if p.remaining_s > 0]
                if not live:
                    self._current.pop(engine_id, None)
                    break
                current = min(live, key=lambda p: p.key)
                current.chunk_left_s = min(current.remaining_s, current.chunk_s)
                self._current[engine_id] = current
            step = min(current.chunk_left_s, now - t)
            current.remaining_s -= step
            current.chunk_left_s -= step
            t += step
            if current.remaining_s <= 1e-12:
                current.remaining_s, current.done_s = 0.0, t
        done = [rid for rid, p in entries.items() if not p.stream and p.remaining_s <= 0]
        for rid in done:  # taken as prefilled at its predicted finish: it decodes now
            del entries[rid]
            del self._pending[rid]
            self._decoding[engine_id] = self._decoding.get(engine_id, 0) + 1
            self._decoding_rids[rid] = engine_id
        return entries
