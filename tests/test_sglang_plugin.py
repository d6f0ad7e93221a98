"""laps' SGLang plugin (``engines/sglang_plugin``): SGLang 0.5.23 loads it from PYTHONPATH and its
shortest-prefill-first order then puts requests that have missed their TTFT objective last."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.manager import (PLUGIN_DEADLINE_ORDER_ENV, PLUGIN_DECODE_TURN_ENV, PLUGIN_PER_1K_ENV,
                             PLUGIN_PREFILL_RATE_ENV, PLUGIN_SHORT_PASS_ENV, PLUGIN_TTFT_ENV, SGLANG_PLUGIN_DIR)

# Run by SGLang's interpreter (importing SGLang takes ~25 s, so every case runs in this one process): load the
# plugins as SGLang's scheduler does, with LAPS_TTFT_S=0.4, and sort two queues of fake requests with SGLang's own
# static method (on the class, as calc_priority calls it, and through an instance); sort them again with SGLang's
# original function, and with the plugin's order under a 1 s per-1k allowance; then call register() again without
# LAPS_TTFT_S and with a malformed one, which must register nothing. With deadline order on (above 100 tokens at
# 0.1 s per 1,000), the hook before SGLang's batch decision must be on the scheduler's method and read a chunked
# request's tokens left from it. Prints the results as JSON on stdout's last line.
# Queue "a": in-time and late requests and one SGLang has pushed back for a duplicate prefix ("pushed");
# queue "b": 1 s waits, "cached" has 2,990 of its 3,000 prompt tokens cached; queue "c": for the deadline order.
_SCRIPT = """
import json, logging, os, time
from types import SimpleNamespace
logging.basicConfig(level=logging.INFO)
from sglang.srt.plugins import load_plugins
load_plugins()
import laps_sglang_plugin
from sglang.srt.managers import schedule_policy
from sglang.srt.managers.schedule_policy import SchedulePolicy
from sglang.srt.plugins.hook_registry import HookRegistry

def req(rid, prompt, waited_s, cached=0):
    return SimpleNamespace(rid=rid, origin_input_ids=[7] * prompt, output_ids=[], num_matched_prefix_tokens=cached,
                           time_stats=SimpleNamespace(wait_queue_entry_time=now - waited_s))

def rids(sort, queue, pushed=()):
    queue = list(queue)
    sort(queue, set(pushed))
    return [r.rid for r in queue]

now = time.perf_counter()
a = [req("late_short", 10, 1.0), req("late_mid", 50, 2.0), req("long", 1000, 0.0), req("mid", 100, 0.0),
     req("pushed", 5, 0.0)]
b = [req("small", 10, 1.0), req("big", 2000, 1.0), req("cached", 3000, 1.2, cached=2990)]
c = [req("mid", 300, 0.0), req("long", 900, 0.1), req("short", 50, 0.0)]
out = {"a": rids(SchedulePolicy._sort_by_shortest_prefill, a, ["pushed"]),
       "via_instance": rids(object.__new__(SchedulePolicy)._sort_by_shortest_prefill, a, ["pushed"]),
       "b": rids(SchedulePolicy._sort_by_shortest_prefill, b),
       "sglang_a": rids(SchedulePolicy._sort_by_shortest_prefill.__wrapped__, a, ["pushed"]),
       "sglang_b": rids(SchedulePolicy._sort_by_shortest_prefill.__wrapped__, b),
       "per_1k_b": rids(laps_sglang_plugin.make_late_last_sort(0.4, 1.0, schedule_policy), b),
       "deadline_c": rids(laps_sglang_plugin.make_late_last_sort(0.4, 0.0, schedule_policy, 100, 0.1), c)}
target = "sglang.srt.managers.schedule_policy.SchedulePolicy._sort_by_shortest_prefill"
hooks = len(HookRegistry._hooks[target])
for value in (None, "abc"):
    os.environ.pop("LAPS_TTFT_S") if value is None else os.environ.__setitem__("LAPS_TTFT_S", value)
    laps_sglang_plugin.register()
