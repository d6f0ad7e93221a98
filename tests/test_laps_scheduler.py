"""LAPS scheduling on scripted arrival sequences: AWD windows (exact dispatch times, batch compositions,
adaptation), predicted-TTFT engine choice, spill-over between the pools both ways, deadline order."""

import math

import pytest
from pydantic import ValidationError

from policies.laps import LapsConfig, LapsScheduler
from policies.ttft_model import EngineTraits
from policies.types import Decision, Dispatch, EngineView, RequestView

ENGINES = [EngineView("s", "short"), EngineView("l", "long")]
SLO_S = 0.4


class LinearCost:
    """A pass: 5 ms plus 10 µs per new token and 1 µs per cached token; a decode pass 5 ms plus 10 µs per sequence."""

    def prefill_s(self, batch):
        return 0.005 + 1e-5 * sum(n for n, _ in batch) + 1e-6 * sum(h for _, h in batch)

    def decode_s(self, seqs, context_tokens):
        return 0.005 + 1e-5 * seqs


TRAITS = EngineTraits(LinearCost(), chunk_tokens=4096)
BUSY_TOKENS = 100_000  # 25 chunks: 25 × 5 ms + 1 s of new tokens + 1.23 s of their growing context = 2.35 s of backlog


def occupy(s: LapsScheduler, *engine_ids: str, at: float = 0.0) -> None:
    """Give each engine a prefill backlog of 2.35 s that is not the scheduler's own request (another gateway's, say)."""
    for e in engine_ids:
        s.model.dispatched(e, [f"busy-{e}"], [(BUSY_TOKENS, 0)], at)


def laps(cfg: LapsConfig, busy=("s", "l")) -> LapsScheduler:
    """A scheduler whose engines ``busy`` are all prefilling, so AWD windows hold (nothing idle to send to)."""
    s = LapsScheduler(cfg, TRAITS)
    occupy(s, *busy)
    return s


def config(**overrides) -> LapsConfig:
    base = dict(awd_windows=True, window_min_ms=0.5, window_max_ms=8.0, token_buckets=[64, 128, 256], initial_depth_tokens=128,
                slack_ms=50.0, margin_ms=10.0, grouping="latency-first", rate_window_s=1.0, initial_service_ms=10.0)
    return LapsConfig(**{**base, **overrides})


def short(rid: str, new_tokens: int, at: float, deadline: float | None = None, **kw) -> RequestView:
    return RequestView(rid, new_tokens, 0, at, at + SLO_S if deadline is None else deadline, "short", **kw)


def long(rid: str, tokens: int, at: float) -> RequestView:
    return RequestView(rid, tokens, 0, at, at + SLO_S, "long")


def test_batch_dispatches_when_depth_reaches_target_and_depth_grows():
    s = laps(config(rate_window_s=0.01))
    s.submit(short("r0", 96, 0.0), 0.0)  # rate 96 / 0.01 s = 9600 tok/s: 32 more tokens in 3.33 ms
    assert s.decide(ENGINES, 0.0).wake_at_s == pytest.approx(32 / 9600)
    s.submit(short("r1", 32, 0.002), 0.002)
    assert s.decide(ENGINES, 0.002) == Decision((Dispatch("s", ("r0", "r1")),))
    assert s.depth_tokens == 256 and s.triggers["depth"] == 1  # filled within W_max/2: one bucket up


def test_window_expiry_dispatches_a_partial_batch_and_depth_shrinks():
    s = laps(config(rate_window_s=0.01))
    s.submit(short("r0", 100, 0.0), 0.0)  # 10,000 tok/s: the 28 missing tokens are due in 2.8 ms
    assert s.decide(ENGINES, 0.0).wake_at_s == pytest.approx(0.0028)
    # Nothing came: the decayed rate pushes the expected fill to 6.5 ms, still within W_max ...
    later = 0.0028 + 28 / (10_000 * math.exp(-0.28))
    assert s.decide(ENGINES, 0.0028) == Decision(wake_at_s=pytest.approx(later))
    # ... and then past W_max: the batch will not fill, so it goes as it is.
    assert s.decide(ENGINES, later) == Decision((Dispatch("s", ("r0",)),))
    assert s.depth_tokens == 64 and s.triggers["window"] == 1  # back to the largest bucket reached


def test_unreachable_depth_means_the_minimum_window():
    s = laps(config())
    s.submit(short("r0", 40, 0.0), 0.0)  # 40 tok/s: 88 more tokens would take 2.2 s > W_max
    assert s.decide(ENGINES, 0.0) == Decision(wake_at_s=0.0005)
    assert s.decide(ENGINES, 0.0005) == Decision((Dispatch("s", ("r0",)),))


