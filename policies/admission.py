"""From a tokenized prompt to the classified :class:`RequestView` a scheduler receives (DESIGN §4's data path).

prefix lookup → (L, H per engine) → classify. The live gateway and the
virtual-time simulator both build their views here, so a policy sees the same
request in both.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from policies.classifier import Classifier
from policies.prefix_index import PrefixIndex, block_keys
from policies.types import RequestView


def classified_view(rid: str, prompt_ids: Sequence[int], arrival_s: float, deadline_s: float, engine_ids: Iterable[str],
                    prefix_index: PrefixIndex, classifier: Classifier, max_tokens: int | None = None,
                    reply_tokens: tuple[int, ...] = ()) -> tuple[RequestView, list[int]]:
    """The request's view, classified, and its prefix block keys (to :meth:`PrefixIndex.observe` later).

    ``cached_by_engine`` holds H per engine from ``prefix_index``; the view's
    ``cached_tokens`` is the best of them, so L = prompt − max H decides the class.
    ``max_tokens`` and ``reply_tokens`` go into the view as they are (output-length prediction).
    """
    keys = block_keys(prompt_ids, prefix_index.block_tokens)
    view = classified_view_of_keys(rid, len(prompt_ids), keys, arrival_s, deadline_s, engine_ids, prefix_index, classifier,
                                   max_tokens, reply_tokens)
    return view, keys


def classified_view_of_keys(rid: str, prompt_tokens: int, keys: Sequence[int], arrival_s: float, deadline_s: float,
                            engine_ids: Iterable[str], prefix_index: PrefixIndex, classifier: Classifier,
                            max_tokens: int | None = None, reply_tokens: tuple[int, ...] = ()) -> RequestView:
    """As :func:`classified_view`, for a prompt of ``prompt_tokens`` tokens whose block keys are already known
    (``keys``, e.g. :attr:`policies.prefix_index.BlockChain.keys` from an incrementally encoded chat)."""
    cached_by_engine = {e: prefix_index.cached_tokens(e, keys) for e in engine_ids}
    view = RequestView(rid, prompt_tokens, max(cached_by_engine.values(), default=0), arrival_s, deadline_s,
                       cached_by_engine=cached_by_engine, max_tokens=max_tokens, reply_tokens=reply_tokens)
    return dataclasses.replace(view, request_class=classifier.classify(view))
