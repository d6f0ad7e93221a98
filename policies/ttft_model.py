"""Predicted time to first token per engine: a small queue model of each engine's prefill backlog.

SGLang 0.5.23 runs a prefill (extend) pass whenever it can form one and decodes
only when nothing waits to be prefilled (DESIGN §5; the engine model in
``engines/sim/core.py`` does the same), so a request sent to engine e now gets
its first token after

    TTFT_e ≈ max(now + r_e, B_e) − now + P_e(request)

* ``B_e``: when e's prefill backlog is done: the predicted finish of the last
  prefill the scheduler sent there that has no first token yet (FCFS order: the
  conservative reading; under ``shortest-prefill-first`` a short request may
  overtake, which only makes the prediction pessimistic for engines that hold
  long work, the ones short requests should avoid anyway);
* ``r_e``: the rest of a decode pass in progress when e has no prefill backlog:
  half a decode pass over its decoding requests (those the scheduler sent there
  that have had their first token);
* ``P_e``: the request's own prefill on e, with e's own cached prefix H_e, in
  passes of at most ``chunk_tokens`` new tokens (chunked prefill).

Pass times come from a :class:`PassCost`: the engine model's latency function
(:class:`engines.sim.latency.LatencyModel`) or a fitted
:class:`~policies.classifier.PrefillCostModel`; both implement it.

The model corrects itself from first tokens: when a streamed request's first
token comes later than predicted, every prefill queued behind it on that engine
is pushed back by the same error; when it comes early, the backlog ends at the
latest prediction still pending. Non-streamed requests report their first token
only with the whole answer, so their prefill is taken as done at its predicted
finish and their report corrects nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

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


def batch_prefill_s(cost: PassCost, batch: Sequence[SeqShape], chunk_tokens: int) -> float:
    """Seconds to prefill ``batch`` together: one pass when it fits a chunk, else each sequence in turn (chunked)."""
    if sum(max(1, new) for new, _ in batch) <= chunk_tokens:
        return cost.prefill_s([(max(1, new), cached) for new, cached in batch])
    return sum(isolated_prefill_s(cost, new, cached, chunk_tokens) for new, cached in batch)


@dataclass(slots=True)
class _Prefill:
    engine_id: str
    finish_s: float  # predicted first token
    stream: bool


@dataclass(frozen=True)
class EngineTraits:
    """What the scheduler must know of the prefill engines to predict their TTFT.

    ``cost``: their pass times; ``chunk_tokens``: their ``--chunked-prefill-size``;
    ``short_first``: they all run ``--schedule-policy shortest-prefill-first``, so
    a short prefill sent to an engine busy with a long one waits for the pass in
    progress (at most one chunk), not for the whole long prefill.
    """

    cost: PassCost
    chunk_tokens: int = 8192
    short_first: bool = False


class EngineQueueModel:
    """Per engine, when its prefill backlog will be done; the predicted TTFT of a request sent now (module doc).

    Times are seconds on the caller's clock. Memory: one entry per dispatched
    request without a first token.
    """

    def __init__(self, traits: EngineTraits) -> None:
        if traits.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {traits.chunk_tokens}")
        self.cost = traits.cost
        self.chunk_tokens = traits.chunk_tokens
        self.short_first = traits.short_first
        self._chunk_pass_s = traits.cost.prefill_s(((traits.chunk_tokens, 0),))
        self._pending: dict[str, _Prefill] = {}
        self._by_engine: dict[str, dict[str, _Prefill]] = {}
        self._decoding: dict[str, int] = {}  # engine -> requests past their first token, still running
        self._decoding_rids: dict[str, str] = {}

    # -- what the scheduler asks ----------------------------------------------------------------

    def backlog_end_s(self, engine_id: str, now: float) -> float:
        """When ``engine_id``'s prefill backlog is predicted done (``now`` when it has none)."""
        entries = self._by_engine.get(engine_id)
        if not entries:
            return now
        self._expire_unstreamed(engine_id, now)
        return max((p.finish_s for p in entries.values()), default=now)

    def prefilling(self, engine_id: str, now: float) -> int:
        """Requests dispatched to ``engine_id`` that have no first token yet (unstreamed ones: not yet past their
        predicted first token)."""
        if engine_id not in self._by_engine:
            return 0
        self._expire_unstreamed(engine_id, now)
        return len(self._by_engine[engine_id])

    def start_s(self, engine_id: str, now: float, decoding_context_tokens: int = 0) -> float:
        """When a prefill sent to ``engine_id`` now would start: after the backlog, or after half a decode pass."""
        backlog_end = self.backlog_end_s(engine_id, now)
        if self.prefilling(engine_id, now):
            return max(now, backlog_end)  # past its predicted end, a late backlog is still running
        decoding = self._decoding.get(engine_id, 0)
        if decoding == 0:
            return now
        return now + 0.5 * self.cost.decode_s(decoding, decoding_context_tokens)

    def predict_ttft_s(self, engine_id: str, batch: Sequence[SeqShape], now: float, decoding_context_tokens: int = 0,
                       short: bool = False) -> float:
        """TTFT of ``batch`` (its (L, H) on this engine) dispatched to ``engine_id`` at ``now``.

        ``short``: a short batch, which on ``short_first`` engines starts after at most the pass in
        progress (one chunk: ``now`` + the pass time of ``chunk_tokens`` new tokens).
        """
        start = self.start_s(engine_id, now, decoding_context_tokens)
        if short and self.short_first:
            start = min(start, now + self._chunk_pass_s)
        return start - now + batch_prefill_s(self.cost, batch, self.chunk_tokens)

    # -- what the scheduler tells ---------------------------------------------------------------

    def dispatched(self, engine_id: str, rids: Iterable[str], batch: Sequence[SeqShape], now: float,
                   decoding_context_tokens: int = 0, stream: bool = True, short: bool = False) -> float:
        """``rids`` (shapes ``batch``) went to ``engine_id`` at ``now`` as one group; their predicted first-token time.

        A short group on ``short_first`` engines overtakes the backlog (:meth:`predict_ttft_s`) and
        pushes what it overtakes back by its own prefill time.
        """
        finish = now + self.predict_ttft_s(engine_id, batch, now, decoding_context_tokens, short)
        entries = self._by_engine.setdefault(engine_id, {})
        if short and self.short_first:
            own_s = batch_prefill_s(self.cost, batch, self.chunk_tokens)
            for q in entries.values():
                if q.finish_s > finish - own_s:
                    q.finish_s += own_s
        for rid in rids:
            p = _Prefill(engine_id, finish, stream)
            self._pending[rid] = p
            entries[rid] = p
        return finish

    def first_token(self, rid: str, now: float) -> None:
        """``rid``'s first token came at ``now``: it decodes from now on; correct the engine's backlog (module doc)."""
        p = self._pending.pop(rid, None)
        if p is None:
            return
        entries = self._by_engine[p.engine_id]
        del entries[rid]
        self._decoding[p.engine_id] = self._decoding.get(p.engine_id, 0) + 1
        self._decoding_rids[rid] = p.engine_id
        if not p.stream:
            return
        late_s = now - p.finish_s
        if late_s > 0:
            for q in entries.values():
                if q.finish_s >= p.finish_s:
                    q.finish_s += late_s

    def finished(self, rid: str) -> None:
        """``rid`` ended (answered, failed, withdrawn): it no longer counts on its engine."""
        p = self._pending.pop(rid, None)
        if p is not None:
            del self._by_engine[p.engine_id][rid]
        engine_id = self._decoding_rids.pop(rid, None)
        if engine_id is not None:
            self._decoding[engine_id] -= 1

    def decoding(self, engine_id: str) -> int:
        """Requests on ``engine_id`` past their first token and not yet finished."""
        return self._decoding.get(engine_id, 0)

    def _expire_unstreamed(self, engine_id: str, now: float) -> None:
        entries = self._by_engine[engine_id]
        done = [rid for rid, p in entries.items() if not p.stream and p.finish_s <= now]
        for rid in done:  # taken as prefilled at its predicted finish: it decodes now
            del entries[rid]
            del self._pending[rid]
            self._decoding[engine_id] = self._decoding.get(engine_id, 0) + 1
            self._decoding_rids[rid] = engine_id
