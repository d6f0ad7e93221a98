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
                    prefix_index: PrefixIndex, classifier: Classifier) -> tuple[RequestView, list[int]]:
    """The request's view, classified, and its prefix block keys (to :meth:`PrefixIndex.observe` later).

    ``cached_by_engine`` holds H per engine from ``prefix_index``; the view's
    ``cached_tokens`` is the best of them, so L = prompt − max H decides the class.
    """
    keys = block_keys(prompt_ids, prefix_index.block_tokens)
    cached_by_engine = {e: prefix_index.cached_tokens(e, keys) for e in engine_ids}
    view = RequestView(rid, len(prompt_ids), max(cached_by_engine.values(), default=0), arrival_s, deadline_s,
                       cached_by_engine=cached_by_engine)
    return dataclasses.replace(view, request_class=classifier.classify(view)), keys
