"""laps.heap: the start-up heap out of the garbage collector's passes."""

from __future__ import annotations

import gc

from laps.heap import freeze_heap, frozen_heap


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_frozen_heap_freezes_live_objects_collects_garbage_first_and_thaws():
    gc.unfreeze()
    kept = _Cycle()
    _Cycle()  # unreachable at once: a cycle only the collector frees
    with frozen_heap() as count:
        assert count > 1000 and gc.get_freeze_count() > 1000
        assert not any(isinstance(o, _Cycle) for o in gc.get_objects())  # kept is frozen: the collector no longer sees it
    assert gc.get_freeze_count() == 0
    assert [o for o in gc.get_objects() if isinstance(o, _Cycle)] == [kept]  # thawed, and the garbage cycle is gone


def test_freeze_heap_returns_the_count_frozen():
    gc.unfreeze()
    try:
        count = freeze_heap()
        assert count > 1000 and abs(gc.get_freeze_count() - count) <= 10  # what dies after the count was taken
    finally:
        gc.unfreeze()
