"""laps' SGLang plugin: under shortest-prefill-first, requests that have missed their TTFT objective go last.

SGLang's ``shortest-prefill-first`` schedule policy orders its waiting queue
by uncached prompt length alone. In overload that keeps serving a short
request that has already missed its time-to-first-token (TTFT) objective ahead
of longer requests that could still meet theirs, so capacity is spent on a
request that counts as a violation either way. This plugin keeps SGLang's
order but first splits the queue in two: requests still within their TTFT
objective come first, late ones after them (each group shortest first, ties
by entry into the queue; requests SGLang pushes back for a duplicate prefix
stay last). A request's objective is ``LAPS_TTFT_S`` seconds plus
``LAPS_TTFT_PER_1K_NEW_TOKENS_S`` seconds per 1,000 tokens it must prefill
(prompt and reply so far, less its cached prefix), measured from its entry
into the waiting queue.

Deadline order (``LAPS_DEADLINE_ORDER_ABOVE_TOKENS`` N and
``LAPS_PREFILL_S_PER_1K_TOKENS``, both set): the requests still within their
objective (bar those pushed back for a duplicate prefix) go those of at most N
new tokens first (shortest first), then the longer ones in Moore's order
(J. M. Moore, "An n job, one machine sequencing algorithm for minimizing the
number of tardy jobs", Management Science 15(1):102-109, 1968): by deadline,
except that wherever, by an estimate (the rest of the chunked prefill in
progress, then the short ones, then these back to back, all at
``LAPS_PREFILL_S_PER_1K_TOKENS``, the engine's full-chunk rate), one of them
would end past its objective, the longest of those kept so far is moved
behind all that are kept; the moved ones follow them, shortest first. For
one engine with every request already waiting, no order has fewer requests
late (Moore's theorem). While the engine keeps up nothing is moved and the
order is the deadlines': unlike shortest first it does not let a stream of
shorter prompts overtake a long one until the long one misses. In overload it
gives up the longest prompts, as shortest first does, but only as many as it
must to keep the rest in time. Late requests stay behind every request in
time. The order is re-decided at every sort, so it follows the load.

Short passes (``LAPS_SHORT_PASS_TOKENS`` S, with deadline order on): when the
queue, so ordered, starts with requests in time of at most N new tokens, the
next prefill pass holds at most S tokens, or what those requests need where
that is more (:func:`short_pass_budget`). Under shortest-prefill-first SGLang
fills every pass to the chunk (``--chunked-prefill-size``) with the next
tokens of a long prefill, so a short request that lands behind a long one
waits out the chunk pass in progress and then a whole chunk pass of its own
(~23 ms each at 1,024 tokens on an H200 with a 7B model); capped, its own
pass holds its tokens and a slice of the long prefill and takes ~6 ms (the
pass's weight reads, ~4.5 ms, and its tokens). S is meant to be the short
threshold, where a pass stops being memory-bound: a capped pass then still
does nearly a full pass's work per second (the engine model: 6.6 ms for 256
tokens on a 4k-token prefix against 25.6 ms for 1,024, 3.8% more per token),
so the long prefill loses little.

Decode turns (``LAPS_DECODE_TURN_SHORT_TOKENS`` T, with
SGLang's ``--prefill-decode-interval N`` and ``--prefill-decode-interval-min-bs
B``): SGLang runs a prefill pass whenever one can be formed and decodes only
when none can, so a stream of short prompts arriving faster than their passes
end starves decode: the running requests get no tokens, none finishes, no
request slot frees, and once the slots (``--max-running-requests``) are full
every new request waits for one. SGLang's interval owes N decode passes after
each prefill pass while at least B requests run; after every chunk of a long
prompt too, which stretches a long prefill by a decode pass per chunk. With T
set, the plugin keeps an owed decode pass only while no chunked prefill is in
progress and every waiting request has at most T new tokens
(:func:`decode_turn_due`; a short prompt cut at a full pass's chunk boundary
is a chunked prefill in progress too, which happens only when more waits than
one pass holds, so a backlog of short prompts drops the turn as well);
otherwise the owed passes are dropped and the prefill runs, as without the
interval. A short request then waits at most N
decode passes more; decode keeps at least one pass in N + 1 while short prompts
stream in.

The simulated engine models the orders, the short pass and the decode turns
(``engines/sim/core.py``, with this module's :func:`deadline_order`,
:func:`short_pass_budget` and :func:`decode_turn_due`); what they buy there is
in the README (sections "Late requests last: laps' SGLang plugin" and "What the
simulator says so far", its item "Decode under a burst").

How laps enables it: when a role sets ``late_requests_last: true``, the
gateway's engine manager puts this directory on the engine's ``PYTHONPATH``
and sets the first two variables (the next two where it also sets
``deadline_order: true``, and ``LAPS_SHORT_PASS_TOKENS``, the short
threshold, where it sets ``short_pass: true`` too; ``LAPS_DECODE_TURN_SHORT_TOKENS``,
one less than the short threshold, where it sets ``decode_turns: true``). SGLang then finds the entry point in
``laps_sglang_plugin-0.1.dist-info/entry_points.txt`` (group
``sglang.srt.plugins``, name ``laps_late_last``) and calls :func:`register`
in every process that loads plugins: the server's, its scheduler's (where the
queue is ordered) and its detokenizer's. Without ``LAPS_TTFT_S`` the plugin
does nothing; ``SGLANG_PLUGINS`` (a comma-separated whitelist of plugin
names) can also leave it out.

SGLang source it hooks (SGLang 0.5.23):

* ``sglang/srt/plugins/__init__.py``: ``load_plugins()`` discovers the entry
  point and then applies the registered hooks (``HookRegistry.apply_hooks()``
  in ``sglang/srt/plugins/hook_registry.py``); the scheduler calls it first
  thing in ``run_scheduler_process`` (``sglang/srt/managers/scheduler.py``).
* ``sglang/srt/managers/schedule_policy.py``: the static method
  ``SchedulePolicy._sort_by_shortest_prefill(waiting_queue,
  temporary_deprioritized)``, which ``SchedulePolicy.calc_priority`` calls
  under ``shortest-prefill-first``, is replaced; the replacement measures work
  with ``SchedulePolicy._shortest_prefill_work(req)``.
* ``sglang/srt/managers/scheduler.py``: with deadline order on, a hook runs
  before ``Scheduler._get_new_batch_prefill_raw`` (which sorts the queue
  through ``calc_priority``) and reads the scheduler's ``chunked_req``: its
  tokens left are ``len(full_untruncated_fill_ids) - prefix_len``, as in
  ``SchedulePolicy.shortest_prefill_chunk_limit`` (``prefix_len`` moves to the
  end of the last chunk scheduled, ``stash_chunked_request`` →
  ``checkpoint_kv_cache`` in ``sglang/srt/mem_cache/common.py``, before this
  hook runs; with the overlap scheduler that chunk may still be running, so
  the estimate can count one chunk fewer). The estimate puts all of that rest
  first, though ``shortest_prefill_chunk_limit`` lets waiting requests shorter
  than it into its passes: a margin, so behind a long prefill in progress
  Moore's order may move a long request that would have made it.
* ``sglang/srt/managers/scheduler.py``: with short passes on, a hook runs
  after ``Scheduler.get_prefill_adder_class``, which
  ``_get_new_batch_prefill_raw`` calls after ``calc_priority`` to build the
  pass's ``PrefillAdder``; it returns a subclass of the class SGLang returns
  whose ``__init__`` lowers ``rem_chunk_tokens`` (the pass's token budget,
  ``sglang/srt/managers/schedule_policy.py``) to :func:`short_pass_budget` of
  the short requests the sort just left, with the adder's ``page_size``; the
  chunked request's limit (``SchedulePolicy.shortest_prefill_chunk_limit``)
  is then computed on it. What the sort leaves lives until that
  ``PrefillAdder`` takes it: the hook before ``_get_new_batch_prefill_raw``
  clears it.
* ``sglang/srt/managers/scheduler.py``: with decode turns on, a hook runs
  after ``Scheduler._should_defer_prefill(running_batch)``, which
  ``get_next_batch_to_run`` calls before it forms a prefill batch and which
  says True while a decode pass is owed (``_prefill_decode_interval_remaining``,
  armed by ``_arm_prefill_decode_interval`` after each extend pass). Where it
  said True and :func:`decode_turn_due` does not hold for the scheduler's
  ``chunked_req`` and ``waiting_queue`` (new tokens by
  ``SchedulePolicy._shortest_prefill_work``; a request of more than T new
  tokens with no prefix matched yet, as one that arrived since the last prefill
  pass, is first matched with ``match_kv_cache`` from
  ``sglang/srt/mem_cache/common.py``, as ``SchedulePolicy.calc_priority`` would
  match it before the next prefill pass), the hook sets the passes owed to 0
  and returns False.
* ``sglang/srt/observability/req_time_stats.py``: a request's
  ``time_stats.wait_queue_entry_time`` is the ``time.perf_counter()`` value
  (seconds) at which it entered the waiting queue; a retracted request enters
  again, so its clock restarts.

Only the standard library is imported at module level; SGLang is imported
inside :func:`register`, so this module imports without SGLang.
"""

