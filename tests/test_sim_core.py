"""The simulated engine's pure batching core (engines/sim/core.py), driven in virtual time."""

from __future__ import annotations

import itertools
import random
import statistics

import pytest

from engines.sim.core import EngineConfig, EngineCore, RequestEvent, StepResult
from engines.sim.latency import make_latency_model
from engines.sim.replies import ReplyPlanner
from laps.tokenizer import load_tokenizer

TOK = load_tokenizer()
LATENCY = make_latency_model()


def make_core(**overrides) -> EngineCore:
    cfg = {"max_total_tokens": 100_000, "max_running_requests": 64, **overrides}
    return EngineCore(EngineConfig(**cfg), LATENCY, TOK)


def prompt(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def run(core: EngineCore, now: float = 0.0, steps: list[StepResult] | None = None) -> tuple[dict[str, list[RequestEvent]], float]:
    """Step until idle; returns the events by rid and the end time."""
    events: dict[str, list[RequestEvent]] = {}
    while core.has_work():
        result = core.step(now)
        assert not result.idle
        if steps is not None:
            steps.append(result)
        now += result.duration_s
        for ev in result.events:
            events.setdefault(ev.rid, []).append(ev)
    return events, now


def output_ids(events: list[RequestEvent]) -> list[int]:
    return [t for ev in events for t in ev.new_token_ids]


def test_chunked_prefill_splits_a_long_prompt_into_ceil_chunks():
    core = make_core(chunked_prefill_size=2048)
    core.add_request("long", prompt(5000), 1, ignore_eos=True)
    steps: list[StepResult] = []
    events, _ = run(core, steps=steps)
    assert [s.prefill for s in steps] == [((2048, 0),), ((2048, 2048),), ((904, 4096),)]
    assert [ev.first_token for ev in events["long"]] == [True]
    assert events["long"][-1].finish_reason == "length"


def test_a_short_request_joins_the_batch_after_the_last_chunk():
    core = make_core(chunked_prefill_size=1024)
    core.add_request("long", prompt(1500), 1, ignore_eos=True)
    core.add_request("short", prompt(100, 9000), 1, ignore_eos=True)
    first, second = core.step(0.0), core.step(1.0)
    assert first.prefill == ((1024, 0),)
    assert second.prefill == ((476, 1024), (100, 0))


def test_max_prefill_tokens_limits_a_batch_but_not_its_first_request():
    core = make_core(max_prefill_tokens=1000, chunked_prefill_size=None)
    core.add_request("a", prompt(1200), 1, ignore_eos=True)
    core.add_request("b", prompt(10, 5000), 1, ignore_eos=True)
    assert core.step(0.0).prefill == ((1200, 0),)
    assert core.step(1.0).prefill == ((10, 0),)


def test_max_running_requests_is_respected():
    core = make_core(max_running_requests=2)
    for i in range(5):
        core.add_request(f"r{i}", prompt(50, 1000 * (i + 1)), 6, ignore_eos=True)
    steps: list[StepResult] = []
    events, _ = run(core, steps=steps)
    assert steps[0].num_prefill_seqs == 2
    assert max(s.num_prefill_seqs + s.num_decode_seqs for s in steps) == 2
    assert all(len(output_ids(evs)) == 6 for evs in events.values())


def test_prefix_cache_hit_on_a_shared_prefix():
    core = make_core()
    shared = prompt(80)
    core.add_request("a", shared + prompt(20, 50_000), 3, ignore_eos=True)
    _, now = run(core)
    core.add_request("b", shared + prompt(30, 60_000), 3, ignore_eos=True, now=now)
    core.add_request("c", shared + prompt(20, 50_000), 3, ignore_eos=True, now=now)
    events, _ = run(core, now)
    assert events["b"][0].cached_tokens == 80
    assert events["c"][0].cached_tokens == 99  # a whole prompt hit still computes its last token
    assert events["b"][0].prompt_tokens == 110


def test_a_running_requests_prompt_is_already_cached():
    core = make_core()
    core.add_request("a", prompt(200), 50, ignore_eos=True)
    core.step(0.0)  # a's prefill, inserted into the cache
    core.add_request("b", prompt(200) + [7], 2, ignore_eos=True, now=0.01)
    events, _ = run(core, 0.01)
    assert events["b"][0].cached_tokens == 200


def test_lru_eviction_when_the_pool_is_full():
    def scenario(touch_a: bool) -> EngineCore:
        core = make_core(max_total_tokens=300)
        a, b, c = prompt(100, 1000), prompt(100, 2000), prompt(150, 3000)
        now = 0.0
        for rid, ids in (("a", a), ("b", b)):
            core.add_request(rid, ids, 5, ignore_eos=True, now=now)
            _, now = run(core, now)
        assert core.tree.total_size == 2 * 104  # prompt + reply minus its last token
        if touch_a:
            core.add_request("a2", a, 1, ignore_eos=True, now=now)
            _, now = run(core, now)
        core.add_request("c", c, 1, ignore_eos=True, now=now)
        run(core, now)
        return core

    core = scenario(touch_a=False)
    assert core.tree.peek_prefix(prompt(100, 1000)) == 0  # a: least recently used, evicted
    assert core.tree.peek_prefix(prompt(100, 2000)) == 100
    core = scenario(touch_a=True)
    assert core.tree.peek_prefix(prompt(100, 1000)) == 100
    assert core.tree.peek_prefix(prompt(100, 2000)) == 0


def test_ignore_eos_gives_exactly_max_new_tokens():
    core = make_core()
    core.add_request("x", prompt(20), 37, ignore_eos=True)
    events, _ = run(core)
    ids = output_ids(events["x"])
    assert len(ids) == 37 == events["x"][-1].completion_tokens
    assert core.eos_token_id not in ids
    assert events["x"][-1].finish_reason == "length"


def test_natural_replies_end_with_eos_and_look_like_chat_replies():
    planner = ReplyPlanner(TOK)
    lengths = [planner.natural_length(f"req-{i}") for i in range(3000)]
    assert statistics.median(lengths) == pytest.approx(30, abs=3)
    assert statistics.mean(lengths) == pytest.approx(40, abs=4)
    core = make_core()
    core.add_request("chat", prompt(20), 1000)
    events, _ = run(core)
    ids = output_ids(events["chat"])
    assert ids[-1] == core.eos_token_id == 151645
    assert len(ids) == planner.natural_length("chat") + 1
    assert events["chat"][-1].finish_reason == "stop"
    assert events["chat"][-1].matched_stop == 151645
    text = TOK.decode(ids[:-1])
    assert text.isascii() and text[0].isupper()


def test_natural_reply_capped_by_max_new_tokens_finishes_by_length():
    core = make_core()
    core.add_request("capped", prompt(20), 2)
    events, _ = run(core)
    assert len(output_ids(events["capped"])) == 2
    assert events["capped"][-1].finish_reason == "length"


def test_stop_string_finishes_the_request_where_it_completes():
    planner = ReplyPlanner(TOK)
    reply = list(planner.plan("s", 60, True).token_ids)
    stop = TOK.decode(reply[10:12]).strip()
    expected = next(k for k in range(1, 61) if stop in TOK.decode(reply[:k]))
    core = make_core()
    core.add_request("s", prompt(20), 60, ignore_eos=True, stop=["never-in-text", stop])
    events, _ = run(core)
    last = events["s"][-1]
    assert (last.finish_reason, last.matched_stop, last.completion_tokens) == ("stop", stop, expected)


def test_abort_in_queue_and_while_running_frees_everything():
    core = make_core(max_running_requests=1)
    core.add_request("run", prompt(100), 50, ignore_eos=True)
    core.add_request("wait", prompt(100, 5000), 50, ignore_eos=True)
    core.step(0.0)
    core.step(0.01)
    waiting = core.abort("wait")
    running = core.abort("run")
    assert waiting is not None and (waiting.finish_reason, waiting.completion_tokens) == ("abort", 0)
    assert running is not None and (running.finish_reason, running.completion_tokens) == ("abort", 2)
    assert core.abort("run") is None and core.abort("nobody") is None
    assert not core.has_work()
    assert core.stats().num_used_tokens == 0
    assert core.tree.protected_size == 0


def test_flush_cache_only_when_idle():
    core = make_core()
    core.add_request("a", prompt(50), 2, ignore_eos=True)
    assert not core.flush_cache()
    run(core)
    assert core.tree.total_size > 0
    assert core.flush_cache()
    assert core.tree.total_size == 0


def test_default_policy_does_not_mix_prefill_and_decode_but_mixed_chunk_does():
    for mixed in (False, True):
        core = make_core(enable_mixed_chunk=mixed)
        core.add_request("a", prompt(50), 10, ignore_eos=True)
        core.step(0.0)
        core.add_request("b", prompt(50, 5000), 10, ignore_eos=True, now=0.01)
        step = core.step(0.01)
        assert (step.num_prefill_seqs, step.num_decode_seqs) == ((1, 1) if mixed else (1, 0))


@pytest.mark.parametrize(("min_bs", "passes"), [(2, [(0, 2), (0, 2), (1, 0)]), (3, [(1, 0), (0, 3), (0, 3)])])
def test_prefill_decode_interval_owes_decode_passes_after_a_prefill_while_enough_requests_run(min_bs, passes):
    """SGLang's ``--prefill-decode-interval 2``: after a prefill pass, two decode passes before the next prefill while
    at least ``--prefill-decode-interval-min-bs`` requests run (two here); with fewer, prefill at once."""
    core = make_core(prefill_decode_interval=2, prefill_decode_interval_min_bs=min_bs)
    assert passes_after_one_prefill(core, 50, [[50], [], []]) == passes


def passes_after_one_prefill(core: EngineCore, first_tokens: int, arriving: list[list[int]]) -> list[tuple[int, int]]:
    """(prefill seqs, decode seqs) of the passes after one prefill pass of two prompts of ``first_tokens`` each (20
    tokens to generate, as every request here): one pass for each item of ``arriving``, the prompts (their tokens)
    that arrive just before it."""
    core.add_request("a", prompt(first_tokens), 20, ignore_eos=True)
    core.add_request("b", prompt(first_tokens, 5000), 20, ignore_eos=True)
    now = core.step(0.0).duration_s
    seen, rids = [], itertools.count()
    for prompts in arriving:
        for tokens in prompts:
            i = next(rids)
            core.add_request(f"r{i}", prompt(tokens, 9000 + 1000 * i), 20, ignore_eos=True, now=now)
        step = core.step(now)
        seen.append((step.num_prefill_seqs, step.num_decode_seqs))
        now += step.duration_s
    return seen


@pytest.mark.parametrize(("waiting", "chunk", "passes"), [
    ([50], None, [(0, 2), (1, 0), (0, 3)]),  # only a short prompt waits: the owed decode pass runs first
    ([50, 200], None, [(2, 0), (0, 4), (0, 4)]),  # one of 200 new tokens waits too: prefill at once
    # chunk 30: b is cut in the first pass, so a chunked prefill is in progress: its rest and the short prompt's first
    # 20 tokens at once, then its rest (in progress again), then the decode pass (SGLang's interval alone: (0, 1) first).
    # A short prompt cut at a full pass's boundary drops the turn too: more waited than one pass holds (the backlog
    # throttle the README's Decode under a burst measures; judging the cut prompt by its short rest cost hh-rlhf 1.0x)
    ([50], 30, [(2, 0), (1, 0), (0, 3)]),
])
def test_decode_turns_keep_the_owed_decode_pass_only_while_just_short_prompts_wait_and_no_chunk_is_in_progress(
        waiting, chunk, passes):
    """laps' plugin's decode turns (``decode_turn_short_tokens`` 100): SGLang's interval (1 decode pass
    after a prefill pass) holds while every waiting request has at most 100 new tokens and no chunked prefill is in
    progress; else the owed pass is dropped. Passes as (prefill seqs, decode seqs)."""
    core = make_core(prefill_decode_interval=1, decode_turn_short_tokens=100,
                     **({} if chunk is None else {"chunked_prefill_size": chunk}))
    assert passes_after_one_prefill(core, 20, [waiting, [], []]) == passes


def test_decode_turns_drop_what_is_still_owed_when_a_long_prompt_arrives_between_owed_passes():
    """Interval 2, short at most 100 new tokens: after the first owed decode pass a 200-token prompt arrives, and the
    second owed pass is dropped (both waiting prompts prefill together); below min-bs nothing is owed at all."""
    core = make_core(prefill_decode_interval=2, decode_turn_short_tokens=100)
    assert passes_after_one_prefill(core, 20, [[50], [200], [], []]) == [(0, 2), (2, 0), (0, 4), (0, 4)]
    few = make_core(prefill_decode_interval=2, prefill_decode_interval_min_bs=3, decode_turn_short_tokens=100)
    assert passes_after_one_prefill(few, 20, [[50]]) == [(1, 0)]  # 2 running, fewer than 3: prefill at once


def test_decode_turns_need_a_token_count_of_at_least_zero():
    with pytest.raises(ValueError, match="decode_turn_short_tokens must be >= 0"):
        make_core(prefill_decode_interval=1, decode_turn_short_tokens=-1)


@pytest.mark.parametrize("flag", ["prefill_decode_interval", "prefill_decode_interval_min_bs"])
def test_a_negative_prefill_decode_interval_is_refused_as_sglang_does(flag):
    with pytest.raises(ValueError, match="must be non-negative"):
        make_core(**{flag: -1})


def test_max_new_tokens_zero_is_prefill_only():
    core = make_core()
    core.add_request("p", prompt(300), 0)
    events, _ = run(core)
    assert [(ev.first_token, ev.finish_reason, ev.completion_tokens) for ev in events["p"]] == [(True, "length", 0)]


@pytest.mark.parametrize(
    ("n", "max_new", "match"),
    [(0, 5, "empty"), (4096, 1, "longer than the model's context length"),
     (4000, 200, "exceeds the model's maximum context length")],
)
def test_requests_that_do_not_fit_are_refused(n, max_new, match):
    core = make_core(context_length=4096)
    with pytest.raises(ValueError, match=match):
        core.add_request("x", prompt(n), max_new)


def test_duplicate_rid_is_refused():
    core = make_core()
    core.add_request("x", prompt(5), 1)
    with pytest.raises(ValueError, match="Duplicate"):
        core.add_request("x", prompt(5), 1)


def test_same_inputs_same_outputs():
    def once() -> tuple[list[StepResult], dict]:
        core = make_core(max_total_tokens=2000, chunked_prefill_size=256, max_running_requests=4)
        for i in range(8):
            core.add_request(f"req-{i}", prompt(50 + 40 * i, 100 * i), 30 + i, ignore_eos=i % 2 == 0, now=0.001 * i)
        steps: list[StepResult] = []
        events, _ = run(core, steps=steps)
        return steps, events

    assert once() == once()


def test_stats_report_queue_and_usage():
    core = make_core(max_running_requests=1)
    core.add_request("a", prompt(100), 5, ignore_eos=True)
    core.add_request("b", prompt(100), 5, ignore_eos=True)
    core.step(0.0)
    stats = core.stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 1)
    # b was matched on arrival, before a's prompt was cached (SGLang reports its last match too).
    assert stats.num_waiting_uncached_tokens == 100
    core.add_request("c", prompt(100), 5, ignore_eos=True, now=0.01)
    assert core.stats().num_waiting_uncached_tokens == 100 + 1  # c: all cached but its last token
    assert stats.num_used_tokens == 100
    assert stats.token_usage == pytest.approx(100 / 100_000)