out["hooks_added_by_bad_settings"] = len(HookRegistry._hooks[target]) - hooks
from sglang.srt.managers.scheduler import Scheduler
(hook_type, hook, _), = HookRegistry._hooks["sglang.srt.managers.scheduler.Scheduler._get_new_batch_prefill_raw"]
scheduler = SimpleNamespace(chunked_req=SimpleNamespace(full_untruncated_fill_ids=[7] * 3500, prefix_len=500))
try:  # the hook runs first; SGLang's own method, reached after it, cannot run on the fake scheduler
    Scheduler._get_new_batch_prefill_raw(scheduler, None)
    out["sglang_method"] = "returned"
except Exception:
    out["sglang_method"] = "raised"
out["batch_hook"] = [hook_type.value, hook.__self__.tokens_left]
# Short passes (LAPS_SHORT_PASS_TOKENS=64): the sort of queue "c" leaves "short" (50 new tokens, in time) at its head,
# which the sort leaves for the pass; the hook after get_prefill_adder_class hands SGLang a PrefillAdder subclass.
from sglang.srt.managers.schedule_policy import PrefillAdder
(adder_hook_type, _, _), = HookRegistry._hooks["sglang.srt.managers.scheduler.Scheduler.get_prefill_adder_class"]
SchedulePolicy._sort_by_shortest_prefill(list(c), set())
adder_class = Scheduler.get_prefill_adder_class(scheduler)
out["adder_hook"] = [adder_hook_type.value, adder_class.__name__, issubclass(adder_class, PrefillAdder),
                     hook.__self__.short_tokens]
# Decode turns (LAPS_DECODE_TURN_SHORT_TOKENS=100): the hook after SGLang's own _should_defer_prefill, which runs
# on a fake scheduler owing two decode passes with 2 requests running (min-bs 0): kept while only "short" (50 new
# tokens) waits (SGLang leaves one owed); dropped (False, nothing owed) once a 900-token prompt with 1 token matched
# waits too. The hook matches a request with no match yet through the name match_kv_cache in schedule_policy.
(turn_hook_type, _, _), = HookRegistry._hooks["sglang.srt.managers.scheduler.Scheduler._should_defer_prefill"]
from sglang.srt.mem_cache.common import match_kv_cache
running = SimpleNamespace(batch_size=lambda: 2)
turns = []
for queue in ([c[2]], [req("long", 900, 0.0, cached=1), c[2]]):
    owing = SimpleNamespace(_prefill_decode_interval_remaining=2, prefill_decode_interval_min_bs=0, chunked_req=None,
                            waiting_queue=queue)
    turns.append([Scheduler._should_defer_prefill(owing, running), owing._prefill_decode_interval_remaining])
# A follow-up turn as SGLang holds it (a real Req of 300 prompt tokens, not matched yet) whose first 250 tokens are in
# the cache (a RadixCache as SGLang builds one without a GPU pool): the hook matches it with SGLang's match_kv_cache,
# finds 50 new tokens, and the owed decode pass stands.
from array import array
import torch
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.base_prefix_cache import InsertParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.sampling.sampling_params import SamplingParams
tree = RadixCache.create_simulated()
tree.insert(InsertParams(key=RadixKey(token_ids=array("q", range(100, 350)), extra_key=None),
                         value=torch.empty(250, dtype=torch.bool)))
turn = Req("turn", "", array("q", range(100, 400)), SamplingParams(max_new_tokens=4))
unmatched = turn.num_matched_prefix_tokens
owing = SimpleNamespace(_prefill_decode_interval_remaining=2, prefill_decode_interval_min_bs=0, chunked_req=None,
                        waiting_queue=[turn], tree_cache=tree)
turns.append([Scheduler._should_defer_prefill(owing, running), owing._prefill_decode_interval_remaining,
              unmatched, turn.num_matched_prefix_tokens])
