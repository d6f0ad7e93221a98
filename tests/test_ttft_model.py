"""The per-engine TTFT queue model: backlog, decode residual, chunked prefill, corrections from first tokens."""

import math

import pytest

from policies.ttft_model import EngineQueueModel, EngineTraits, isolated_prefill_s
from tests.test_laps_scheduler import TRAITS, LinearCost

IN_PASS_S = (0.005 + 0.04096 - 0.00501) / 4096  # what one more new token adds to a full 4,096-token pass


def test_isolated_prefill_runs_in_chunks_on_a_growing_context():
    # 5,000 new tokens in 4,096-token chunks: (5 ms + 40.96 ms) + (5 ms + 9.04 ms + 4.096 ms of cached context).
    assert isolated_prefill_s(LinearCost(), 5000, 0, 4096) == pytest.approx(0.04596 + 0.018136)


def test_a_request_queues_behind_the_backlog_and_the_backlog_follows_late_first_tokens():
    m = EngineQueueModel(TRAITS)
    assert m.predict_ttft_s("e", [(100, 0)], 0.0) == pytest.approx(0.006)  # idle: its own pass only
    assert m.dispatched("e", ["a"], [(1000, 0)], 0.0) == pytest.approx(0.015)
    # b joins a's pass, which has not started: its 100 tokens add 100 × IN_PASS_S (~1 ms) to it
    assert m.dispatched("e", ["b"], [(100, 0)], 0.0) == pytest.approx(0.015 + 100 * IN_PASS_S)
    # 10 ms on, a is 5 ms from done and b waits whole behind it (the backlog keeps a group's whole pass); a third
    # request joins b's pass
    assert m.predict_ttft_s("e", [(100, 0)], 0.01) == pytest.approx(0.005 + 0.006 + 100 * IN_PASS_S)
    m.first_token("a", 0.025)  # 10 ms late: b is pushed back as much
    assert m.backlog_end_s("e", 0.025) == pytest.approx(0.031)
    assert (m.prefilling("e", 0.025), m.decoding("e")) == (1, 1)
    m.first_token("b", 0.026)  # early: the backlog is simply gone
    assert m.backlog_end_s("e", 0.026) == 0.026
    m.finished("a", 0.03)
    m.finished("b", 0.03)
    assert (m.prefilling("e", 0.03), m.decoding("e")) == (0, 0)


def test_an_idle_engine_that_decodes_adds_half_a_decode_pass():
    m = EngineQueueModel(TRAITS)
    m.dispatched("e", ["a"], [(10, 0)], 0.0)
    m.first_token("a", 0.005)
    assert m.start_s("e", 1.0) == pytest.approx(1.0 + 0.5 * 0.00501)


SPF = EngineTraits(LinearCost(), chunk_tokens=4096, short_first=True)
CHUNK_S = 0.005 + 0.04096  # one 4,096-token pass on nothing cached


def test_on_shortest_prefill_first_engines_a_prefill_waits_for_shorter_work_and_a_chunk_not_for_longer_work():
    m = EngineQueueModel(SPF)
    long_s = isolated_prefill_s(LinearCost(), 20000, 0, 4096)
    assert m.dispatched("e", ["long"], [(20000, 0)], 0.0) == pytest.approx(long_s)
    # A short one overtakes the long prefill: it waits for one whole chunk pass at most, then its own 5.5 ms.
    assert m.predict_ttft_s("e", [(50, 0)], 0.0) == pytest.approx(CHUNK_S + 0.0055)
    assert m.displaced("e", [(50, 0)], 0.0) == 1
    m.dispatched("e", ["short"], [(50, 0)], 0.0)
    # A 2,000-token prefill waits for the short one (5.5 ms), a chunk of the long one, and its own 25 ms.
    assert m.predict_ttft_s("e", [(2000, 0)], 0.0) == pytest.approx(0.0055 + CHUNK_S + 0.025)
    assert m.displaced("e", [(2000, 0)], 0.0) == 1
    # On a first-come-first-served engine it waits for everything sent before it and displaces nothing.
    fcfs = EngineQueueModel(EngineTraits(LinearCost(), chunk_tokens=4096))
    fcfs.dispatched("e", ["long"], [(20000, 0)], 0.0)
    assert fcfs.predict_ttft_s("e", [(50, 0)], 0.0) == pytest.approx(long_s + 0.0055)
    assert fcfs.displaced("e", [(50, 0)], 0.0) == 0


