"""Keep the garbage collector's full passes off the request path.

A serving process builds most of what the collector tracks at start-up and keeps it for life: the imported modules'
functions, classes and dicts (~90k tracked objects in the gateway, ~50k in a simulated engine, ~130k in ``laps
loadgen`` with its workload; the tokenizer's vocabulary is a dict of bytes to ints, which the collector does not
track). CPython's full (generation-2) collection walks every tracked object and stops the process meanwhile.
Running ``config.yaml`` at 3 conversations/s (``tests/test_live_vs_virtual.py``'s load; a ``gc.callbacks`` probe
in each process, three runs on 2026-12-04) such passes took 13–82 ms in the gateway, 12–23 ms in each simulated
engine and 40–64 ms in the load generator; one of 82 ms in the gateway delayed a long prefill's first token from
75 to 138 ms. Which request a pass hits moves with any change in what the processes allocate, so the live P90 of
that test moved with it.

:func:`freeze_heap` moves what start-up built into the permanent generation, which later collections skip
(``gc.freeze``, Python's ``gc`` documentation): in three runs with it no pass over 3 ms came during the 24 s of
load. It covers the start-up heap only: what a long-running gateway accumulates afterwards (conversation
histories, caches) is scanned as before, and objects frozen and later dropped in a reference cycle (a restarted
engine's client, say) are never freed. With ``--log-level debug`` every full pass of 5 ms or more after the freeze
is logged (:data:`LOGGED_PASS_S`).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterator

log = logging.getLogger(__name__)


LOGGED_PASS_S = 0.005  # a full collection at least this long after the freeze is logged (debug)
_frozen_depth = 0  # frozen_heap blocks open
_thaw_at_exit = False  # whether the outermost one froze a heap that was not frozen before
_pass_started_s = 0.0  # perf_counter at the start of the full collection in progress


def freeze_heap() -> int:
    """Collect what start-up left behind, then freeze every object still tracked out of later collections, and, when
    this module logs at debug level, log full collections of :data:`LOGGED_PASS_S` or more from then on (the hook
    is installed once per process, and stays; so a test's thawed heap is logged too); returns how many objects are
    frozen. Call it once a process is ready to serve; objects frozen and later dropped are freed by reference
    counting, but never by the collector (a reference cycle among them stays)."""
    gc.collect()
    gc.freeze()
    if log.isEnabledFor(logging.DEBUG) and _log_long_passes not in gc.callbacks:
        gc.callbacks.append(_log_long_passes)
    frozen = gc.get_freeze_count()
    log.debug("start-up heap frozen: %d objects out of the garbage collector's passes", frozen)
    return frozen


@contextlib.contextmanager
def frozen_heap() -> Iterator[int]:
    """:func:`freeze_heap` for the ``with`` block only: a run that measures, in a process that goes on after it
    (:func:`loadgen.runner.run_loadgen`, which tests call in-process); yields the count frozen. The outermost block
    thaws everything at exit unless the heap was frozen before it (a server's :func:`freeze_heap`), so blocks nest and
    overlap (concurrent runs) safely; a server frozen in the same process while a block is open is thawed with it."""
    global _frozen_depth, _thaw_at_exit
    if _frozen_depth == 0:
        _thaw_at_exit = gc.get_freeze_count() == 0
    _frozen_depth += 1
    try:
        yield freeze_heap()
    finally:
        _frozen_depth -= 1
        if _frozen_depth == 0 and _thaw_at_exit:
            gc.unfreeze()


def _log_long_passes(phase: str, info: dict) -> None:
    """``gc.callbacks`` hook: log a generation-2 collection that took :data:`LOGGED_PASS_S` or more."""
    global _pass_started_s
    if info["generation"] != 2:
        return
    if phase == "start":
        _pass_started_s = time.perf_counter()
    elif (took_s := time.perf_counter() - _pass_started_s) >= LOGGED_PASS_S:
        log.debug("full garbage collection took %.1f ms (%d objects collected)", 1e3 * took_s, info["collected"])
