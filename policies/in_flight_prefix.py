"""Prefixes that engines are prefilling now: what each engine will hold in its prefix cache once they are done.

An engine's prefix cache (:mod:`policies.exact_prefix`, from its KV events) shows only the chunks of a long prefill
computed so far. A request that shares a long prefix with a prefill still in flight (the questions about a document
whose first request is being prefilled) would find that prefix cached on that engine by the time it runs there, and
nowhere else. :class:`InFlightPrefills` keeps the prompt block keys of every dispatched request from its dispatch to
its first token (its prefill is done: from then on its engine's cache, or the estimate, has it) or its end, per
engine, so a view can say, per engine, how many leading tokens of a new prompt a prefill in flight there shares:
``RequestView.in_flight_by_engine``. :mod:`policies.laps` counts it where the request goes and for what it is
predicted to cost there; the class and the deadline stay on what is cached now (crediting in-flight prefixes there
as well made the prefix-heavy workload worse; the measurements are in :mod:`policies.laps`' docstring).
:class:`policies.exact_prefix.PrefixCaches` holds one, which the runner (the gateway's dispatcher, the simulator)
keeps up to date.

Block keys are chained (:func:`policies.prefix_index.block_keys`), so a key present for an engine means the whole
prefix up to it is: the shared prefix is found by binary search over the new prompt's keys, O(log blocks) dict
look-ups (:func:`~policies.prefix_index.leading_keys_in`); starting and ending a prefill is O(its blocks).
"""

from __future__ import annotations

from typing import Iterable, Sequence

from policies.prefix_index import BlockChain, leading_keys_in


class InFlightPrefills:
    """Block keys of the prompts being prefilled, per engine (module doc).

    Args:
        block_tokens: tokens per chain block (``scheduling.prefix_block_tokens``).
    """

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._flights: dict[str, tuple[str, Sequence[int]]] = {}  # rid -> (engine, its prompt's block keys)
        self._keys: dict[str, dict[int, int]] = {}  # engine -> block key -> prefills in flight holding it

    def __len__(self) -> int:
        """Prefills in flight."""
        return len(self._flights)

    def start(self, rid: str, engine_id: str, keys: Sequence[int]) -> None:
        """``rid``, whose prompt has the block ``keys``, was dispatched to ``engine_id`` (again: its earlier start is
        ended first)."""
        self.end(rid)
        self._flights[rid] = (engine_id, keys)
        counts = self._keys.setdefault(engine_id, {})
        for key in keys:
            counts[key] = counts.get(key, 0) + 1

    def end(self, rid: str) -> None:
        """``rid``'s prefill is over (first token, failure, abort); unknown ``rid``s are ignored."""
        flight = self._flights.pop(rid, None)
        if flight is None:
            return
        engine_id, keys = flight
        counts = self._keys[engine_id]
        for key in keys:
            left = counts[key] - 1
            if left:
                counts[key] = left
            else:
                del counts[key]

    def forget_engine(self, engine_id: str) -> None:
        """``engine_id`` restarted or left service: its prefills in flight will not be cached there."""
        for rid in [rid for rid, (engine, _) in self._flights.items() if engine == engine_id]:
            self.end(rid)

    def shared_tokens(self, engine_id: str, chain: BlockChain) -> int:
        """Leading tokens of the prompt ``chain`` that a prefill in flight on ``engine_id`` computes, in whole blocks and
        at most ``chain.tokens - 1`` (as a prefix hit: the engine computes the last token itself)."""
        counts = self._keys.get(engine_id)
        if not counts:
            return 0
        return min(leading_keys_in(chain.keys, counts) * self.block_tokens, max(chain.tokens - 1, 0))

    def by_engine(self, chain: BlockChain, engine_ids: Iterable[str]) -> dict[str, int]:
        """:meth:`shared_tokens` of ``chain`` on each of ``engine_ids`` where it is not 0."""
        if not self._flights:
            return {}
        shared = {e: self.shared_tokens(e, chain) for e in engine_ids}
        return {e: tokens for e, tokens in shared.items() if tokens}