def test_tight_deadline_forces_immediate_dispatch_and_depth_steps_down():
    s = laps(config())
    s.submit(short("r0", 10, 0.0, deadline=0.05), 0.0)  # slack 0.05 - 0.01 = 0.04 < σ = 0.05
    assert s.decide(ENGINES, 0.0) == Decision((Dispatch("s", ("r0",)),))
    assert s.depth_tokens == 64 and s.triggers["slack"] == 1


def test_slack_wakeup_comes_before_the_window_when_the_deadline_is_near():
    s = laps(config(window_max_ms=100.0, rate_window_s=0.001))
    s.submit(short("r0", 10, 0.0, deadline=0.065), 0.0)  # fill in 11.8 ms, but slack 0.055 falls under σ at t = 0.005
    assert s.decide(ENGINES, 0.0).wake_at_s == pytest.approx(0.005)


def test_fill_time_at_the_arrival_rate_sets_the_window():
    s = laps(config(rate_window_s=0.01))
    s.submit(short("r0", 96, 0.0), 0.0)  # rate 96 / 0.01 s = 9600 tok/s; (128 - 96) / 9600 = 3.33 ms
    assert s.decide(ENGINES, 0.0).wake_at_s == pytest.approx(32 / 9600)


def test_without_awd_windows_each_short_request_goes_at_once_though_every_engine_is_busy():
    assert LapsConfig().awd_windows is False  # the default: measured in the engine model (module docstring)
    s = laps(config(awd_windows=False))
    s.submit(short("r0", 96, 0.0), 0.0)  # with windows, the case of the first test: held 3.33 ms for 32 more tokens
    assert s.decide(ENGINES, 0.0) == Decision((Dispatch("s", ("r0",)),))
    s.submit(short("r1", 10, 0.001), 0.001)
    s.submit(short("r2", 10, 0.001), 0.001)  # what is queued at a decision goes together: the engine would batch it
    # r0's prefill now waits unstarted on s behind its backlog: r1 and r2 join its pass there (5.96 ms, then 0.19 ms for
    # their 20 tokens) rather than run a 5.2-ms pass of their own behind l's equal backlog, which would hold that
    # backlog up: 0.95 ms apart, under one pass (module docstring, Passes of their own)
    assert s.decide(ENGINES, 0.001) == Decision((Dispatch("s", ("r1", "r2")),))
    assert s.triggers["immediate"] == 2 and s.depth_tokens == 128  # no window, no adaptation


def test_memory_first_groups_by_length_bucket():
    s = laps(config(grouping="memory-first", length_buckets=[16, 64, 256]))
    for rid, n in (("a", 10), ("b", 200), ("c", 12), ("d", 50)):
        s.submit(short(rid, n, 0.0), 0.0)
    decision = s.decide(ENGINES, 0.008)
    # One batch per bucket, each to the engine whose backlog (grown by the batches before it) ends first, or within one
    # pass of it where the batch joins a pass waiting there: d joins a and c's pass on s (a pass of its own on l would
    # hold up l's backlog); b would be more than a pass later on s, whose backlog keeps each batch's whole pass.
    assert decision.dispatches == (Dispatch("s", ("a", "c")), Dispatch("s", ("d",)), Dispatch("l", ("b",)))


def test_batch_is_cut_at_the_target_depth():
    s = laps(config())
    for i in range(5):
        s.submit(short(f"r{i}", 40, 0.0), 0.0)
    first = s.decide(ENGINES, 0.0)
    # depth 200 >= 128: take requests while they fit 128 tokens (3 × 40), then 2 × 40 = 80 remain under D = 256.
    assert first.dispatches == (Dispatch("s", ("r0", "r1", "r2")),)
    assert first.wake_at_s == 0.0005  # 176 more tokens at 200 tok/s: unreachable, minimum window


def test_a_re_prefill_goes_where_its_context_is_cached_unless_recomputing_elsewhere_is_sooner():
    engines = [EngineView("s0", "short"), EngineView("s1", "short"), EngineView("l", "long")]
    s = LapsScheduler(config(), TRAITS)
    # 2,000-token prompt, 1,900 cached on s1: 5 ms + 1 ms + 1.9 ms there, 5 ms + 20 ms on s0 or l.
    s.submit(short("r0", 2000, 0.0, cached_by_engine={"s1": 1900}), 0.0)
    assert s.decide(engines, 0.0).dispatches == (Dispatch("s1", ("r0",)),)
    s2 = LapsScheduler(config(), TRAITS)
    occupy(s2, "s1")  # 2.35 s of backlog on s1: recomputing 2,000 tokens elsewhere is far sooner
    s2.submit(short("r0", 2000, 0.0, cached_by_engine={"s1": 1900}), 0.0)
    assert s2.decide(engines, 0.0).dispatches == (Dispatch("s0", ("r0",)),)


