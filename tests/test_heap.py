"""laps.heap: the start-up heap out of the garbage collector's passes, and long full passes logged."""

from __future__ import annotations

import gc
import logging

import pytest

import laps.heap
from laps.heap import freeze_heap, frozen_heap


class _Cycle:
    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def _thawed():
    """Each test starts and ends with pytest's heap not frozen, and without the logging hook."""
    gc.unfreeze()
    yield
    gc.unfreeze()
    while laps.heap._log_long_passes in gc.callbacks:
        gc.callbacks.remove(laps.heap._log_long_passes)


def test_frozen_heap_freezes_live_objects_collects_garbage_first_and_thaws():
    kept = _Cycle()
    _Cycle()  # unreachable at once: a cycle only the collector frees
    with frozen_heap() as count:
        assert count > 1000 and gc.get_freeze_count() > 1000
        assert not any(type(o) is _Cycle for o in gc.get_objects())  # kept is frozen: the collector no longer sees it
    assert gc.get_freeze_count() == 0
    assert [o for o in gc.get_objects() if type(o) is _Cycle] == [kept]  # thawed, and the garbage cycle is gone


def test_frozen_heap_blocks_nest_and_leave_a_heap_frozen_before_them_frozen():
    with frozen_heap() as outer:
        with frozen_heap() as inner:
            assert inner >= outer > 0  # the inner block freezes what came since, on top
        assert gc.get_freeze_count() > 0  # the inner block's end thaws nothing: the outer one still runs
    assert gc.get_freeze_count() == 0
    server = freeze_heap()  # a server's, for its life
    with frozen_heap() as count:
        assert count >= server > 0
    assert gc.get_freeze_count() > 0


def test_freeze_heap_installs_the_hook_that_logs_long_full_passes_once_at_debug_level(monkeypatch, caplog):
    count = freeze_heap()
    assert count > 1000 and abs(gc.get_freeze_count() - count) <= 10  # what dies after the count was taken
    assert laps.heap._log_long_passes not in gc.callbacks  # not logging at debug level: no hook
    monkeypatch.setattr(laps.heap, "LOGGED_PASS_S", 0.0)
    with caplog.at_level(logging.DEBUG, logger="laps.heap"):
        freeze_heap()
        freeze_heap()
        assert gc.callbacks.count(laps.heap._log_long_passes) == 1
        caplog.clear()
        gc.collect(1)  # not a full pass: not logged
        assert not [r for r in caplog.records if "full garbage collection" in r.message]
        gc.collect()
    assert [r.message for r in caplog.records if "full garbage collection took" in r.message]
