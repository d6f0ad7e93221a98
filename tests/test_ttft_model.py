"""The per-engine TTFT queue model: backlog, decode residual, chunked prefill, corrections from first tokens."""

import pytest

from policies.ttft_model import EngineQueueModel, EngineTraits, isolated_prefill_s
from tests.test_laps_scheduler import TRAITS, LinearCost


def test_isolated_prefill_runs_in_chunks_on_a_growing_context():
    # 5,000 new tokens in 4,096-token chunks: (5 ms + 40.96 ms) + (5 ms + 9.04 ms + 4.096 ms of cached context).
    assert isolated_prefill_s(LinearCost(), 5000, 0, 4096) == pytest.approx(0.04596 + 0.018136)


def test_a_request_queues_behind_the_backlog_and_the_backlog_follows_late_first_tokens():
    m = EngineQueueModel(TRAITS)
    assert m.predict_ttft_s("e", [(100, 0)], 0.0) == pytest.approx(0.006)  # idle: its own pass only
    assert m.dispatched("e", ["a"], [(1000, 0)], 0.0) == pytest.approx(0.015)
    assert m.dispatched("e", ["b"], [(100, 0)], 0.0) == pytest.approx(0.021)  # behind a
    assert m.predict_ttft_s("e", [(100, 0)], 0.01) == pytest.approx(0.017)
    m.first_token("a", 0.025)  # 10 ms late: b is pushed back as much
    assert m.backlog_end_s("e", 0.025) == pytest.approx(0.031)
    assert (m.prefilling("e", 0.025), m.decoding("e")) == (1, 1)
    m.first_token("b", 0.026)  # early: nothing is pulled forward, the backlog is simply gone
    assert m.backlog_end_s("e", 0.026) == 0.026
    m.finished("a")
    m.finished("b")
    assert (m.prefilling("e", 0.03), m.decoding("e")) == (0, 0)


def test_an_idle_engine_that_decodes_adds_half_a_decode_pass():
    m = EngineQueueModel(TRAITS)
    m.dispatched("e", ["a"], [(10, 0)], 0.0)
    m.first_token("a", 0.005)
    assert m.start_s("e", 1.0) == pytest.approx(1.0 + 0.5 * 0.00501)


def test_short_prefills_overtake_a_long_backlog_on_shortest_prefill_first_engines():
    m = EngineQueueModel(EngineTraits(LinearCost(), chunk_tokens=4096, short_first=True))
    m.dispatched("e", ["long"], [(20000, 0)], 0.0)  # 4 full chunks and one of 3,616: 0.2 s + 25 ms + cached reads
    chunk_s = 0.005 + 0.04096
    assert m.predict_ttft_s("e", [(50, 0)], 0.0, short=True) == pytest.approx(chunk_s + 0.0055)
    end = m.backlog_end_s("e", 0.0)
    m.dispatched("e", ["short"], [(50, 0)], 0.0, short=True)
    assert m.backlog_end_s("e", 0.0) == pytest.approx(end + 0.0055)  # the long prefill waits for it


def test_unstreamed_requests_count_as_prefilled_at_their_predicted_time():
    m = EngineQueueModel(TRAITS)
    m.dispatched("e", ["a"], [(1000, 0)], 0.0, stream=False)
    assert m.prefilling("e", 0.01) == 1 and m.prefilling("e", 0.016) == 0  # done at its predicted 15 ms
    m.dispatched("e", ["a2"], [(1000, 0)], 0.02, stream=False)
    m.finished("a2")
    assert m.backlog_end_s("e", 0.01) == 0.01
    assert m.decoding("e") == 1
    m.first_token("a", 0.5)  # reported with the whole answer: corrects nothing
    assert m.backlog_end_s("e", 0.5) == 0.5


def test_bad_chunk_size_is_refused():
    with pytest.raises(ValueError, match="chunk_tokens"):
        EngineQueueModel(EngineTraits(LinearCost(), chunk_tokens=0))