def test_a_re_prefill_with_its_context_cached_stays_there_when_a_prompt_waits_there():
    engines = [EngineView("s0", "short"), EngineView("s1", "short")]
    s = LapsScheduler(config(awd_windows=False), SPF)
    s.model.dispatched("s1", ["p"], [(500, 0)], 0.0)  # a 500-token prompt waits on s1 (one 10 ms pass)
    # 3,001-token prompt, 3,000 cached on s1: at most that 10 ms pass ahead of it there, then 5 + 0.01 + 3 ms of its
    # own; on the idle s0 it prefills all of it, 35.01 ms. Priced as if a 4,096-token chunk (45.96 ms) could be in
    # progress on s1, it went to s0.
    s.submit(short("r0", 3001, 0.0, cached_by_engine={"s1": 3000}), 0.0)
    assert s.decide(engines, 0.0).dispatches == (Dispatch("s1", ("r0",)),)


def test_an_idle_engine_takes_a_short_request_at_once_and_ties_go_to_the_short_pool():
    s = LapsScheduler(config(), TRAITS)
    s.submit(short("r0", 10, 0.0), 0.0)
    assert s.decide(ENGINES, 0.0) == Decision((Dispatch("s", ("r0",)),))  # no window: an engine could start it now
    s.submit(short("r1", 10, 0.0), 0.0)
    # s now prefills r0 (5.1 ms to go), l is idle: r1 goes to the long pool's idle engine ("spill-over").
    assert s.decide(ENGINES, 0.0) == Decision((Dispatch("l", ("r1",)),))
    stats = s.stats()
    assert (stats["short_batches_by_idle_total"], stats["short_batches_to_long_pool_total"]) == (2, 1)


def test_a_tie_in_predicted_cost_goes_to_the_engine_with_fewer_requests_in_flight_then_the_short_pool():
    # Both engines idle: the same predicted TTFT. s holds 3 requests (decoding, say), l holds 1: l takes it.
    s = LapsScheduler(config(awd_windows=False), TRAITS)
    s.submit(short("r0", 10, 0.0), 0.0)
    loaded = [EngineView("s", "short", in_flight=3), EngineView("l", "long", in_flight=1)]
    assert s.decide(loaded, 0.0) == Decision((Dispatch("l", ("r0",)),))
    s = LapsScheduler(config(awd_windows=False), TRAITS)
    s.submit(short("r0", 10, 0.0), 0.0)
    even = [EngineView("s", "short", in_flight=2), EngineView("l", "long", in_flight=2)]
    assert s.decide(even, 0.0) == Decision((Dispatch("s", ("r0",)),))  # as many in flight: the short pool


@pytest.mark.parametrize("waiting_tokens, chosen", [(600, "pre"), (1500, "dec")])
def test_a_short_request_joins_a_waiting_pass_within_one_pass_of_the_cheapest_rather_than_hold_up_a_decode_batch(
        waiting_tokens, chosen):
    # "dec" decodes 100 requests (a 6-ms decode pass: half of one in progress) and would run the 100-token request in a
    # 6-ms pass of its own, which stalls them: 9 ms. On "pre" a prefill waits unstarted; the request joins its pass:
    # 600 tokens, 10 ms + 1 ms (what 100 tokens add to it), 2 ms dearer, under one pass (5.01 ms): "pre"; 1,500
    # tokens, 20 + 1 ms, 12 ms dearer: "dec".
    s = LapsScheduler(config(awd_windows=False), TRAITS)
    rids = [f"d{i}" for i in range(100)]
    s.model.dispatched("dec", rids, [(1, 0)] * 100, 0.0)
    for rid in rids:
        s.model.first_token(rid, 0.01)
    s.model.dispatched("pre", ["p"], [(waiting_tokens, 0)], 1.0)
    s.submit(short("r0", 100, 1.0), 1.0)
    assert s.decide([EngineView("dec", "short"), EngineView("pre", "short")], 1.0) == Decision((Dispatch(chosen, ("r0",)),))


def test_an_idle_engine_beats_joining_a_waiting_pass_when_it_is_sooner():
    # Neither holds anyone up: the idle engine's 6-ms pass is sooner than the 600-token pass waiting on "pre" (11 ms).
    s = LapsScheduler(config(awd_windows=False), TRAITS)
    s.model.dispatched("pre", ["p"], [(600, 0)], 1.0)
    s.submit(short("r0", 100, 1.0), 1.0)
    assert s.decide([EngineView("pre", "short"), EngineView("idle", "short")], 1.0) == Decision((Dispatch("idle", ("r0",)),))