def test_overtaking_a_prefill_that_fits_one_pass_waits_at_most_for_that_pass_not_for_a_chunk():
    # A re-prefill with its whole context cached (1 new token on 3,000) overtakes any other prefill on its engine.
    # The longest there is a 500-token prompt, which runs in one pass (10 ms): that pass is the most it can find in
    # progress, not a 4,096-token chunk pass (46 ms). Priced at a chunk, a cache hit looked 36 ms dearer on every
    # engine with a prompt waiting, and laps sent it to prefill its 3,000 tokens again on another engine.
    # a has not started, so the re-prefill runs in its pass: 10 ms, and its own 8.01 ms pass less a pass's fixed cost.
    m = EngineQueueModel(SPF)
    m.dispatched("e", ["a"], [(500, 0)], 0.0)
    assert m.predict_ttft_s("e", [(1, 3000)], 0.0) == pytest.approx(0.010 + 0.00801 - 0.00501)
    m.dispatched("e", ["long"], [(20000, 0)], 0.0)  # with a prefill longer than a chunk there, a chunk pass again
    assert m.predict_ttft_s("e", [(1, 3000)], 0.0) == pytest.approx(CHUNK_S + 0.00801)


def test_prefills_that_fit_one_pass_together_count_as_the_one_pass_they_can_be_in():
    # Eight 500-token prompts sent one by one: the engine runs all of them in one pass (4,000 tokens: 5 + 40 ms),
    # as it would had they come as one group; a request overtaking them waits for that pass at most, priced as
    # their eight 10 ms passes less seven shortest passes (5.01 ms each), and it joins that pass (its 8.01 ms less a
    # pass's fixed cost). Ten of them fill a chunk pass at most, and with them it no longer fits: its own pass then.
    m = EngineQueueModel(SPF)
    for i in range(8):
        m.dispatched("e", [f"p{i}"], [(500, 0)], 0.0)
    assert m.predict_ttft_s("e", [(1, 3000)], 0.0) == pytest.approx(8 * 0.010 - 7 * 0.00501 + 0.00801 - 0.00501)
    grouped = EngineQueueModel(SPF)
    grouped.dispatched("e", [f"p{i}" for i in range(8)], [(500, 0)] * 8, 0.0)
    assert grouped.predict_ttft_s("e", [(1, 3000)], 0.0) == pytest.approx(0.045 + 0.00801 - 0.00501)
    for i in range(8, 10):
        m.dispatched("e", [f"p{i}"], [(500, 0)], 0.0)
    assert m.predict_ttft_s("e", [(1, 3000)], 0.0) == pytest.approx(CHUNK_S + 0.00801)


def test_a_prefill_that_counts_on_one_in_flight_runs_behind_all_prefill_work_even_when_shorter():
    m = EngineQueueModel(SPF)
    long_s = isolated_prefill_s(LinearCost(), 20000, 0, 4096)
    m.dispatched("e", ["doc"], [(20000, 0)], 0.0)
    # A question of 50 new tokens on the document's 19,968 (held only once the document's prefill has run): behind it,
    # so its 5 ms + 0.5 ms + 19.968 ms come after all of the document's work, and it overtakes nothing.
    own_s = 0.005 + 0.0005 + 0.019968
    assert m.predict_ttft_s("e", [(50, 19968)], 0.0, behind_all=True) == pytest.approx(long_s + own_s)
    assert m.displaced("e", [(50, 19968)], 0.0, behind_all=True) == 0
    assert m.dispatched("e", ["q"], [(50, 19968)], 0.0, behind_all=True) == pytest.approx(long_s + own_s)
    # A short request sent later still goes ahead of both (as the engine takes it shortest first).
    assert m.predict_ttft_s("e", [(10, 0)], 0.0) == pytest.approx(CHUNK_S + 0.0051)
    # A 30,000-token prefill sent next is ordered before the question; the document's and then the question's first
    # tokens come early, but the question's key says nothing of what ran before it: the 30,000 tokens are still ahead
    # (less the 1 ms they have run since the document's).
    m.dispatched("e", ["big"], [(30000, 0)], 0.0)
    m.first_token("doc", 0.01)
    m.first_token("q", 0.011)
    assert m.backlog_end_s("e", 0.011) == pytest.approx(0.01 + isolated_prefill_s(LinearCost(), 30000, 0, 4096))