out["decode_turns"] = [turn_hook_type.value, turns, schedule_policy.match_kv_cache is match_kv_cache]
print(json.dumps(out))
"""


@pytest.mark.sglang
def test_sglang_loads_the_plugin_and_late_requests_go_behind_those_in_time(sglang_python: Path):
    env = {**os.environ, "PYTHONPATH": str(SGLANG_PLUGIN_DIR), "LAPS_TTFT_S": "0.4",
           "LAPS_DEADLINE_ORDER_ABOVE_TOKENS": "100", "LAPS_PREFILL_S_PER_1K_TOKENS": "0.1", "LAPS_SHORT_PASS_TOKENS": "64",
           "LAPS_DECODE_TURN_SHORT_TOKENS": "100"}
    env.pop("LAPS_TTFT_PER_1K_NEW_TOKENS_S", None)
    done = subprocess.run([str(sglang_python), "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "Executed general plugin: laps_late_last" in done.stderr
    assert "waited longer than 0.4 s + 0 s per 1,000 new tokens" in done.stderr
    # In time shortest first, then the late ones shortest first, the pushed-back one last; in "b" all are late.
    assert out["a"] == out["via_instance"] == ["mid", "long", "late_short", "late_mid", "pushed"]
    assert out["b"] == ["cached", "small", "big"]
    # SGLang's own order: the pushed-back request last, the rest by new tokens, whatever the wait.
    assert out["sglang_a"] == ["late_short", "late_mid", "mid", "long", "pushed"]
    assert out["sglang_b"] == ["cached", "small", "big"]
    # 1 s per 1,000 new tokens: "big" (2,000 new: 0.4 + 2.0 s) is in time after 1 s; "small" and "cached" (10 new
    # each: 0.41 s) are late, so the allowance counts only uncached tokens.
    assert out["per_1k_b"] == ["big", "cached", "small"]
    # Deadline order above 100 tokens at 0.1 s per 1,000: all three end within 0.125 s, so "long" (waited 0.1 s) goes
    # before "mid", and "short" keeps its place ahead.
    assert out["deadline_c"] == ["short", "long", "mid"]
    # Without LAPS_TTFT_S, or with a malformed one, the plugin leaves SGLang's order and says why.
    assert out["hooks_added_by_bad_settings"] == 0
    # The hook before each batch decision is on SGLang's scheduler and sees its chunked request: 3,000 tokens left.
    assert out["batch_hook"] == ["before", 3000] and out["sglang_method"] == "raised"
    assert "requests in time of more than 100 new tokens go by deadline, less the longest ones" in done.stderr
    # Short passes: the hook is on SGLang's method and returns its PrefillAdder's subclass; the sort left the short one.
    assert out["adder_hook"] == ["after", "ShortPassPrefillAdder", True, [50]]
    assert "holds at most 64 tokens, or what they need where more (short passes)" in done.stderr
    # Decode turns: the hook is after SGLang's method; the owed pass stands (True, 1 left) while only a short prompt
    # waits, and what is owed is dropped (False, 0 left) with a 899-new-token one waiting.
    # A follow-up turn of 300 tokens not matched yet, 250 of them cached: matched by the hook, 50 new, the pass stands.
    assert out["decode_turns"] == ["after", [[True, 1], [False, 0], [True, 1, 0, 250]], True]
    assert "kept only while no chunked prefill is in progress and every waiting request has at most 100" in done.stderr
    assert "LAPS_TTFT_S is not set" in done.stderr
    assert "ERROR laps plugin (pid " in done.stderr and "): LAPS_TTFT_S='abc' is not a number" in done.stderr


def load_plugin_module():
    spec = importlib.util.spec_from_file_location("laps_sglang_plugin", SGLANG_PLUGIN_DIR / "laps_sglang_plugin.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plugin_with_env(monkeypatch, env: dict[str, str | None]):
    """The plugin module, with ``env`` set (None: unset) and its log lines going to caplog (in SGLang the plugin
    writes them to stderr itself)."""
    plugin = load_plugin_module()
    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    monkeypatch.setattr(plugin.logger, "propagate", True)
    return plugin


def test_the_plugin_imports_without_sglang_and_names_the_variables_the_manager_sets():
    plugin = load_plugin_module()
    assert (plugin.TTFT_ENV, plugin.PER_1K_ENV) == (PLUGIN_TTFT_ENV, PLUGIN_PER_1K_ENV) == (
        "LAPS_TTFT_S", "LAPS_TTFT_PER_1K_NEW_TOKENS_S")
    assert (plugin.DEADLINE_ORDER_ENV, plugin.PREFILL_RATE_ENV) == (PLUGIN_DEADLINE_ORDER_ENV, PLUGIN_PREFILL_RATE_ENV) == (
        "LAPS_DEADLINE_ORDER_ABOVE_TOKENS", "LAPS_PREFILL_S_PER_1K_TOKENS")
    assert plugin.SHORT_PASS_ENV == PLUGIN_SHORT_PASS_ENV == "LAPS_SHORT_PASS_TOKENS"
    assert plugin.DECODE_TURN_ENV == PLUGIN_DECODE_TURN_ENV == "LAPS_DECODE_TURN_SHORT_TOKENS"


def test_deadline_order_keeps_short_requests_first_and_the_rest_by_deadline_less_those_that_would_make_one_late():
    order = load_plugin_module().deadline_order
    # (request, new tokens, deadline s), shortest first; now = 10 s.
    queue = [("s", 40, 10.4), ("m", 300, 10.35), ("l", 900, 10.3)]
    # Rate 0.1 s per 1,000: s ends 10.004, l 10.094, m 10.124, all in time: by deadline.
    assert order(queue, 10.0, 100, 0.1) == ["s", "l", "m"]
    # Rate 0.3: s ends 10.012, l 10.282, m would end 10.372 > 10.35: l, the longest so far, moves behind; m ends 10.102.
    assert order(queue, 10.0, 100, 0.3) == ["s", "m", "l"]
    # Everything at most 1,000 tokens keeps its place; equal deadlines keep the order given.
    assert order(queue, 10.0, 1000, 0.1) == ["s", "m", "l"]
    assert order([("a", 500, 11.0), ("b", 600, 11.0)], 10.0, 0, 0.1) == ["a", "b"]
    assert order([], 10.0, 100, 0.1) == []
    # 2,000 tokens of a chunked prefill in progress first: at 0.1 s per 1,000, l ends 10.294, m 10.324, in time;
    # 2,500 tokens: l would end 10.344 > 10.3 and moves behind m (which ends 10.284).
    assert order(queue, 10.0, 100, 0.1, 2000) == ["s", "l", "m"]
    assert order(queue, 10.0, 100, 0.1, 2500) == ["s", "m", "l"]
    # Of two equally long ones, the one with the earlier deadline moves; those moved follow in the order given.
    assert order([("x", 500, 10.06), ("y", 500, 10.07)], 10.0, 0, 0.1) == ["y", "x"]
    assert order([("p", 200, 10.0), ("q", 300, 10.0)], 10.0, 0, 0.1) == ["p", "q"]
    # Entries are told apart by position, not identity: the same tuple twice, one copy moved, still gives two.
    twice = ("a", 500, 10.06)
    assert order([twice, twice], 10.0, 0, 0.1) == ["a", "a"]


def test_deadline_order_is_moores_algorithm_on_pinedos_worked_example():
    """Moore (1968), one machine, every job waiting: Pinedo, *Scheduling: Theory, Algorithms, and Systems*, Example
    3.3.3 (as we recall it; the brute force below checks the count without the book): five jobs of processing times 7,
    8, 4, 6, 6 and due dates 9, 17, 18, 19, 21; the algorithm drops job 2 when job 3 would be late and job 1 when job
    5 would, and the schedule 3, 4, 5, 1, 2 has two late jobs, the fewest. Here a job's processing time is its new
    tokens at 1 s per token (1,000 s per 1,000) and ``now`` is 0."""
    order = load_plugin_module().deadline_order
    jobs = [(1, 7, 9.0), (2, 8, 17.0), (3, 4, 18.0), (4, 6, 19.0), (5, 6, 21.0)]
    shortest_first = sorted(jobs, key=lambda j: j[1])  # the plugin's in-time requests come shortest first
    assert order(shortest_first, 0.0, 0, 1000.0) == [3, 4, 5, 1, 2]
    assert late_jobs([3, 4, 5, 1, 2], jobs) == 2 == min(late_jobs(p, jobs) for p in itertools.permutations([1, 2, 3, 4, 5]))
    # Deadline order alone has three late (3, 4 and 5). Shortest first happens to be Moore's schedule here; where it
    # is not, it can be worse: a 5-s job due at 5 s and a 1-s job due at 10 s, shortest first makes the long one late.
    assert late_jobs([1, 2, 3, 4, 5], jobs) == 3
    two = [("short", 1, 10.0), ("long", 5, 5.0)]
    assert order(two, 0.0, 0, 1000.0) == ["long", "short"]
    assert late_jobs(["long", "short"], two) == 0 < late_jobs(["short", "long"], two)


def late_jobs(sequence, jobs) -> int:
    """How many of ``jobs`` ((name, processing time, due date)) end past their due date when run back to back from 0
    in ``sequence`` (names)."""
    p = {name: time for name, time, _ in jobs}
    d = {name: due for name, _, due in jobs}
    end, late = 0, 0
    for name in sequence:
        end += p[name]
        late += end > d[name]
    return late


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.integers(1, 40)), min_size=1, max_size=6))
def test_deadline_order_has_the_fewest_late_requests_of_any_order_on_one_engine(shapes):
    """Moore's theorem, checked against every order: with all requests waiting and none short (``above_tokens`` 0),
    no order of them has fewer ending past their deadline than the plugin's, and it is an order of them all."""
    order = load_plugin_module().deadline_order
    jobs = [(i, work, float(due)) for i, (work, due) in enumerate(shapes)]
    got = order(sorted(jobs, key=lambda j: (j[1], j[0])), 0.0, 0, 1000.0)
    assert sorted(got) == [j[0] for j in jobs]
    assert late_jobs(got, jobs) == min(late_jobs(p, jobs) for p in itertools.permutations(range(len(jobs))))