def test_a_request_goes_where_it_gets_a_request_slot_first():
    # s has all its 4 slots taken (decoding requests) and nothing to prefill; l has 2.35 s of prefill backlog but a free
    # slot. Nothing has finished on s yet, so its slot comes in 1 s at the floor rate (policies.ttft_model): s wins.
    s = LapsScheduler(config(awd_windows=False), TRAITS)
    occupy(s, "l")
    engines = [EngineView("s", "short", in_flight=4, max_running_requests=4), EngineView("l", "long", in_flight=1, max_running_requests=4)]
    s.submit(short("r0", 10, 0.0), 0.0)
    assert s.decide(engines, 0.0) == Decision((Dispatch("s", ("r0",)),))
    # Two requests ahead of it waiting for a slot on s (in flight 6 of 4, plus itself: 3): 3 s, later than l's backlog.
    s = LapsScheduler(config(awd_windows=False), TRAITS)
    occupy(s, "l")
    engines = [EngineView("s", "short", in_flight=6, max_running_requests=4), EngineView("l", "long", in_flight=1, max_running_requests=4)]
    s.submit(short("r1", 10, 0.0), 0.0)
    assert s.decide(engines, 0.0) == Decision((Dispatch("l", ("r1",)),))
    # Slots unknown (an engine that does not say): no wait is counted, and the idle s takes it.
    s = LapsScheduler(config(awd_windows=False), TRAITS)
    occupy(s, "l")
    engines = [EngineView("s", "short", in_flight=6), EngineView("l", "long", in_flight=1)]
    s.submit(short("r2", 10, 0.0), 0.0)
    assert s.decide(engines, 0.0) == Decision((Dispatch("s", ("r2",)),))


def test_a_batch_dispatched_takes_its_slots_for_the_next_decision():
    # One decision, two 100-token batches (D 128 keeps them apart). s has one free slot and nothing to do; l has
    # ~0.63 s of prefill backlog and a free slot. The first takes s's slot; the second would wait 1 s for one there
    # (nothing has finished on s: the floor rate), so it goes to l.
    s = LapsScheduler(config(awd_windows=False), TRAITS)
    s.model.dispatched("l", ["busy-l"], [(40_000, 0)], 0.0)
    engines = [EngineView("s", "short", max_running_requests=1), EngineView("l", "long", in_flight=1, max_running_requests=4)]
    s.submit(short("r0", 100, 0.0), 0.0)
    s.submit(short("r1", 100, 0.0), 0.0)
    assert s.decide(engines, 0.0) == Decision((Dispatch("s", ("r0",)), Dispatch("l", ("r1",))))


def test_an_engine_that_finishes_requests_faster_frees_its_slots_sooner():
    # Both engines full (4 in flight of 4 slots) and idle in prefill; s has finished 20 requests in the last instant,
    # l none: the request goes to s (1 / 20 s against 1 s).
    s = LapsScheduler(config(awd_windows=False), TRAITS)
    for i in range(20):
        s.model.dispatched("s", [f"d{i}"], [(10, 0)], 0.0)
        s.model.first_token(f"d{i}", 0.001)
        s.on_complete(f"d{i}", "s", 0.002)
    engines = [EngineView("s", "short", in_flight=4, max_running_requests=4), EngineView("l", "long", in_flight=4, max_running_requests=4)]
    s.submit(short("r0", 10, 0.002), 0.002)
    assert s.decide(engines, 0.002) == Decision((Dispatch("s", ("r0",)),))
    s = LapsScheduler(config(awd_windows=False), TRAITS)
    for i in range(20):
        s.model.dispatched("l", [f"d{i}"], [(10, 0)], 0.0)
        s.model.first_token(f"d{i}", 0.001)
        s.on_complete(f"d{i}", "l", 0.002)
    s.submit(short("r0", 10, 0.002), 0.002)
    assert s.decide(engines, 0.002) == Decision((Dispatch("l", ("r0",)),))


def test_a_short_batch_goes_to_the_engine_whose_backlog_ends_first_even_behind_a_long_prefill():
    s = LapsScheduler(config(), TRAITS)
    s.submit(long("L", 3000, 0.0), 0.0)
    assert s.decide(ENGINES, 0.0).dispatches == (Dispatch("l", ("L",)),)
    occupy(s, "s")  # now both engines are busy; s's backlog ends at 2.35 s, l's at 0.035 s
    s.submit(short("r0", 200, 0.001, deadline=10.0), 0.001)
    s.submit(short("r1", 100, 0.001, deadline=10.0), 0.001)
    decision = s.decide(ENGINES, 0.001)  # depth 300 >= D 128: r0 goes (alone: r1 would pass D) to l, behind the long prefill
    assert decision.dispatches == (Dispatch("l", ("r0",)),)