def test_only_overtaken_prefills_that_can_still_meet_their_deadline_count_as_displaced():
    m = EngineQueueModel(SPF)
    long_s = isolated_prefill_s(LinearCost(), 20000, 0, 4096)  # 0.2448 s
    m.dispatched("e", ["late"], [(20000, 0)], 0.0, deadlines_s=[0.2])  # its own work alone ends past its deadline
    m.dispatched("e", ["open"], [(30000, 0)], 0.0, deadlines_s=[5.0])
    m.dispatched("e", ["none"], [(10000, 0)], 0.0)  # no deadline given: it can always be missed
    assert long_s > 0.2
    assert m.displaced("e", [(50, 0)], 0.0) == 2  # "open" and "none"; delaying "late" costs no deadline
    # A group counts by its earliest deadline: 0.1 s is before its own 2 × 5,000-token work (0.128 s) ends.
    m.dispatched("e", ["s1", "s2"], [(5000, 0), (5000, 0)], 0.0, deadlines_s=[5.0, 0.1])
    assert m.displaced("e", [(50, 0)], 0.0) == 2
    m.dispatched("e", ["s3", "s4"], [(5000, 0), (5000, 0)], 0.0, deadlines_s=[5.0, 0.3])
    assert m.displaced("e", [(50, 0)], 0.0) == 3


def test_a_chunk_in_progress_is_never_cut_short():
    m = EngineQueueModel(SPF)
    long_s = isolated_prefill_s(LinearCost(), 10000, 0, 4096)
    m.dispatched("e", ["long"], [(10000, 0)], 0.0)
    m.prefilling("e", 0.01)  # the long prefill's first chunk is 10 ms in
    m.dispatched("e", ["short"], [(50, 0)], 0.01)
    # At 50 ms the first chunk ended at 45.96 ms and the short prefill has run 4.04 of its 5.5 ms.
    assert m.backlog_end_s("e", 0.05) == pytest.approx(0.05 + (long_s - CHUNK_S) + (0.0055 - (0.05 - CHUNK_S)))
    m.first_token("short", CHUNK_S + 0.0055)  # as the model has it: nothing to correct
    assert m.backlog_end_s("e", 0.06) == pytest.approx(0.06 + long_s - CHUNK_S - (0.06 - CHUNK_S - 0.0055))


def test_an_early_first_token_means_what_the_engine_ordered_before_it_is_done():
    m = EngineQueueModel(SPF)
    m.dispatched("e", ["a"], [(1000, 0)], 0.0)  # 15 ms
    m.dispatched("e", ["b"], [(3000, 0)], 0.0)  # 35 ms, after a
    m.first_token("b", 0.02)  # the engine is ahead of the model: a is done too (its token may still be on its way)
    assert (m.backlog_end_s("e", 0.02), m.prefilling("e", 0.02)) == (0.02, 1)


def test_unstreamed_requests_count_as_prefilled_at_their_predicted_time():
    m = EngineQueueModel(TRAITS)
    m.dispatched("e", ["a"], [(1000, 0)], 0.0, stream=False)
    assert m.prefilling("e", 0.01) == 1 and m.prefilling("e", 0.016) == 0  # done at its predicted 15 ms
    m.dispatched("e", ["a2"], [(1000, 0)], 0.02, stream=False)
    m.finished("a2", 0.02)
    assert m.backlog_end_s("e", 0.01) == 0.01
    assert m.decoding("e") == 1
    m.first_token("a", 0.5)  # reported with the whole answer: corrects nothing
    assert m.backlog_end_s("e", 0.5) == 0.5


def test_an_unstreamed_answer_after_its_predicted_prefill_is_taken_as_told_once():
    m = EngineQueueModel(TRAITS)
    m.dispatched("e", ["a"], [(1000, 0)], 0.0, stream=False)
    m.first_token("a", 0.5)  # the whole answer, long after the predicted 15 ms: nothing left to correct
    assert (m.prefilling("e", 0.5), m.decoding("e")) == (0, 1)
    m.finished("a", 0.5)
    assert m.decoding("e") == 0


def test_a_request_without_a_free_slot_waits_for_as_many_finishes_at_the_engines_finishing_rate():
    m = EngineQueueModel(TRAITS)
    # Nothing has finished yet: the floor of one finish per FINISH_RATE_WINDOW_S (1 s).
    assert m.slot_wait_s("e", 2, 0.0) == pytest.approx(2.0)
    assert m.slot_wait_s("e", 0, 0.0) == 0.0
    for i in range(10):  # ten requests finish at 1 s, five of them before their first token (failed, withdrawn)
        m.dispatched("e", [f"r{i}"], [(10, 0)], 0.99)
        if i % 2:
            m.first_token(f"r{i}", 0.995)
        m.finished(f"r{i}", 1.0)
    assert (m.prefilling("e", 1.0), m.decoding("e")) == (0, 0)
    # 10 finishes in a 1-s window: 10 per second, so the 5th request waiting for a slot gets one in 0.5 s.
    assert m.slot_wait_s("e", 5, 1.0) == pytest.approx(0.5)
    assert m.slot_wait_s("e", 1, 2.0) == pytest.approx(1 / (10 * math.exp(-1.0)))  # the rate decays: 3.68 per second
    assert m.slot_wait_s("other", 1, 1.0) == pytest.approx(1.0)  # per engine
    # Its TTFT: the slot wait, then its own pass (5 ms + 1 ms); a prefill backlog longer than the wait counts instead.
    assert m.predict_ttft_s("e", [(100, 0)], 1.0, waiting_for_slot=5) == pytest.approx(0.5 + 0.006)
    m.dispatched("e", ["big"], [(100_000, 0)], 1.0)
    backlog_s = isolated_prefill_s(LinearCost(), 100_000, 0, 4096)  # 2.354 s in 25 chunks on a growing context
    assert m.predict_ttft_s("e", [(100, 0)], 1.0, waiting_for_slot=5) == pytest.approx(backlog_s + 0.006)