def sort_setup(monkeypatch, now: float = 1000.0):
    """The plugin module with its clock stopped at ``now`` (seconds), a fake ``schedule_policy`` whose work of a request
    is its ``work``, and a maker of fake requests ``req(rid, work, waited_s)``."""
    plugin = load_plugin_module()
    monkeypatch.setattr(plugin.time, "perf_counter", lambda: now)
    policy = SimpleNamespace(SchedulePolicy=SimpleNamespace(_shortest_prefill_work=lambda r: r.work))

    def req(rid, work, waited_s):
        return SimpleNamespace(rid=rid, work=work, time_stats=SimpleNamespace(wait_queue_entry_time=now - waited_s))

    return plugin, policy, req


def test_the_sort_puts_the_requests_in_time_in_deadline_order_and_counts_the_chunk_in_progress(monkeypatch):
    plugin, policy, req = sort_setup(monkeypatch)
    queue = [req("mid", 300, 0.0), req("long", 900, 0.1), req("short", 50, 0.0), req("dup", 10, 0.5)]
    decision = plugin.BatchDecision()
    spf = plugin.make_late_last_sort(0.4, 0.0, policy)
    ordered = plugin.make_late_last_sort(0.4, 0.0, policy, 100, 0.1, decision)

    def sorted_rids(sort, q):
        q = list(q)
        sort(q, {"dup"})
        return [r.rid for r in q]

    assert sorted_rids(spf, queue) == ["short", "mid", "long", "dup"]
    # All in time by the estimate: deadline order (long, waiting 0.1 s longer, before mid).
    assert sorted_rids(ordered, queue) == ["short", "long", "mid", "dup"]
    # A late request (not pushed back) goes behind them; the requests in time keep their deadline order.
    assert sorted_rids(ordered, queue + [req("late", 20, 0.5)]) == ["short", "long", "mid", "late", "dup"]
    # The scheduler is in a chunked prefill with 3,000 of its 3,500 tokens left (the hook SGLang runs before each
    # batch decision reads it): long would end at 1000 + 0.3 + 0.005 + 0.09 s, past its deadline (1000.3 s), so it
    # moves behind mid.
    scheduler = SimpleNamespace(chunked_req=SimpleNamespace(full_untruncated_fill_ids=[7] * 3500, prefix_len=500))
    assert decision.before_prefill_batch(scheduler, "running batch") is None
    assert decision.tokens_left == 3000
    assert sorted_rids(ordered, queue) == ["short", "mid", "long", "dup"]
    decision.before_prefill_batch(SimpleNamespace(chunked_req=None))
    assert decision.tokens_left == 0
    assert sorted_rids(ordered, queue) == ["short", "long", "mid", "dup"]