LONG_ONLY = [EngineView("s", "short", healthy=False), EngineView("l", "long")]  # the short engine is down


def test_long_prefills_are_gated_by_tokens_in_progress_shortest_first_among_equal_deadlines():
    s = laps(config(max_long_prefill_tokens=8000))
    for rid, n in (("L0", 3000), ("L1", 4000), ("L2", 3000), ("L3", 9000)):
        s.submit(long(rid, n, 0.0), 0.0)
    # Equal deadlines: shortest isolated prefill first, so L0, L2, L1, L3. 3000 + 3000 fit in 8000; L1 would
    # make 10000 and waits (and L3 behind it) until its slack runs out at 0.4 - Ŝ_long 0.1 - σ 0.05 = 0.25.
    assert s.decide(LONG_ONLY, 0.0) == Decision((Dispatch("l", ("L0",)), Dispatch("l", ("L2",))), wake_at_s=pytest.approx(0.25))
    assert s.decide(LONG_ONLY, 0.1) == Decision(wake_at_s=pytest.approx(0.25))
    s.on_first_token("L0", "l", 0.2, None)  # Ŝ_long = 0.8 · 0.1 + 0.2 · 0.2 = 0.12
    assert s.long_service_s == pytest.approx(0.12)
    # L1 fits now (3000 + 4000); L3 does not, and its slack runs out at 0.4 - 0.12 - 0.05 = 0.23.
    assert s.decide(LONG_ONLY, 0.2) == Decision((Dispatch("l", ("L1",)),), wake_at_s=pytest.approx(0.23))
    assert s.decide(LONG_ONLY, 0.231) == Decision((Dispatch("l", ("L3",)),))  # over the gate, on its slack


def test_with_nothing_long_in_progress_one_request_over_the_gate_goes_alone():
    s = laps(config(max_long_prefill_tokens=8000))
    s.submit(long("big", 9000, 0.0), 0.0)
    s.submit(RequestView("next", 10, 0, 0.0, 0.5, "long"), 0.0)
    assert s.decide(LONG_ONLY, 0.0) == Decision((Dispatch("l", ("big",)),), wake_at_s=pytest.approx(0.35))
    s.on_complete("big", "l", 0.1)  # ended (say, failed) before its first token: its tokens are released too
    assert s.decide(LONG_ONLY, 0.1) == Decision((Dispatch("l", ("next",)),))


def test_without_a_long_pool_the_single_engine_takes_long_prefills_one_at_a_time():
    s = laps(config())
    s.submit(long("L0", 300, 0.0), 0.0)
    s.submit(long("L1", 300, 0.0), 0.0)
    only = [EngineView("only", "short")]
    assert s.decide(only, 0.0).dispatches == (Dispatch("only", ("L0",)),)  # temporal mode: L1 waits
    s.on_first_token("L0", "only", 0.05, None)
    assert s.decide(only, 0.05).dispatches == (Dispatch("only", ("L1",)),)


def test_a_long_prefill_borrows_a_short_engine_when_the_long_pool_would_miss_its_deadline():
    engines = [EngineView("s0", "short"), EngineView("s1", "short"), EngineView("l", "long")]
    s = LapsScheduler(config(), TRAITS)
    occupy(s, "l")  # the long pool's only engine is 2.35 s behind: a 3,000-token prefill there misses 0.4 s
    s.submit(long("L", 3000, 0.0), 0.0)
    s.submit(long("L2", 3000, 0.0), 0.0)
    # 35 ms on s0, then 35 ms on s1 (s0 would now take 70 ms).
    assert s.decide(engines, 0.0) == Decision((Dispatch("s0", ("L",)), Dispatch("s1", ("L2",))))
    assert s.stats()["long_prefills_to_short_pool_total"] == 2


def short_traffic(s: LapsScheduler, start_s: float) -> None:
    """100 short requests from ``start_s``, one every millisecond, each sent to s alone and answered at once: ~95
    short batches per second at ``start_s`` + 0.1 s."""
    for i in range(100):
        t = start_s + i / 1000
        s.submit(short(f"r{i}", 10, t), t)
        assert s.decide(ENGINES, t).dispatches == (Dispatch("s", (f"r{i}",)),)
        s.on_first_token(f"r{i}", "s", t, 0)
        s.on_complete(f"r{i}", "s", t)


