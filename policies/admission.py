"""From a tokenized prompt to the classified :class:`RequestView` a scheduler receives (DESIGN §4's data path).

prefix lookup → (L, H per engine) → classify. The live gateway and the
virtual-time simulator both build their views here, so a policy sees the same
request in both.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from policies.classifier import Classifier
from policies.exact_prefix import PrefixCaches
from policies.prefix_index import BlockChain
from policies.types import RequestView


def classified_view(rid: str, prompt_ids: Sequence[int], arrival_s: float, deadline_s: float, engine_ids: Iterable[str],
                    prefix_caches: PrefixCaches, classifier: Classifier, max_tokens: int | None = None,
                    reply_tokens: tuple[int, ...] = ()) -> tuple[RequestView, BlockChain]:
    """The request's view, classified, and its prompt's chain (whose keys go to :meth:`PrefixCaches.observe` later).

    ``cached_by_engine`` holds H per engine from ``prefix_caches``; the view's
    ``cached_tokens`` is the best of them, so L = prompt − max H decides the class;
    ``in_flight_by_engine`` is what ``prefix_caches.in_flight`` shares with the prompt.
    ``max_tokens`` and ``reply_tokens`` go into the view as they are (output-length prediction).
    """
    chain = BlockChain(prefix_caches.block_tokens).extend(prompt_ids)
    view = classified_view_of_chain(rid, chain, arrival_s, deadline_s, engine_ids, prefix_caches, classifier,
                                    max_tokens, reply_tokens)
    return view, chain


def classified_view_of_chain(rid: str, chain: BlockChain, arrival_s: float, deadline_s: float,
                             engine_ids: Iterable[str], prefix_caches: PrefixCaches, classifier: Classifier,
                             max_tokens: int | None = None, reply_tokens: tuple[int, ...] = ()) -> RequestView:
    """As :func:`classified_view`, for a prompt already encoded as ``chain`` (e.g. incrementally, from a chat)."""
    engine_ids = tuple(engine_ids)
    cached_by_engine = {e: prefix_caches.cached_tokens(e, chain) for e in engine_ids}
    view = RequestView(rid, chain.tokens, max(cached_by_engine.values(), default=0), arrival_s, deadline_s,
                       cached_by_engine=cached_by_engine, in_flight_by_engine=prefix_caches.in_flight.by_engine(chain, engine_ids),
                       max_tokens=max_tokens, reply_tokens=reply_tokens)
    return dataclasses.replace(view, request_class=classifier.classify(view))