def test_short_pass_budget_lets_every_short_request_in_whole_as_sglangs_chunk_limit_shares_the_pass():
    budget = load_plugin_module().short_pass_budget
    assert budget([], 256) is None  # the head is not a short request in time: the chunk's budget
    assert budget([50], 256) == 256
    # Where they need more: their tokens and one for the chunked prefill in progress (SGLang leaves it a page).
    assert budget([200, 100], 256, chunk_tokens_left=1976) == 301
    # The chunk in progress has no more left than the longest short request: SGLang's limit reserves nothing from
    # that request on, and the chunk takes its 176 tokens, so the budget holds them too.
    assert budget([200], 256, chunk_tokens_left=176) == 376
    # Pages of 16 tokens: each short request a whole page or more, the chunk a page: 112 + 208 + 16.
    assert budget([100, 200], 256, chunk_tokens_left=1976, page_size=16) == 336
    assert budget([10], 32, page_size=64) == 128  # at least two pages (below that SGLang sets no limit)


def test_the_sort_leaves_the_short_requests_and_the_pass_adder_takes_them_once(monkeypatch, caplog):
    plugin, policy, req = sort_setup(monkeypatch)
    monkeypatch.setattr(plugin.logger, "propagate", True)
    decision = plugin.BatchDecision(pass_tokens=64)
    sort = plugin.make_late_last_sort(0.4, 0.0, policy, 100, 0.1, decision)
    sort([req("long", 900, 0.0), req("short", 50, 0.0), req("tiny", 30, 0.1)], set())
    assert decision.short_tokens == [30, 50]  # in time and of at most 100 new tokens, shortest first
    # Late, pushed back or longer than the threshold: no short pass.
    for queue, pushed in (([req("long", 900, 0.0), req("late", 20, 0.5)], set()),
                          ([req("long", 900, 0.0), req("dup", 20, 0.0)], {"dup"}), ([req("long", 900, 0.0)], set())):
        sort(queue, pushed)
        assert decision.short_tokens == []

    class Adder:  # SGLang's PrefillAdder takes the chunk budget as rem_chunk_tokens
        def __init__(self, page_size, rem_chunk_tokens):
            self.page_size, self.rem_chunk_tokens = page_size, rem_chunk_tokens

    capped = decision.capped_adder_class(Adder, "scheduler")
    assert issubclass(capped, Adder) and decision.capped_adder_class(Adder, "scheduler") is capped
    decision.short_tokens, decision.tokens_left = [30, 50], 2000
    assert capped(1, 1024).rem_chunk_tokens == 81  # 80 + 1 > 64
    assert decision.short_tokens is None and capped(1, 1024).rem_chunk_tokens == 1024  # taken once
    decision.short_tokens = [30]
    assert capped(1, 1024).rem_chunk_tokens == 64
    decision.short_tokens = [30, 50]
    assert capped(64, 1024).rem_chunk_tokens == 192  # a page each, and one for the chunk
    decision.short_tokens = [30, 50]
    assert capped(1, 50).rem_chunk_tokens == 50  # never raised
    decision.short_tokens = [30, 50]
    with caplog.at_level("WARNING", logger=plugin.logger.name):
        assert capped(1, None).rem_chunk_tokens is None  # no chunking: nothing to cut, and it says so once
        said = len(caplog.records)
        decision.short_tokens = [30]
        capped(1, None)
        assert said and len(caplog.records) == said
    assert {r.getMessage() for r in caplog.records} == {
        "the engine runs without chunked prefill (--chunked-prefill-size -1, set or chosen by SGLang for this model): "
        "short passes cannot cut a pass and do nothing"}
    # The hook SGLang runs before each batch decision clears what no adder took.
    decision.short_tokens = [30]
    decision.before_prefill_batch(SimpleNamespace(chunked_req=None))
    assert decision.short_tokens is None