def test_a_long_prefill_takes_a_clean_short_engine_only_when_that_beats_the_short_batches_it_would_hold_up():
    quiet = LapsScheduler(config(), TRAITS)
    for rid in ("L0", "L1"):
        quiet.submit(long(rid, 3000, 0.0), 0.0)
    # No short traffic: L0 to l (a tie: the long pool), L1 to s (35 ms there, 70 ms on l behind L0).
    assert quiet.decide(ENGINES, 0.0).dispatches == (Dispatch("l", ("L0",)), Dispatch("s", ("L1",)))
    assert quiet.stats()["long_prefills_to_short_pool_total"] == 1

    busy = LapsScheduler(config(), TRAITS)
    short_traffic(busy, 0.0)
    for rid in ("L0", "L1"):
        busy.submit(long(rid, 3000, 0.1), 0.1)
    # On s, L1 would hold up ~95 batches/s × 35 ms, each for 17.5 ms on average: 58 ms more than its 35 ms there,
    # against 70 ms on l.
    assert busy.decide(ENGINES, 0.1).dispatches == (Dispatch("l", ("L0",)), Dispatch("l", ("L1",)))
    assert busy.stats()["long_prefills_to_short_pool_total"] == 0


def test_the_clean_engine_charge_chooses_only_among_engines_where_the_long_prefill_is_in_time_with_the_observed_margin():
    s = LapsScheduler(config(), TRAITS)
    # History: 20 long prefills, one at a time on idle engines, each predicted at 35 ms and answered 210 ms after
    # dispatch (later prefills overtook them, say): 6x the prediction.
    for i in range(20):
        t = i * 0.25
        assert s.long_ttft_margin() == 1.0  # too few seen yet
        s.submit(long(f"H{i}", 3000, t), t)
        (d,) = s.decide(ENGINES, t).dispatches
        s.on_first_token(f"H{i}", d.engine_id, t + 0.21, 0)
        s.on_complete(f"H{i}", d.engine_id, t + 0.21)
    assert s.long_ttft_margin() == pytest.approx(6.0)
    short_traffic(s, 5.0)
    for rid in ("L0", "L1"):
        s.submit(long(rid, 3000, 5.1), 5.1)
    # L0: 35 ms on either engine (x6 = 210 ms, in time on both): the charge keeps it on l, as above. L1: 70 ms on l
    # behind L0, x6 = 420 ms, past its 400 ms; 35 ms on s (210 ms): only s is in time, so it goes there, though the
    # charge alone would keep it on l (the test above).
    assert s.decide(ENGINES, 5.1).dispatches == (Dispatch("l", ("L0",)), Dispatch("s", ("L1",)))


def test_a_long_prefill_stays_in_its_pool_when_another_engine_is_cheaper_by_less_than_one_pass():
    s = LapsScheduler(config(), TRAITS)
    # 24 template tokens cached on s save 0.24 ms there: under the 5.01 ms of the shortest pass, so a tie.
    s.submit(RequestView("L", 3000, 24, 0.0, SLO_S, "long", cached_by_engine={"s": 24}), 0.0)
    assert s.decide(ENGINES, 0.0).dispatches == (Dispatch("l", ("L",)),)


SPF = EngineTraits(LinearCost(), chunk_tokens=4096, short_first=True)


def test_on_shortest_prefill_first_engines_long_prefills_are_not_held_and_pay_for_the_prefills_they_overtake():
    engines = [EngineView("a", "long"), EngineView("b", "long")]
    s = LapsScheduler(config(), SPF)
    s.model.dispatched("a", ["big"], [(20000, 0)], 0.0)  # a is in a 20,000-token prefill
    for i in range(4):
        s.model.dispatched("b", [f"p{i}"], [(700, 0)], 0.0)  # b has 4 × 12 ms of 700-token prefills
    s.submit(long("N", 1000, 0.0), 0.0)
    # On a, N waits for a chunk (45.96 ms) and its own 15 ms, and delays the big one by what its 1,000 tokens add to a
    # full chunk pass ((45.96 - 5.01) ms / 4,096 each: 10.00 ms): 70.96 ms in all; on b it waits 48 ms for the shorter
    # ones and its own 15 ms: 63 ms. Without the charge a's 60.96 ms would be within one pass (5.01 ms) of b's, and a
    # would win the tie on list order.
    assert s.decide(engines, 0.0).dispatches == (Dispatch("b", ("N",)),)
    for i, n in enumerate((30000, 30000, 30000)):  # no gate: each goes at once
        s.submit(long(f"L{i}", n, 0.0), 0.0)
    assert len(s.decide(engines, 0.0).dispatches) == 3


