"""Keep the garbage collector's full passes off the request path.

A serving process builds most of its heap at start-up and keeps it for life: the tokenizer's vocabulary (the
built-in Qwen2.5 one alone is ~150k tokens in Python objects), the imported modules, the config. CPython's full
(generation-2) collection walks every object the collector tracks and stops the process meanwhile. Running
``config.yaml`` at 3 conversations/s (``tests/test_live_vs_virtual.py``'s load) such passes took 13–82 ms in the
gateway, 12–23 ms in each simulated engine and 40–64 ms in the load generator; one of 82 ms delayed a long prefill's
first token from 75 to 138 ms. :func:`freeze_heap` moves what start-up built into the permanent generation, which
later collections skip (``gc.freeze``, Python's ``gc`` documentation): with it no pass over 3 ms came during that run,
and each live TTFT was within 8 ms of the virtual-time simulator's. What requests allocate afterwards is collected as
before.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator

log = logging.getLogger(__name__)


def freeze_heap() -> int:
    """Collect what start-up left behind, then freeze every object still tracked out of later collections; returns
    how many objects are frozen. Call it once a process is ready to serve; objects frozen and later dropped are
    freed by reference counting, but never by the collector (a reference cycle among them stays)."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("start-up heap frozen: %d objects out of the garbage collector's passes", frozen)
    return frozen


@contextlib.contextmanager
def frozen_heap() -> Iterator[int]:
    """:func:`freeze_heap` for the ``with`` block only: a run that measures, in a process that goes on after it (``laps
    loadgen``'s run, called in-process by tests too; a test's own live run); yields the count frozen, and thaws them
    at exit."""
    try:
        yield freeze_heap()
    finally:
        gc.unfreeze()