@pytest.mark.parametrize(("raw", "deadline_order", "expected", "says"), [
    (None, True, None, None), ("256", True, 256, None), (" 256 ", True, 256, None),
    ("0", True, None, "ERROR LAPS_SHORT_PASS_TOKENS='0' is not an integer >= 1"),
    ("1e3", True, None, "ERROR LAPS_SHORT_PASS_TOKENS='1e3' is not an integer >= 1"),
    ("256", False, None, "ERROR LAPS_SHORT_PASS_TOKENS='256' is set, but deadline order is off (it needs "
                         "LAPS_DEADLINE_ORDER_ABOVE_TOKENS and LAPS_PREFILL_S_PER_1K_TOKENS); short passes stay off"),
])
def test_short_pass_setting(monkeypatch, caplog, raw, deadline_order, expected, says):
    plugin = plugin_with_env(monkeypatch, {PLUGIN_SHORT_PASS_ENV: raw})
    with caplog.at_level("INFO", logger=plugin.logger.name):
        assert plugin._short_pass_setting(deadline_order) == expected
    logged = [f"{r.levelname} {r.getMessage()}" for r in caplog.records]
    assert logged[0].startswith(says) if says else logged == []


def test_a_chunked_request_the_hook_cannot_read_counts_as_none_and_never_stops_the_scheduler(monkeypatch, caplog):
    plugin = plugin_with_env(monkeypatch, {})
    decision = plugin.BatchDecision()
    decision.tokens_left = 500
    unreadable = SimpleNamespace(chunked_req=SimpleNamespace(prefix_len=3))  # no full_untruncated_fill_ids
    with caplog.at_level("WARNING"):
        decision.before_prefill_batch(unreadable)
        assert decision.tokens_left == 0
        assert "cannot read the chunked prefill in progress" in caplog.text
        caplog.clear()
        decision.before_prefill_batch(unreadable)  # said once
    assert decision.tokens_left == 0 and "cannot read" not in caplog.text