from __future__ import annotations

import heapq
import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

logger = logging.getLogger(__name__)
# SGLang loads plugins before it configures logging (run_scheduler_process calls load_plugins() first), so the
# plugin writes its lines to stderr itself, once per process that loads it (the server's, the scheduler's and the
# detokenizer's).
logger.propagate = False
if not logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[%(asctime)s] %(levelname)s laps plugin (pid %(process)d): %(message)s",
                                            "%Y-%m-%d %H:%M:%S"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)

TTFT_ENV = "LAPS_TTFT_S"
PER_1K_ENV = "LAPS_TTFT_PER_1K_NEW_TOKENS_S"
DEADLINE_ORDER_ENV = "LAPS_DEADLINE_ORDER_ABOVE_TOKENS"
PREFILL_RATE_ENV = "LAPS_PREFILL_S_PER_1K_TOKENS"
SHORT_PASS_ENV = "LAPS_SHORT_PASS_TOKENS"
DECODE_TURN_ENV = "LAPS_DECODE_TURN_SHORT_TOKENS"
_TARGET = "sglang.srt.managers.schedule_policy.SchedulePolicy._sort_by_shortest_prefill"
_BATCH_TARGET = "sglang.srt.managers.scheduler.Scheduler._get_new_batch_prefill_raw"
_ADDER_TARGET = "sglang.srt.managers.scheduler.Scheduler.get_prefill_adder_class"
_DEFER_TARGET = "sglang.srt.managers.scheduler.Scheduler._should_defer_prefill"