def test_bad_chunk_size_is_refused():
    with pytest.raises(ValueError, match="chunk_tokens"):
        EngineQueueModel(EngineTraits(LinearCost(), chunk_tokens=0))


def test_a_short_request_joins_a_pass_about_to_start_rather_than_interrupt_a_decoding_engine():
    # Engine "dec" decodes 300 requests (an 8 ms decode pass: half of one in progress, 4 ms) and has nothing to prefill;
    # on engine "pre" a 100-token prefill was just sent and has not started. A second 100-token request runs in that
    # pass: 6 ms for the first, then what its 100 tokens add to a full pass (~1 ms), 7 ms in all, against 4 + 6 ms on
    # "dec", where it would also start a prefill pass that holds up the 300 decoding requests. Priced as a pass of its
    # own, "pre" cost 12 ms and the request went to "dec".
    m = EngineQueueModel(TRAITS)
    rids = [f"d{i}" for i in range(300)]
    m.dispatched("dec", rids, [(1, 0)] * 300, 0.0)
    for rid in rids:
        m.first_token(rid, 0.01)
    m.dispatched("pre", ["p"], [(100, 0)], 1.0)
    assert m.predict_ttft_s("dec", [(100, 0)], 1.0) == pytest.approx(0.5 * 0.008 + 0.006)
    assert m.predict_ttft_s("pre", [(100, 0)], 1.0) == pytest.approx(0.006 + 100 * IN_PASS_S)
    # Once that pass has started, the request waits for it and runs a pass of its own.
    assert m.predict_ttft_s("pre", [(100, 0)], 1.001) == pytest.approx(0.005 + 0.006)


def test_a_pass_of_its_own_holds_up_the_requests_decoding_or_prefilling_there_but_joining_a_waiting_pass_does_not():
    m = EngineQueueModel(TRAITS)
    assert not m.holds_up_others("idle", [(100, 0)], 0.0)  # nothing else there
    assert m.holds_up_others("idle", [(100, 0)], 0.0, waiting_for_slot=1)  # its slots are taken by requests not sent here
    m.dispatched("dec", ["d"], [(1, 0)], 0.0)
    m.first_token("d", 0.01)
    assert m.holds_up_others("dec", [(100, 0)], 1.0)  # its pass stalls the decoding request
    m.dispatched("pre", ["p"], [(100, 0)], 1.0)
    assert not m.holds_up_others("pre", [(100, 0)], 1.0)  # it joins p's pass, which has not started
    assert m.holds_up_others("pre", [(4000, 0)], 1.0)  # 4,100 tokens: more than one 4,096-token chunk holds
    assert m.holds_up_others("pre", [(100, 0)], 1.0, waiting_for_slot=1)  # admitted later, in a pass of its own
    assert m.holds_up_others("pre", [(100, 0)], 1.0, behind_all=True)  # behind all the prefill work there
    assert m.holds_up_others("pre", [(100, 0)], 1.001)  # p's pass has started: it waits for it, then runs its own


def test_a_request_that_waits_for_a_request_slot_does_not_join_the_pass_waiting_now():
    # The engine's slots are full and only it waits for one, so it is admitted when a request finishes, at least 1 s
    # from now at the floor rate, and runs a pass of its own then, not the 100-token pass that waits now. Nor does a
    # request keyed behind all prefill work there (it counts on a prefill in flight) join that pass.
    m = EngineQueueModel(TRAITS)
    m.dispatched("e", ["p"], [(100, 0)], 0.0)
    assert m.predict_ttft_s("e", [(100, 0)], 0.0, waiting_for_slot=1) == pytest.approx(1.0 + 0.006)
    assert m.predict_ttft_s("e", [(100, 0)], 0.0) == pytest.approx(0.006 + 100 * IN_PASS_S)
    assert m.predict_ttft_s("e", [(100, 0)], 0.0, behind_all=True) == pytest.approx(0.006 + 0.006)