@pytest.mark.parametrize(("chunk", "waiting", "due"), [
    (False, [], True), (False, [1, 100], True), (False, [1, 101], False), (True, [5], False), (True, [], False),
])
def test_a_decode_turn_is_due_only_while_no_chunk_is_in_progress_and_every_waiting_request_is_short(chunk, waiting, due):
    assert load_plugin_module().decode_turn_due(chunk, waiting, 100) is due


def fake_scheduler(waiting: list[tuple[int, int]], cache: dict[int, int] | None = None,
                   chunked: bool = False) -> SimpleNamespace:
    """A scheduler as the decode turn hook reads it: its waiting requests, (prompt tokens, cached tokens matched so
    far) each; its cache, as the tokens a match finds for a prompt of each length (others: none), and the prompts
    matched (``cache.matched``); its chunked request; one decode pass owed."""
    queue = [SimpleNamespace(origin_input_ids=[7] * n, output_ids=[], num_matched_prefix_tokens=m) for n, m in waiting]
    tree = SimpleNamespace(hits=cache or {}, matched=[])
    return SimpleNamespace(waiting_queue=queue, tree_cache=tree, chunked_req=SimpleNamespace() if chunked else None,
                           _prefill_decode_interval_remaining=1)


def shortest_prefill_work(req) -> int:  # SGLang 0.5.23's SchedulePolicy._shortest_prefill_work
    return max(1, len(req.origin_input_ids) + len(req.output_ids) - req.num_matched_prefix_tokens)


def match_kv_cache(req, tree_cache) -> None:  # what SGLang's match_kv_cache leaves on the request
    tree_cache.matched.append(len(req.origin_input_ids))
    req.num_matched_prefix_tokens = tree_cache.hits.get(len(req.origin_input_ids), 0)


POLICY_MODULE = SimpleNamespace(SchedulePolicy=SimpleNamespace(_shortest_prefill_work=shortest_prefill_work),
                                match_kv_cache=match_kv_cache)


@pytest.mark.parametrize(("deferred", "scheduler", "answer", "owed", "matched"), [
    (True, fake_scheduler([(50, 0), (100, 0)]), None, 1, []),  # only short prompts wait: SGLang's decode pass stands
    (True, fake_scheduler([(50, 0), (3000, 2950)]), None, 1, []),  # 3,000 tokens, 2,950 matched: 50 new, short
    # a follow-up turn that arrived since the last prefill pass: no match yet; matched, 2,950 of its 3,000 are cached
    (True, fake_scheduler([(50, 0), (3000, 0)], cache={3000: 2950}), None, 1, [3000]),
    (True, fake_scheduler([(50, 0), (101, 0)]), False, 0, [101]),  # 101 new tokens, none cached: prefill now
    (True, fake_scheduler([(50, 0)], chunked=True), False, 0, []),  # a chunked prefill in progress: its next chunk now
    (False, fake_scheduler([(5000, 0)]), None, 1, []),  # SGLang owes nothing: its answer stands
])
def test_the_decode_turn_hook_drops_an_owed_decode_pass_where_a_long_prefill_waits(deferred, scheduler, answer, owed,
                                                                                   matched):
    hook = load_plugin_module().make_decode_turn_hook(100, POLICY_MODULE)
    assert hook(deferred, scheduler, SimpleNamespace()) is answer
    assert scheduler._prefill_decode_interval_remaining == owed and scheduler.tree_cache.matched == matched


