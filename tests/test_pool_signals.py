"""The controller's inputs: the first-token window, queued tokens per pool, and the signals both runners build."""

import pytest

from policies.controller import EngineSignals
from policies.pool_signals import FirstTokenWindow, LoadSample, engine_signals, queued_new_tokens
from policies.types import EngineView, RequestView


def test_first_token_window_counts_late_first_tokens_of_the_last_window():
    window = FirstTokenWindow(10.0)
    window.record("e0", 1.0, deadline_s=0.5)   # late
    window.record("e0", 2.0, deadline_s=2.0)   # on time (at the deadline)
    window.record("e0", 5.0, deadline_s=9.0)   # on time
    window.record("e1", 5.0, deadline_s=4.0)   # late, another engine
    assert window.violation_share("e0", 5.0) == pytest.approx(1 / 3)
    assert window.violation_share("e0", 11.0) == pytest.approx(0.0)  # the 1 s token left the window (1 <= 11 - 10)
    assert window.violation_share("e0", 15.0) == 0.0 and window.violation_share("nobody", 15.0) == 0.0
    window.forget_engine("e1")
    assert window.violation_share("e1", 5.0) == 0.0
    with pytest.raises(ValueError, match="window_s"):
        FirstTokenWindow(0.0)


def test_a_few_first_tokens_count_over_min_first_tokens_so_one_cold_start_moves_nothing():
    window = FirstTokenWindow(10.0, min_first_tokens=10)
    window.record("e0", 1.0, deadline_s=0.4)   # a cold start: late, alone in the window
    assert window.violation_share("e0", 1.0) == pytest.approx(0.1)
    for i in range(11):                          # 12 in the window: the plain share
        window.record("e0", 2.0 + i / 10, deadline_s=0.0 if i < 2 else 9.0)
    assert window.violation_share("e0", 3.0) == pytest.approx(3 / 12)
    with pytest.raises(ValueError, match="min_first_tokens"):
        FirstTokenWindow(10.0, min_first_tokens=0)


def test_queued_new_tokens_per_pool_count_uncached_tokens_only():
    queued = [RequestView("a", 300, cached_tokens=100, request_class="long"), RequestView("b", 40, request_class="short"),
              RequestView("c", 5000, cached_tokens=1000, request_class="long")]
    assert queued_new_tokens(queued) == {"short": 40, "long": 4200}


def test_signals_of_serving_engines_split_the_pool_queue_evenly():
    views = [EngineView("s0", "short"), EngineView("s1", "short"), EngineView("l0", "long"),
             EngineView("l1", "long", healthy=False),  # draining or switching: sits out
             EngineView("l2", "long"),                 # no load sample: sits out
             EngineView("d0", "decode")]               # another pool (PD decode): not the controller's
    loads = {name: LoadSample(waiting_uncached_tokens=w, running_requests=r, token_usage=u)
             for name, w, r, u in (("s0", 10, 3, 0.25), ("s1", 0, 0, 0.0), ("l0", 7000, 1, 0.5), ("l1", 0, 0, 0.0), ("d0", 9, 9, 0.9))}
    window = FirstTokenWindow(30.0)
    window.record("l0", 1.0, deadline_s=0.0)
    signals = engine_signals(views, {"short": 100, "long": 900}, loads, window, now=2.0, fixed={"s1"})
    assert signals == [
        EngineSignals("s0", "short", gateway_queued_tokens=50.0, engine_waiting_tokens=10, running_requests=3, kv_token_usage=0.25),
        EngineSignals("s1", "short", gateway_queued_tokens=50.0, movable=False),
        EngineSignals("l0", "long", gateway_queued_tokens=900.0, engine_waiting_tokens=7000, ttft_slo_violation_share=1.0,
                      running_requests=1, kv_token_usage=0.5),
    ]
