"""SGLang 0.5.23 scheduler semantics of the engine model, on small hand-computed cases.

Each expected value is derived in the comments from the rules in the
docstring of engines/sim/core.py (page size 1, no overlap scheduling).
"""

from __future__ import annotations

import pytest

from engines.sim.core import EngineConfig, EngineCore, RequestEvent, StepResult
from engines.sim.latency import make_latency_model
from engines.sim.replies import ReplyPlanner
from laps.tokenizer import load_tokenizer
from policies.prefix_index import PrefixIndex, block_keys

TOK = load_tokenizer()
LATENCY = make_latency_model()
PLANNER = ReplyPlanner(TOK)


def make_core(**overrides) -> EngineCore:
    cfg = {"max_total_tokens": 100_000, "max_running_requests": 64, **overrides}
    return EngineCore(EngineConfig(**cfg), LATENCY, TOK)


def prompt(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


class Clock:
    """Steps one core in virtual time and keeps every pass and event."""

    def __init__(self, core: EngineCore) -> None:
        self.core, self.now = core, 0.0
        self.steps: list[StepResult] = []
        self.events: dict[str, list[RequestEvent]] = {}

    def step(self) -> StepResult:
        result = self.core.step(self.now)
        self.now += result.duration_s
        self.steps.append(result)
        for ev in result.events:
            self.events.setdefault(ev.rid, []).append(ev)
        return result

    def run(self) -> None:
        while self.core.has_work():
            assert not self.step().idle

    def first_token_at(self, rid: str) -> float:
        t = 0.0
        for s in self.steps:
            t += s.duration_s
            if any(ev.rid == rid and ev.first_token for ev in s.events):
                return t
        raise AssertionError(f"{rid} produced no first token")


# ---- chunked prefill ---------------------------------------------------------------------------


def test_a_long_prompt_is_prefilled_in_ceil_chunks_and_its_first_token_follows_the_last():
    clock = Clock(make_core(chunked_prefill_size=2048))
    clock.core.add_request("long", prompt(5000), 1, ignore_eos=True)
    clock.run()
    # 5000 = 2048 + 2048 + 904; each chunk attends to what the previous ones cached.
    assert [s.prefill for s in clock.steps] == [((2048, 0),), ((2048, 2048),), ((904, 4096),)]
    assert clock.first_token_at("long") == pytest.approx(sum(s.duration_s for s in clock.steps))
    assert clock.events["long"][0].cached_tokens == 0


def test_a_short_request_ahead_of_a_long_one_shares_the_first_chunk():
    clock = Clock(make_core(chunked_prefill_size=1024))
    clock.core.add_request("short", prompt(100, 9000), 1, ignore_eos=True)
    clock.core.add_request("long", prompt(1500), 1, ignore_eos=True)
    clock.run()
    # Pass 1: short takes 100 of the 1024-token chunk; long gets the other 924. Pass 2: 1500 − 924 = 576.
    assert [s.prefill for s in clock.steps] == [((100, 0), (924, 0)), ((576, 924),)]


def test_fcfs_keeps_short_requests_behind_a_running_chunk_but_shortest_prefill_first_caps_it():
    def scenario(policy: str) -> list[tuple]:
        clock = Clock(make_core(chunked_prefill_size=1024, schedule_policy=policy))
        clock.core.add_request("long", prompt(3000), 1, ignore_eos=True)
        clock.step()  # pass 1: (1024, 0); the long prompt is now the chunked request
        for i in range(3):
            clock.core.add_request(f"s{i}", prompt(100, 10_000 * (i + 1)), 1, ignore_eos=True, now=clock.now)
        clock.run()
        return [s.prefill for s in clock.steps]

    # fcfs: the chunk continues alone (1024), then 952 more leave 72 tokens, so s0 is cut at 72 and
    # becomes the chunked request; its last 28 tokens ride with s1 and s2.
    assert scenario("fcfs") == [((1024, 0),), ((1024, 1024),), ((952, 2048), (72, 0)), ((28, 72), (100, 0), (100, 0))]
    # shortest-prefill-first: 1976 tokens remain of the long one; the three shorts (100 each, each
    # under 1976) reserve 300 of the 1024-token budget, so the chunk is capped at 724.
    assert scenario("shortest-prefill-first") == [
        ((1024, 0),), ((724, 1024), (100, 0), (100, 0), (100, 0)), ((1024, 1748),), ((228, 2772),)]


def test_max_prefill_tokens_limits_a_batch_but_not_its_first_request_without_chunking():
    core = make_core(max_prefill_tokens=1000, chunked_prefill_size=None)
    core.add_request("a", prompt(1200), 1, ignore_eos=True)
    core.add_request("b", prompt(10, 5000), 1, ignore_eos=True)
    assert core.step(0.0).prefill == ((1200, 0),)
    assert core.step(1.0).prefill == ((10, 0),)


# ---- waiting-queue order -----------------------------------------------------------------------


def test_lpm_admits_the_longest_cached_prefix_first():
    core = make_core(schedule_policy="lpm", max_running_requests=1)
    shared = prompt(80)
    core.add_request("warm", shared + [7], 1, ignore_eos=True)
    Clock(core).run()  # caches the 80 shared tokens (+ the 81st)
    core.add_request("cold", prompt(50, 50_000), 1, ignore_eos=True)
    core.add_request("hot", shared + prompt(20, 60_000), 1, ignore_eos=True)
    # One slot: lpm sorts hot (80 cached) before cold (0); fcfs would take cold.
    assert core.step(0.0).prefill == ((20, 80),)


def test_hrrn_favours_the_request_that_waited_longest_per_uncached_token():
    def first_admitted(policy: str) -> str:
        core = make_core(schedule_policy=policy, max_running_requests=1)
        core.add_request("head", prompt(300), 3, ignore_eos=True)
        core.add_request("x", prompt(400, 5000), 1, ignore_eos=True)
        clock = Clock(core)
        clock.step()  # head's prefill: 300 tokens processed
        core.add_request("y", prompt(100, 9000), 1, ignore_eos=True, now=clock.now)
        clock.run()
        return next(ev.rid for s in clock.steps[1:] for ev in s.events if ev.first_token)

    # hrrn: x waited 300 processed tokens for 400 uncached (ratio 0.75), y 0 for 100 (0).
    assert first_admitted("hrrn") == "x"
    assert first_admitted("shortest-prefill-first") == "y"


def test_late_requests_last_puts_requests_past_their_objective_behind_those_in_time():
    def admitted(**late_last) -> list[tuple[int, int]]:
        core = make_core(schedule_policy="shortest-prefill-first", max_prefill_tokens=1000, chunked_prefill_size=None,
                         **late_last)
        core.add_request("old-short", prompt(100), 1, ignore_eos=True, now=0.0)
        core.add_request("old-long", prompt(2000, 5000), 1, ignore_eos=True, now=0.0)
        core.add_request("new-mid", prompt(600, 9000), 1, ignore_eos=True, now=0.5)
        core.add_request("new-long", prompt(900, 12000), 1, ignore_eos=True, now=0.5)
        return [core.step(t).prefill for t in (0.6, 0.7, 0.8)]

    # SGLang's order: fewest uncached tokens first, whatever the wait; at most 1,000 new tokens per batch (without
    # chunking the first request of a batch goes in whole), and a batch stops at the first request that does not fit.
    assert admitted() == [((100, 0), (600, 0)), ((900, 0),), ((2000, 0),)]
    # From 0.6 s both old requests have waited past a 0.4 s objective: the new ones (0.1 s) go first, then the late
    # ones shortest first.
    assert admitted(late_last_ttft_s=0.4) == [((600, 0),), ((900, 0),), ((100, 0),)]
    # 1 s more per 1,000 new tokens: old-short (0.4 + 0.1 s) is late, old-long (0.4 + 2.0 s) is not, so old-long
    # sorts with the in-time requests by its 2,000 tokens and goes before old-short.
    assert admitted(late_last_ttft_s=0.4, late_last_per_1k_s=1.0) == [((600, 0),), ((900, 0),), ((2000, 0),)]
    assert admitted(late_last_ttft_s=0.9) == admitted()  # nobody late: the oldest has waited 0.8 s at the last pass
    with pytest.raises(ValueError, match="late_last_ttft_s must be > 0"):
        EngineConfig(100, 8, late_last_ttft_s=0.0)


def test_deadline_order_serves_a_long_prefill_before_later_shorter_ones_while_all_can_be_in_time():
    def admitted(**deadline_order) -> list[tuple[int, int]]:
        core = make_core(schedule_policy="shortest-prefill-first", max_prefill_tokens=1000, chunked_prefill_size=None,
                         late_last_ttft_s=0.4, **deadline_order)
        core.add_request("long", prompt(900), 1, ignore_eos=True, now=0.0)
        core.add_request("mid", prompt(300, 5000), 1, ignore_eos=True, now=0.1)
        core.add_request("short", prompt(50, 9000), 1, ignore_eos=True, now=0.1)
        return [core.step(t).prefill for t in (0.15, 0.2)]

    # Shortest first: short and mid fill 350 of the 1,000 tokens, long does not fit behind them and waits a pass.
    spf = [((50, 0), (300, 0)), ((900, 0),)]
    assert admitted() == spf
    # Deadline order above 100 tokens: short (50 tokens) keeps its place, then long (deadline 0.4 s) before mid
    # (0.5 s). At 0.1 s per 1,000 tokens the three end by 0.15 + 1.25 × 0.1 = 0.275 s, all in time, so that order
    # stands; at 1 s per 1,000 long would end at 0.15 + 0.95 = 1.1 s, past its deadline, and moves behind mid, which
    # then ends at 0.5 s, in time: here the shortest-first order.
    assert admitted(late_last_deadline_order_tokens=100, late_last_prefill_s_per_1k=0.1) == [((50, 0), (900, 0)), ((300, 0),)]
    assert admitted(late_last_deadline_order_tokens=100, late_last_prefill_s_per_1k=1.0) == spf
    # Above 1,000 tokens every request keeps its shortest-first place.
    assert admitted(late_last_deadline_order_tokens=1000, late_last_prefill_s_per_1k=0.1) == spf
    with pytest.raises(ValueError, match="needs late_last_ttft_s and late_last_prefill_s_per_1k > 0"):
        EngineConfig(100, 8, late_last_deadline_order_tokens=100, late_last_prefill_s_per_1k=0.1)
    with pytest.raises(ValueError, match="needs late_last_ttft_s and late_last_prefill_s_per_1k > 0"):
        EngineConfig(100, 8, late_last_ttft_s=0.4, late_last_deadline_order_tokens=100)


def test_deadline_order_counts_the_chunked_prefill_in_progress_and_puts_a_late_request_behind_those_in_time():
    def passes(rate: float, late: bool = False) -> list[tuple[tuple[int, int], ...]]:
        core = make_core(schedule_policy="shortest-prefill-first", max_prefill_tokens=1000, chunked_prefill_size=1000,
                         late_last_ttft_s=0.4, late_last_deadline_order_tokens=100, late_last_prefill_s_per_1k=rate)
        core.add_request("doc", prompt(3000, 20000), 1, ignore_eos=True, now=0.0)
        core.step(0.0)  # the document's first 1,000-token chunk: 2,000 tokens left
        core.add_request("long", prompt(900), 1, ignore_eos=True, now=0.0)
        core.add_request("mid", prompt(300, 5000), 1, ignore_eos=True, now=0.1)
        core.add_request("short", prompt(50, 9000), 1, ignore_eos=True, now=0.1)
        if late:
            core.add_request("late", prompt(20, 12000), 1, ignore_eos=True, now=-1.0)
        return [core.step(t).prefill for t in (0.15, 0.2)]

    # At 0.05 s per 1,000 the document's 2,000 tokens end at 0.25 s, then short, then long at 0.2975 s (its deadline
    # 0.4 s), then mid: all in time, so long goes before mid (the document's chunk shrinks to leave them room).
    assert passes(0.05)[0] == ((50, 1000), (50, 0), (900, 0))
    # At 0.1 s per 1,000 long would end at 0.15 + 0.2 + 0.005 + 0.09 = 0.445 s, past its deadline: it moves behind
    # mid (which ends at 0.385 s, in time). Without the document's tokens it would have ended at 0.245 s, in time.
    assert passes(0.1)[0] == ((650, 1000), (50, 0), (300, 0))
    # A request already late (it entered at -1 s) goes behind them all; those in time keep the deadline order.
    assert passes(0.05, late=True) == [((50, 1000), (50, 0), (900, 0)), ((680, 1050), (300, 0), (20, 0))]


def test_short_pass_holds_a_short_request_behind_a_long_prefill_to_the_short_threshold_not_a_whole_chunk():
    def passes(short_pass: int | None, shorts: tuple[int, ...] = (100,), late: bool = False) -> list[tuple]:
        core = make_core(schedule_policy="shortest-prefill-first", chunked_prefill_size=1024, late_last_ttft_s=0.4,
                         late_last_deadline_order_tokens=255, late_last_prefill_s_per_1k=0.02,
                         late_last_short_pass_tokens=short_pass)
        clock = Clock(core)
        core.add_request("long", prompt(3000), 1, ignore_eos=True)
        clock.step()  # the long prompt's first chunk: 1,976 tokens left
        for i, n in enumerate(shorts):
            core.add_request(f"s{i}", prompt(n, 10_000 * (i + 1)), 1, ignore_eos=True, now=clock.now - (1.0 if late else 0))
        clock.step()
        clock.step()
        return [s.prefill for s in clock.steps]

    # shortest-prefill-first fills the short request's pass to the chunk with 924 of the long prompt's tokens.
    assert passes(None) == [((1024, 0),), ((924, 1024), (100, 0)), ((1024, 1948),)]
    # Short pass at 256 tokens: the pass holds the short request and 156 of the long prompt's; then whole chunks.
    assert passes(256) == [((1024, 0),), ((156, 1024), (100, 0)), ((1024, 1180),)]
    # The short requests waiting in time need more than 256: their 300 tokens and one of the long prompt's.
    assert passes(256, (100, 200)) == [((1024, 0),), ((1, 1024), (100, 0), (200, 0)), ((1024, 1025),)]
    # 176 tokens left of a 1,200-token prompt, fewer than the 200-token short request's: SGLang's limit reserves nothing
    # then and the chunk takes its 176, so the pass holds 176 + 200 and the short request goes in whole (not cut at 80).
    core = make_core(schedule_policy="shortest-prefill-first", chunked_prefill_size=1024, late_last_ttft_s=0.4,
                     late_last_deadline_order_tokens=255, late_last_prefill_s_per_1k=0.02, late_last_short_pass_tokens=256)
    clock = Clock(core)
    core.add_request("long", prompt(1200), 1, ignore_eos=True)
    clock.step()
    core.add_request("s0", prompt(200, 10_000), 1, ignore_eos=True, now=clock.now)
    assert clock.step().prefill == ((176, 1024), (200, 0))
    # A late short request leaves the pass to the chunk, as without the rule.
    assert passes(256, late=True) == passes(None)
    with pytest.raises(ValueError, match="late_last_short_pass_tokens must be >= 1 and needs late_last_deadline_order"):
        EngineConfig(100, 8, late_last_ttft_s=0.4, late_last_short_pass_tokens=256)
    with pytest.raises(ValueError, match="late_last_short_pass_tokens must be >= 1"):
        EngineConfig(100, 8, late_last_ttft_s=0.4, late_last_deadline_order_tokens=255, late_last_prefill_s_per_1k=0.02,
                     late_last_short_pass_tokens=0)


def test_priority_scheduling_sorts_by_priority_and_preempts_the_lowest_running_one():
    core = make_core(enable_priority_scheduling=True, max_running_requests=2)
    clock = Clock(core)
    core.add_request("low-a", prompt(50, 1000), 100, ignore_eos=True, priority=1)
    core.add_request("low-b", prompt(50, 2000), 100, ignore_eos=True, priority=2)
    core.add_request("mid", prompt(50, 3000), 100, ignore_eos=True, priority=5)
    clock.step()
    # Higher values first: mid (5) and low-b (2) take the two slots; low-a waits.
    assert {ev.rid for ev in clock.steps[0].events} == {"mid", "low-b"}
    core.add_request("urgent", prompt(60, 4000), 5, ignore_eos=True, now=clock.now, priority=20)
    clock.step()
    # Slots full: urgent (20) outranks low-b (2) by more than the threshold of 10 and outranks mid (5) too;
    # the lowest priority goes first and freeing it makes room, so only low-b is preempted.
    assert clock.steps[1].prefill == ((60, 0),)
    assert [r.rid for r in core._waiting] == ["low-a", "low-b"]  # low-b requeued behind low-a
    clock.run()
    # Releasing low-b evicts 20 cache tokens per request still running (mid): leaves go whole, so its
    # 50-token prompt is gone. When urgent finishes (pass 5), low-b (2) goes before low-a (1), prefilled
    # again with its first token: 51 tokens, none cached; low-a follows when mid finishes.
    assert [(i, s.prefill) for i, s in enumerate(clock.steps) if s.prefill][2:] == [(6, ((51, 0),)), (102, ((50, 0),))]
    for rid, n in (("low-a", 100), ("low-b", 100), ("mid", 100), ("urgent", 5)):
        assert clock.events[rid][-1].completion_tokens == n
        assert sum(ev.first_token for ev in clock.events[rid]) == 1


def test_priority_scheduling_needs_fcfs_or_lof_and_priority_is_not_a_policy():
    with pytest.raises(ValueError, match="must be 'fcfs' or 'lof'"):
        EngineConfig(100, 8, schedule_policy="lpm", enable_priority_scheduling=True)
    with pytest.raises(ValueError, match="Unknown schedule_policy"):
        EngineConfig(100, 8, schedule_policy="priority")
    with pytest.raises(ValueError, match="implements"):
        EngineConfig(100, 8, schedule_policy="dfs-weight")


# ---- KV pool: retraction -----------------------------------------------------------------------


def test_retraction_takes_fewest_outputs_then_longest_prompt_and_reprefills_with_the_reply():
    # Natural replies of at least 200 tokens, so each of the three runs to max_new_tokens = 200.
    a, b, c = [r for r in (f"r{i}" for i in range(5000)) if PLANNER.natural_length(r) >= 200][:3]
    # ratio 0.7 · 0.1 = 0.07: running requests are reserved only 7% of their remaining tokens.
    core = make_core(max_total_tokens=800, max_running_requests=8, chunked_prefill_size=256,
                     schedule_conservativeness=0.1)
    clock = Clock(core)
    core.add_request(a, prompt(100, 1000), 200)
    for _ in range(21):  # pass 0 prefills a; passes 1-20 decode it to 21 tokens
        clock.step()
    core.add_request(b, prompt(120, 5000), 200, now=clock.now)
    core.add_request(c, prompt(80, 9000), 200, now=clock.now)
    # Pass 21: b needs 120 + 200 + 1 = 321 < 800 − 100 − 20 − 0.07·179 = 667.5; c then 281 < 667.5 − 321 = 346.5.
    assert clock.step().prefill == ((120, 0), (80, 0))
    # Now 300 prompt tokens are pinned and a holds 20 decode tokens: 480 free. Each decode pass takes 3,
    # so passes 22-181 fit (160 · 3 = 480) and pass 182 finds 0 free with a at 181 tokens, b and c at 161.
    for _ in range(160):
        assert clock.step().num_decode_seqs == 3
    assert core.stats().num_retracted_reqs == 0
    step = clock.step()
    # Retraction order: fewest outputs first (b, c: 161 < a: 181), ties the longest prompt (b: 120 > c: 80);
    # freeing b (160 decode tokens) leaves room for two, so only b goes.
    assert core.stats().num_retracted_reqs == 1 and step.num_decode_seqs == 2
    assert [r.rid for r in core._waiting] == [b]
    # The new ratio, from the two left before this pass decodes: (181 + 161 + 20·2) / (200 + 200 + 1).
    assert core.stats().new_token_ratio == pytest.approx(382 / 401)
    clock.run()
    # b's 120-token prefix was evicted with it (20 tokens per remaining request); it is prefilled again
    # with its 161 tokens of reply: 281 tokens in 256-token chunks.
    assert ((256, 0),) in [s.prefill for s in clock.steps] and ((25, 256),) in [s.prefill for s in clock.steps]
    for rid in (a, b, c):
        evs = clock.events[rid]
        assert evs[-1].finish_reason == "length" and evs[-1].completion_tokens == 200
        assert sum(ev.first_token for ev in evs) == 1
        assert len([t for ev in evs for t in ev.new_token_ids]) == 200
    assert core.stats().num_used_tokens == 0


def test_decode_alone_that_cannot_fit_is_aborted():
    a = next(r for r in (f"r{i}" for i in range(5000)) if PLANNER.natural_length(r) >= 100)
    core = make_core(max_total_tokens=120, schedule_conservativeness=0.1)
    core.add_request(a, prompt(60), 100)  # max_new clipped on arrival to 120 − 60 − 2 = 58
    clock = Clock(core)
    clock.run()
    assert clock.events[a][-1].completion_tokens == 58 and clock.events[a][-1].finish_reason == "length"


# ---- prefix cache across turns -----------------------------------------------------------------


def test_prefix_hits_after_a_two_turn_conversation():
    core = make_core()
    index = PrefixIndex(block_tokens=16)
    user1 = [{"role": "user", "content": "Tell me about the harbour."}]
    p1 = TOK.encode_chat(user1)
    assert len(p1) == 35  # system prompt and user header 24, content 6, end and assistant header 5
    clock = Clock(core)
    core.add_request("conv-0/0", p1, 64)
    clock.run()
    reply = [t for ev in clock.events["conv-0/0"] for t in ev.new_token_ids]
    assert len(reply) == 20 and reply[-1] == 151645  # 19 text tokens and <|im_end|>
    assert clock.events["conv-0/0"][-1].cached_tokens == 0
    text = TOK.decode(reply[:-1])
    index.observe("e0", block_keys(p1 + TOK.encode(text), 16), 0)  # as the gateway records a finished turn
    p2 = TOK.encode_chat(user1 + [{"role": "assistant", "content": text}, {"role": "user", "content": "And the ferry?"}])
    # The cache holds prompt and reply but the last token: 35 + 19 = 54, and the re-tokenized
    # history reproduces those 54 ids; <|im_end|> (sampled last, never fed back) is not cached.
    assert p2[:54] == p1 + reply[:-1]
    # The gateway's index knows turn 1's prompt and re-encoded reply: three full 16-token blocks of the 54.
    assert index.cached_tokens("e0", block_keys(p2, 16)) == 48
    core.add_request("conv-0/1", p2, 1, ignore_eos=True, now=clock.now)
    # Another conversation shares the 24-token system prompt and user header.
    core.add_request("conv-1/0", TOK.encode_chat([{"role": "user", "content": "What is the ferry timetable?"}]), 1,
                     ignore_eos=True, now=clock.now)
    clock.run()
    assert clock.events["conv-0/1"][0].cached_tokens == 54
    assert clock.events["conv-1/0"][0].cached_tokens == 24
    assert clock.steps[-1].prefill == ((len(p2) - 54, 54), (35 - 24, 24))