def _read_seconds(name: str, default: float | None, allow_zero: bool) -> float | None:
    """The environment variable ``name`` as a finite number of seconds (``default`` if unset or empty).

    Raises:
        ValueError: the value is not a finite number, or is negative (or zero when ``allow_zero`` is false).
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    value = float(raw)
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(raw)
    return value


def deadline_order(in_time: list[tuple[Any, int, float]], now: float, above_tokens: int,
                   prefill_s_per_1k: float, ahead_tokens: int = 0) -> list[Any]:
    """The waiting requests still within their objective in the plugin's deadline order (module doc: Moore's order).

    Args:
        in_time: ``(request, new tokens, deadline)`` of each, shortest first; deadlines in seconds on ``now``'s clock.
        now: the current time, in seconds.
        above_tokens: requests of at most this many new tokens keep their place ahead of the others.
        prefill_s_per_1k: the engine's prefill time per 1,000 new tokens, in seconds (its full-chunk rate).
        ahead_tokens: new tokens the engine prefills before any of them (the rest of a chunked prefill in progress).

    Returns:
        The requests of at most ``above_tokens`` new tokens as given; then the others by deadline (ties as given), less
        those Moore's algorithm moves: prefilled back to back from ``now`` after ``ahead_tokens`` and the short ones, at
        ``prefill_s_per_1k`` (an estimate), whenever one would end past its deadline the one of most new tokens so far
        is taken out (of equals the earliest deadline: the rest then have the most slack); then the ones taken out, as
        given. O(n log n) in the requests.
    """
    short = [i for i, (_, work, _) in enumerate(in_time) if work <= above_tokens]
    by_deadline = sorted((i for i, (_, work, _) in enumerate(in_time) if work > above_tokens), key=lambda i: in_time[i][2])
    tokens = ahead_tokens + sum(in_time[i][1] for i in short)  # whole tokens: no rounding builds up over the moves
    kept: list[tuple[int, int]] = []  # heap of (-new tokens, rank in by_deadline): the longest on top
    moved: set[int] = set()  # positions in in_time
    for rank, i in enumerate(by_deadline):
        _, work, deadline_s = in_time[i]
        heapq.heappush(kept, (-work, rank))
        tokens += work
        if now + tokens * prefill_s_per_1k / 1000 > deadline_s:
            minus_longest, j = heapq.heappop(kept)
            moved.add(by_deadline[j])
            tokens += minus_longest
    order = short + [i for i in by_deadline if i not in moved] + sorted(moved)
    return [in_time[i][0] for i in order]


def short_pass_budget(short_tokens: list[int], pass_tokens: int, chunk_tokens_left: int = 0,
                      page_size: int = 1) -> int | None:
    """The token budget of the next prefill pass under the short pass rule (module doc), or None (the chunk's).

    Args:
        short_tokens: new tokens of the requests at the head of the ordered queue that are in time and of at most
            the deadline order's threshold, in order (empty when the head is not such a request).
        pass_tokens: S, the most tokens a pass that carries them holds when they need fewer.
        chunk_tokens_left: new tokens left of the chunked prefill in progress (0: none).
        page_size: the engine's KV page, in tokens.

    Returns:
        None without short requests; else the most of S and what lets every short request into the pass whole, as
        SGLang's ``SchedulePolicy.shortest_prefill_chunk_limit`` shares the budget: each short request its tokens
        rounded up to a page, and the chunked prefill in progress a page, or all its tokens left where that is no
        more than the longest short request's (the limit then reserves nothing for the short requests from it on,
        and the chunk takes all it has left); at least two pages (below that SGLang sets no limit); all rounded up
        to a page.
    """
    if not short_tokens:
        return None
    page = max(1, page_size)

    def up(tokens: int) -> int:
        return -(-tokens // page) * page

    chunk = up(chunk_tokens_left) if 0 < chunk_tokens_left <= max(short_tokens) else page
    return max(up(pass_tokens), sum(up(t) for t in short_tokens) + chunk, 2 * page)


def decode_turn_due(chunk_in_progress: bool, waiting_tokens: Iterable[int], short_tokens: int) -> bool:
    """Whether an engine keeps a decode pass owed under its prefill-decode interval (module doc, Decode turns).

    Args:
        chunk_in_progress: a chunked prefill is in progress (its next chunk would run in the prefill pass).
        waiting_tokens: the new (uncached) tokens of each waiting request.
        short_tokens: T, the most new tokens of a short request.

    Returns:
        True when no chunked prefill is in progress and every waiting request has at most T new tokens (True too
        with none waiting: SGLang then decodes anyway).
    """
    return not chunk_in_progress and all(tokens <= short_tokens for tokens in waiting_tokens)


def make_decode_turn_hook(short_tokens: int, policy_module: Any) -> Callable[..., bool | None]:
    """The hook run after ``Scheduler._should_defer_prefill(self, running_batch)`` (module doc, Decode turns).

    Args:
        short_tokens: T, the most new tokens of a short request.
        policy_module: ``sglang.srt.managers.schedule_policy``; ``SchedulePolicy._shortest_prefill_work`` and
            ``match_kv_cache`` (SGLang's ``sglang.srt.mem_cache.common.match_kv_cache``, which that module imports)
            are looked up in it at each call.

    Returns:
        ``hook(deferred, scheduler, *args)``: None (SGLang's answer stands) unless SGLang owes a decode pass
        (``deferred``) and :func:`decode_turn_due` does not hold for the scheduler's chunked request and waiting
        queue; then it sets ``scheduler._prefill_decode_interval_remaining`` to 0 and returns False (prefill now).
        A waiting request of more than T new tokens with no cached tokens matched (``num_matched_prefix_tokens`` 0:
        SGLang matches only as it forms a prefill batch, so a request that arrived since the last one has none; one
        matched with nothing cached is matched again, a cost bounded as the judgement stops at the first long
        request) is first matched against ``scheduler.tree_cache`` with ``match_kv_cache``, as SGLang's
        ``calc_priority`` matches each waiting request before its next prefill pass. Never raises: a scheduler it
        cannot read keeps SGLang's answer (logged once).
    """
    unreadable = False

    def after_should_defer_prefill(deferred: bool, scheduler: Any, *args: Any, **kwargs: Any) -> bool | None:
        nonlocal unreadable
        if not deferred:
            return None
        try:
            work_of = policy_module.SchedulePolicy._shortest_prefill_work

            def new_tokens(req: Any) -> int:
                work = work_of(req)
                if work <= short_tokens or req.num_matched_prefix_tokens:
                    return work
                policy_module.match_kv_cache(req, scheduler.tree_cache)
                return work_of(req)

            due = decode_turn_due(scheduler.chunked_req is not None, map(new_tokens, scheduler.waiting_queue),
                                  short_tokens)
        except Exception as err:  # inside SGLang's scheduler loop: never raise
            if not unreadable:
                unreadable = True
                logger.warning("cannot read the scheduler's queue (%s); decode passes stay owed as SGLang owes them", err)
            return None
        if due:
            return None
        scheduler._prefill_decode_interval_remaining = 0
        return False

    return after_should_defer_prefill


class BatchDecision:
    """Per scheduler, what its next prefill batch decision reads: the new tokens left of its chunked prefill in
    progress, as of that decision, and with short passes on (``pass_tokens``, S) the new tokens of the short requests
    in time that the sort put at the queue's head (empty: none; None: no sort since the decision began), read once by
    the pass's ``PrefillAdder``."""

    def __init__(self, pass_tokens: int | None = None) -> None:
        self.tokens_left = 0
        self.pass_tokens = pass_tokens
        self.short_tokens: list[int] | None = None
        self._unreadable = False
        self._unchunked = False  # said that short passes do nothing without chunked prefill
        self._capped: dict[type, type] = {}

    def before_prefill_batch(self, scheduler: Any, *args: Any, **kwargs: Any) -> None:
        """The hook run before ``Scheduler._get_new_batch_prefill_raw(self, ...)`` (module doc); changes nothing
        of the call and never raises: a chunked request whose fields it cannot read counts as none (logged once)."""
        self.short_tokens = None
        req = getattr(scheduler, "chunked_req", None)
        try:
            self.tokens_left = 0 if req is None else max(0, len(req.full_untruncated_fill_ids) - int(req.prefix_len))
        except Exception as err:  # inside SGLang's scheduler loop: never raise
            self.tokens_left = 0
            if not self._unreadable:
                self._unreadable = True
                logger.warning("cannot read the chunked prefill in progress (%s); deadline order leaves it out", err)

    def capped_adder_class(self, adder_class: type, *args: Any, **kwargs: Any) -> type:
        """The hook run after ``Scheduler.get_prefill_adder_class(self)``: a subclass of the ``PrefillAdder`` class it
        returned whose instances lower their ``rem_chunk_tokens`` (the pass's token budget) to :func:`short_pass_budget`
        of the short requests the sort left, with their own ``page_size``, and clear those (module doc, Short passes);
        one subclass per class. A pass without chunking (``rem_chunk_tokens`` None) is left as it is (logged once)."""
        capped = self._capped.get(adder_class)
        if capped is None:
            state = self

            def __init__(adder: Any, *a: Any, **kw: Any) -> None:
                adder_class.__init__(adder, *a, **kw)
                shorts, state.short_tokens = state.short_tokens, None
                rem = getattr(adder, "rem_chunk_tokens", None)
                if shorts and rem is None and not state._unchunked:
                    state._unchunked = True
                    logger.warning("the engine runs without chunked prefill (--chunked-prefill-size -1, set or chosen "
                                   "by SGLang for this model): short passes cannot cut a pass and do nothing")
                if shorts and rem is not None and state.pass_tokens is not None:
                    page = int(getattr(adder, "page_size", 1) or 1)
                    adder.rem_chunk_tokens = min(rem, short_pass_budget(shorts, state.pass_tokens, state.tokens_left, page))

            capped = self._capped[adder_class] = type(f"ShortPass{adder_class.__name__}", (adder_class,), {"__init__": __init__})
        return capped


def make_late_last_sort(ttft_s: float, per_1k_s: float, policy_module: Any, deadline_order_above: int | None = None,
                        prefill_s_per_1k: float | None = None,
                        decision: BatchDecision | None = None) -> Callable[[list, set], None]:
    """The replacement for ``SchedulePolicy._sort_by_shortest_prefill``.

    Args:
        ttft_s: the TTFT objective of a request with no new tokens, in seconds.
        per_1k_s: what each 1,000 new (uncached) tokens add to the objective, in seconds.
        policy_module: ``sglang.srt.managers.schedule_policy``; ``SchedulePolicy`` is looked up
            in it at each sort, so a later patch of that class or of ``_shortest_prefill_work`` is seen.
        deadline_order_above, prefill_s_per_1k: both set: the requests in time go in :func:`deadline_order` (those of
            more than ``deadline_order_above`` new tokens in Moore's order, at ``prefill_s_per_1k`` seconds per 1,000
            new tokens after the rest of the chunked prefill in progress that ``decision`` holds, when given).
            With short passes on in ``decision`` (its ``pass_tokens``), each sort also leaves there the new tokens of the
            requests in time of at most ``deadline_order_above`` new tokens, which it puts first.

    Returns:
        ``sort(waiting_queue, temporary_deprioritized)``, which sorts the list of requests in place by
        (pushed back for a duplicate prefix, late, new tokens, queue entry time); a request is late when
        it has waited longer than ``ttft_s + per_1k_s * new_tokens / 1000`` seconds; then, with deadline
        order on, reorders the leading requests, those neither late nor pushed back.
    """

    def sort_late_last(waiting_queue: list, temporary_deprioritized: set) -> None:
        work_of = policy_module.SchedulePolicy._shortest_prefill_work
        now = time.perf_counter()  # seconds, the clock of wait_queue_entry_time
        keys = {}

        def key(req: Any) -> tuple[bool, bool, int, float]:
            work = work_of(req)
            entered = req.time_stats.wait_queue_entry_time
            objective_s = ttft_s + per_1k_s * work / 1000
            keys[id(req)] = (req.rid in temporary_deprioritized, now - entered > objective_s, work, entered,
                             entered + objective_s)
            return keys[id(req)][:4]

        waiting_queue.sort(key=key)
        if deadline_order_above is None or prefill_s_per_1k is None:
            return
        in_time = []
        for req in waiting_queue:  # in time, then late, then pushed back
            pushed, late, work, _, deadline_s = keys[id(req)]
            if pushed or late:
                break
            in_time.append((req, work, deadline_s))
        ahead = decision.tokens_left if decision is not None else 0
        waiting_queue[:len(in_time)] = deadline_order(in_time, now, deadline_order_above, prefill_s_per_1k, ahead)
        if decision is not None and decision.pass_tokens is not None:
            decision.short_tokens = [work for _, work, _ in in_time if work <= deadline_order_above]

    return sort_late_last


def register() -> None:
    """SGLang's entry point (group ``sglang.srt.plugins``): replace the shortest-prefill-first order.

    Reads ``LAPS_TTFT_S`` (seconds, > 0) and ``LAPS_TTFT_PER_1K_NEW_TOKENS_S`` (seconds per 1,000 new
    tokens, >= 0, default 0). With ``LAPS_TTFT_S`` unset or empty it logs that and registers nothing; with
    a malformed value it logs an error and registers nothing, leaving SGLang's order (it never raises for
    a bad setting, so the engine starts either way). Deadline order (module doc)
    is on when ``LAPS_DEADLINE_ORDER_ABOVE_TOKENS`` (an integer >= 0) and ``LAPS_PREFILL_S_PER_1K_TOKENS``
    (seconds, > 0) are both set; with one of them missing or malformed it logs why and stays off. Short passes
    (module doc) are on with deadline order and ``LAPS_SHORT_PASS_TOKENS`` (an integer >= 1); malformed, or set
    while deadline order is off, they log why and stay off. Decode turns (module doc) are on with
    ``LAPS_DECODE_TURN_SHORT_TOKENS`` (an integer >= 0); malformed, they log why and stay off.
    """
    try:
        ttft_s = _read_seconds(TTFT_ENV, None, allow_zero=False)
    except ValueError:
        logger.error("%s=%r is not a number of seconds > 0; SGLang's shortest-prefill-first "
                     "order is left unchanged", TTFT_ENV, os.environ.get(TTFT_ENV))
        return
    if ttft_s is None:
        logger.info("%s is not set; SGLang's shortest-prefill-first order is left unchanged", TTFT_ENV)
        return
    try:
        per_1k_s = _read_seconds(PER_1K_ENV, 0.0, allow_zero=True)
    except ValueError:
        logger.error("%s=%r is not a number of seconds >= 0; SGLang's shortest-prefill-first "
                     "order is left unchanged", PER_1K_ENV, os.environ.get(PER_1K_ENV))
        return

    above, rate = _deadline_order_settings()
    short_pass = _short_pass_setting(above is not None)
    decode_turn = _decode_turn_setting()

    from sglang.srt.managers import schedule_policy
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    decision = BatchDecision(short_pass) if above is not None else None
    HookRegistry.register(_TARGET, make_late_last_sort(ttft_s, per_1k_s, schedule_policy, above, rate, decision),
                          HookType.REPLACE)
    if decision is not None:
        HookRegistry.register(_BATCH_TARGET, decision.before_prefill_batch, HookType.BEFORE)
    if decision is not None and short_pass is not None:
        HookRegistry.register(_ADDER_TARGET, decision.capped_adder_class, HookType.AFTER)
    if decode_turn is not None:
        HookRegistry.register(_DEFER_TARGET, make_decode_turn_hook(decode_turn, schedule_policy), HookType.AFTER)
    logger.info("shortest-prefill-first now puts requests that have waited longer than %g s "
                "+ %g s per 1,000 new tokens behind all others", ttft_s, per_1k_s)
    if above is not None:
        logger.info("requests in time of more than %d new tokens go by deadline, less the longest ones where, at %g s "
                    "per 1,000 new tokens after the chunked prefill in progress, one would end late (Moore's order)",
                    above, rate)
    if short_pass is not None:
        logger.info("a prefill pass that carries requests in time of at most %d new tokens holds at most %d tokens, "
                    "or what they need where more (short passes)", above, short_pass)
    if decode_turn is not None:
        logger.info("a decode pass that --prefill-decode-interval owes is kept only while no chunked prefill is in "
                    "progress and every waiting request has at most %d new tokens (decode turns)", decode_turn)


def _deadline_order_settings() -> tuple[int | None, float | None]:
    """(``LAPS_DEADLINE_ORDER_ABOVE_TOKENS``, ``LAPS_PREFILL_S_PER_1K_TOKENS``), or (None, None) with a log line
    saying why when either is unset or malformed."""
    raw_above = os.environ.get(DEADLINE_ORDER_ENV, "").strip()
    raw_rate = os.environ.get(PREFILL_RATE_ENV, "").strip()
    if not raw_above and not raw_rate:
        return None, None
    try:
        above = int(raw_above)
        rate = _read_seconds(PREFILL_RATE_ENV, None, allow_zero=False)
        if above < 0 or rate is None:
            raise ValueError
    except ValueError:
        logger.error("deadline order needs %s (an integer >= 0) and %s (seconds > 0), got %r and %r; it stays off",
                     DEADLINE_ORDER_ENV, PREFILL_RATE_ENV, raw_above, raw_rate)
        return None, None
    return above, rate


def _short_pass_setting(deadline_order: bool) -> int | None:
    """``LAPS_SHORT_PASS_TOKENS``, or None: unset, or malformed, or set while deadline order is off (both logged)
    (module doc, Short passes)."""
    tokens = _read_tokens(SHORT_PASS_ENV, 1, "short passes")
    if tokens is not None and not deadline_order:
        logger.error("%s=%r is set, but deadline order is off (it needs %s and %s); short passes stay off",
                     SHORT_PASS_ENV, os.environ[SHORT_PASS_ENV], DEADLINE_ORDER_ENV, PREFILL_RATE_ENV)
        return None
    return tokens


def _decode_turn_setting() -> int | None:
    """``LAPS_DECODE_TURN_SHORT_TOKENS``, or None: unset, or malformed (logged) (module doc, Decode turns)."""
    return _read_tokens(DECODE_TURN_ENV, 0, "decode turns")


def _read_tokens(name: str, minimum: int, feature: str) -> int | None:
    """The environment variable ``name`` as a number of tokens, an integer >= ``minimum``; None where it is unset or
    empty, or malformed (logged: ``feature`` stays off)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        tokens = int(raw)
        if tokens < minimum:
            raise ValueError
    except ValueError:
        logger.error("%s=%r is not an integer >= %d; %s stay off", name, raw, minimum, feature)
        return None
    return tokens