def test_aborting_a_request_that_failed_admission_leaves_other_locks_alone():
    core = make_core(max_total_tokens=1000, max_running_requests=8)
    core.add_request("a", prompt(300), 500, ignore_eos=True)
    core.step(0.0)
    # b shares a's first 200 tokens but does not fit next to a's 500-token reservation.
    core.add_request("b", prompt(200) + prompt(300, 5000), 500, ignore_eos=True, now=0.1)
    assert core.step(0.1).num_decode_seqs == 1
    core.abort("b")
    assert core.tree.protected_size == 300  # a's prompt stays pinned


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "shortest-prefill-first", "hrrn", "lof", "random"])
def test_pool_accounting_holds_under_random_load_and_aborts(policy):
    rng = random.Random(policy)
    core = make_core(max_total_tokens=3000, max_running_requests=6, chunked_prefill_size=256, schedule_policy=policy,
                     schedule_conservativeness=0.3)
    shared = prompt(120, 70_000)
    now, n = 0.0, 0
    for _ in range(400):
        if rng.random() < 0.3:
            base = shared if rng.random() < 0.5 else []
            core.add_request(f"r{n}", base + prompt(rng.randint(5, 400), 1000 * n), rng.randint(1, 300), now=now)
            n += 1
        if rng.random() < 0.05 and core._reqs:
            core.abort(rng.choice(sorted(core._reqs)))
        result = core.step(now)
        now += result.duration_s or 0.001
        stats = core.stats()
        assert stats.num_used_tokens + stats.evictable_tokens <= 3000
        assert core.tree.protected_size == sum(len(node.key) for node in _locked_nodes(core.tree.root))
    while core.has_work():
        result = core.step(now)
        assert not result.idle  # an engine with work always makes progress
        now += result.duration_s
    assert core.tree.protected_size == 0 and core.stats().num_used_tokens == 0


def _locked_nodes(root):
    stack, out = list(root.children.values()), []
    while stack:
        node = stack.pop()
        if node.lock_ref:
            out.append(node)
        stack.extend(node.children.values())
    return out