def test_overtaking_a_prefill_that_misses_its_deadline_anyway_costs_nothing():
    # The case above, but a's big prefill (0.2448 s of work) was due at 0.2 s: N delaying it loses no deadline, so on a
    # N costs its 60.96 ms alone, less than b's 63 ms.
    engines = [EngineView("a", "long"), EngineView("b", "long")]
    s = LapsScheduler(config(), SPF)
    s.model.dispatched("a", ["big"], [(20000, 0)], 0.0, deadlines_s=[0.2])
    for i in range(4):
        s.model.dispatched("b", [f"p{i}"], [(700, 0)], 0.0)
    s.submit(long("N", 1000, 0.0), 0.0)
    assert s.decide(engines, 0.0).dispatches == (Dispatch("a", ("N",)),)


def test_held_long_requests_go_in_deadline_order_those_that_cannot_make_it_last():
    s = LapsScheduler(config(max_long_prefill_tokens=1000), TRAITS)
    s.submit(long("first", 3000, 0.0), 0.0)  # occupies the gate
    s.submit(RequestView("late", 3000, 0, 0.0, 2.0, "long"), 0.0)
    s.submit(RequestView("hopeless", 30000, 0, 0.0, 0.2, "long"), 0.0)  # alone it takes 8 × 5 ms + 0.3 s > 0.2 s
    s.submit(RequestView("early", 3000, 0, 0.0, 1.0, "long"), 0.0)
    assert s.decide(LONG_ONLY, 0.0).dispatches == (Dispatch("l", ("first",)),)
    order = []
    for t, rid in ((0.04, "first"), (0.08, "early"), (0.12, "late")):
        s.on_first_token(rid, "l", t, 0)
        order += [d.rids[0] for d in s.decide(LONG_ONLY, t).dispatches]
    assert order == ["early", "late", "hopeless"]


@pytest.mark.parametrize(("length_deadline_s", "order"), [(0.9, ["missed", "huge", "later"]), (None, ["missed", "later", "huge"])])
def test_a_request_that_cannot_meet_its_fixed_deadline_even_alone_is_scheduled_to_its_length_aware_one(length_deadline_s, order):
    s = LapsScheduler(config(max_long_prefill_tokens=1000), TRAITS)
    s.submit(long("first", 3000, 0.0), 0.0)  # occupies the gate
    # Alone, 30,000 tokens take 8 passes: 8 × 5 ms + 0.3 s + 0.115 s of cached context (0 + 4,096 + ... + 28,672
    # tokens at 1 µs) = 0.455 s, past 0.4 s: held by its length-aware deadline, 0.9 s, it is in time (ahead of
    # "later"); without one it cannot make 0.4 s and goes last.
    s.submit(RequestView("huge", 30000, 0, 0.0, 0.4, "long", length_deadline_s=length_deadline_s), 0.0)
    # Alone, 3,000 tokens take 35 ms: it keeps its fixed deadline, 0.4 s, not its length-aware 0.58 s.
    s.submit(RequestView("missed", 3000, 0, 0.0, 0.4, "long", length_deadline_s=0.58), 0.0)
    s.submit(RequestView("later", 3000, 0, 0.0, 1.0, "long"), 0.0)
    assert s.decide(LONG_ONLY, 0.0).dispatches == (Dispatch("l", ("first",)),)
    done = []
    for t, rid in ((0.04, "first"), (0.08, None), (0.12, None)):
        s.on_first_token(rid or done[-1], "l", t, 0)
        done += [d.rids[0] for d in s.decide(LONG_ONLY, t).dispatches]
    assert done == order


def test_service_estimate_is_an_ewma_of_dispatch_to_first_token():
    s = laps(config())
    s.submit(short("r0", 10, 0.0, deadline=0.05), 0.0)
    s.decide(ENGINES, 0.0)
    s.on_first_token("r0", "s", 0.02, 0)
    assert s.service_s == pytest.approx(0.8 * 0.010 + 0.2 * 0.020)


def test_cancel_and_reject_without_healthy_engines():
    s = laps(config())
    s.submit(short("gone", 10, 0.0), 0.0)
    s.submit(short("r", 10, 0.0), 0.0)
    s.submit(long("L", 3000, 0.0), 0.0)
    s.cancel("gone", 0.001)
    down = [EngineView("s", "short", healthy=False)]
    assert s.decide(down, 0.002) == Decision(rejected=("L", "r"))


def test_config_validation():
    with pytest.raises(ValidationError, match="initial_depth_tokens"):
        LapsConfig(token_buckets=[64, 128], initial_depth_tokens=100)
    with pytest.raises(ValidationError, match="strictly increasing"):
        LapsConfig(token_buckets=[128, 64], initial_depth_tokens=64)