def test_a_scheduler_the_decode_turn_hook_cannot_read_keeps_sglangs_answer_and_is_said_once(monkeypatch, caplog):
    plugin = plugin_with_env(monkeypatch, {})
    hook = plugin.make_decode_turn_hook(100, POLICY_MODULE)
    unreadable = SimpleNamespace(chunked_req=None, _prefill_decode_interval_remaining=1)  # no waiting_queue
    with caplog.at_level("WARNING", logger=plugin.logger.name):
        assert hook(True, unreadable) is None
        assert caplog.records[0].getMessage() == (
            "cannot read the scheduler's queue ('types.SimpleNamespace' object has no attribute 'waiting_queue'); "
            "decode passes stay owed as SGLang owes them")
        caplog.clear()
        assert hook(True, unreadable) is None  # said once
    assert caplog.records == [] and unreadable._prefill_decode_interval_remaining == 1


@pytest.mark.parametrize(("raw", "expected", "says"), [
    (None, None, None), ("255", 255, None), (" 0 ", 0, None),
    ("-1", None, "ERROR LAPS_DECODE_TURN_SHORT_TOKENS='-1' is not an integer >= 0; decode turns stay off"),
    ("2.5", None, "ERROR LAPS_DECODE_TURN_SHORT_TOKENS='2.5' is not an integer >= 0; decode turns stay off"),
])
def test_decode_turn_setting(monkeypatch, caplog, raw, expected, says):
    plugin = plugin_with_env(monkeypatch, {PLUGIN_DECODE_TURN_ENV: raw})
    with caplog.at_level("INFO", logger=plugin.logger.name):
        assert plugin._decode_turn_setting() == expected
    logged = [f"{r.levelname} {r.getMessage()}" for r in caplog.records]
    assert logged[0] == says if says else logged == []


@pytest.mark.parametrize(("above", "rate", "expected", "says"), [
    (None, None, (None, None), None), ("256", "0.0224", (256, 0.0224), None),
    ("256", None, (None, None), "ERROR deadline order needs LAPS_DEADLINE_ORDER_ABOVE_TOKENS"),
    ("x", "0.02", (None, None), "ERROR deadline order needs"), ("-1", "0.02", (None, None), "ERROR deadline order needs"),
    ("256", "0", (None, None), "ERROR deadline order needs"),
])
def test_deadline_order_settings(monkeypatch, caplog, above, rate, expected, says):
    plugin = plugin_with_env(monkeypatch, {PLUGIN_DEADLINE_ORDER_ENV: above, PLUGIN_PREFILL_RATE_ENV: rate})
    with caplog.at_level("INFO", logger=plugin.logger.name):
        assert plugin._deadline_order_settings() == expected
    logged = [f"{r.levelname} {r.getMessage()}" for r in caplog.records]
    assert logged[0].startswith(says) if says else logged == []


@pytest.mark.parametrize(("ttft", "per_1k", "says"), [
    (None, None, "INFO LAPS_TTFT_S is not set"), ("  ", None, "INFO LAPS_TTFT_S is not set"),
    ("0", None, "ERROR LAPS_TTFT_S='0' is not a number of seconds > 0"),
    ("-1", None, "ERROR LAPS_TTFT_S='-1' is not a number of seconds > 0"),
    ("nan", None, "ERROR LAPS_TTFT_S='nan' is not a number of seconds > 0"),
    ("inf", None, "ERROR LAPS_TTFT_S='inf' is not a number of seconds > 0"),
    ("0.4", "-1", "ERROR LAPS_TTFT_PER_1K_NEW_TOKENS_S='-1' is not a number of seconds >= 0"),
    ("0.4", "abc", "ERROR LAPS_TTFT_PER_1K_NEW_TOKENS_S='abc' is not a number of seconds >= 0"),
])
def test_a_missing_or_bad_setting_registers_nothing_and_says_why(monkeypatch, caplog, ttft, per_1k, says):
    plugin = plugin_with_env(monkeypatch, {PLUGIN_TTFT_ENV: ttft, PLUGIN_PER_1K_ENV: per_1k})
    with caplog.at_level("INFO", logger=plugin.logger.name):
        plugin.register()  # returns before importing SGLang, which laps' own environment does not have
    assert [f"{r.levelname} {r.getMessage()}" for r in caplog.records][0].startswith(says)