def test_stats_report_queues_depth_and_triggers():
    s = laps(config())
    s.submit(short("a", 10, 0.0, deadline=0.05), 0.0)
    s.submit(short("b", 10, 0.0), 0.0)
    s.submit(long("L", 3000, 0.0), 0.0)
    s.decide([EngineView("s", "short")], 0.0)  # slack trigger takes a and b together; L goes too (temporal)
    stats = s.stats()
    assert stats["short_batches_by_slack_total"] == 1 and stats["short_requests_batched_total"] == 2
    assert (stats["queued_short_requests"], stats["queued_long_requests"], stats["awd_depth_tokens"]) == (0, 0, 64)


def test_an_engine_that_only_decodes_unstreamed_requests_is_idle_for_short_ones():
    s = LapsScheduler(config(), TRAITS)
    s.submit(RequestView("r0", 10, 0, 0.0, 0.4, "short", stream=False), 0.0)
    only = [EngineView("only", "short")]
    assert s.decide(only, 0.0) == Decision((Dispatch("only", ("r0",)),))
    # r0's first token comes only with its whole answer; past its predicted prefill (5.1 ms) the engine is idle.
    s.submit(short("r1", 10, 0.5), 0.5)
    assert s.decide(only, 0.5) == Decision((Dispatch("only", ("r1",)),)) and s.triggers["idle"] == 2


@pytest.mark.parametrize("doc_tokens, asked_s, shared, slo_s, expected", [
    # The document's prefill on l: 3 chunks, 15 ms + 0.12 s, 35 ms still to go at 0.1 s. The question (50 tokens
    # more) shares 11,968 tokens with it, of which the two chunks before its last (8,192) count: on l it waits
    # 35 ms, then 5 ms + 38.6 ms + 8.2 ms for its 3,858 other tokens (86.8 ms); on the idle s it recomputes all
    # 12,050: 15 ms + 120.5 ms.
    (12_000, 0.1, 11_968, SLO_S, "l"),
    (12_000, 0.1, 0, SLO_S, "s"),  # without the credit l would take 35 ms + 135.5 ms
    # A document of 8,000 tokens (2 chunks, 90 ms), asked about at 30 ms: only its first chunk (4,096) counts, so
    # on l the question waits 60 ms, then takes 48.6 ms (108.6 ms), later than the 90.5 ms of recomputing all on s;
    # but it is in time on l, where the 4,096 tokens are not computed twice: l.
    (8_000, 0.03, 7_968, SLO_S, "l"),
    (8_000, 0.03, 7_968, 0.1, "s"),  # due in 100 ms: in time on s alone
    (8_000, 0.03, 7_968, 0.05, "l"),  # due in 50 ms: late on both, so where it costs the others least
])
def test_a_question_joins_the_engine_prefilling_its_document_unless_only_another_has_it_in_time(
        doc_tokens, asked_s, shared, slo_s, expected):
    engines = [EngineView("s", "short"), EngineView("l", "long")]
    s = LapsScheduler(config(), TRAITS)
    s.submit(long("doc", doc_tokens, 0.0), 0.0)
    assert s.decide(engines, 0.0).dispatches == (Dispatch("l", ("doc",)),)
    question = RequestView("q", doc_tokens + 50, 0, asked_s, asked_s + slo_s, "long", in_flight_by_engine={"l": shared} if shared else {})
    s.submit(question, asked_s)
    assert s.decide(engines, asked_s).dispatches == (Dispatch(expected, ("q",)),)
    assert s.stats()["long_prefills_to_short_pool_total"] == (expected == "s")
    assert s.stats()["requests_to_in_flight_prefix_total"] == (expected == "l" and shared > 0)


@pytest.mark.parametrize("cached, shared, held", [
    (0, 8192, 4096),  # two chunks of 4,096 shared: the first is held when the request can run, the second ends with it
    (0, 8193, 8192),
    (0, 4096, 0),  # all in the prefill's last chunk: nothing more than is cached
    (1000, 9192, 5096),  # the prefill's chunks start at what is cached
    (5000, 3000, 5000),  # sharing less than is cached: what is cached
])
def test_a_prefill_in_flight_counts_its_whole_chunks_before_the_one_where_the_shared_part_ends(cached, shared, held):
    s = LapsScheduler(config(), TRAITS)  # 4,096-token chunks
    request = RequestView("q", 20_000, cached, 0.0, SLO_S, "long", cached_by_engine={"l": cached}, in_flight_by_engine={"l": shared})
    assert s._held_on(request, "l") == held
    assert s._joins_in_flight([request], "l") == (held > cached)
