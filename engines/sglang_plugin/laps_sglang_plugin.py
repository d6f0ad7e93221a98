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
into the waiting queue. The simulated engine models the same order
(``engines/sim/core.py``); what it buys there is in the README ("Late
requests last").

How laps enables it: when a role sets ``late_requests_last: true``, the
gateway's engine manager puts this directory on the engine's ``PYTHONPATH``
and sets the two variables. SGLang then finds the entry point in
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
* ``sglang/srt/observability/req_time_stats.py``: a request's
  ``time_stats.wait_queue_entry_time`` is the ``time.perf_counter()`` value
  (seconds) at which it entered the waiting queue; a retracted request enters
  again, so its clock restarts.

Only the standard library is imported at module level; SGLang is imported
inside :func:`register`, so this module imports without SGLang.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
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
_TARGET = "sglang.srt.managers.schedule_policy.SchedulePolicy._sort_by_shortest_prefill"


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


def make_late_last_sort(ttft_s: float, per_1k_s: float, policy_module: Any) -> Callable[[list, set], None]:
    """The replacement for ``SchedulePolicy._sort_by_shortest_prefill``.

    Args:
        ttft_s: the TTFT objective of a request with no new tokens, in seconds.
        per_1k_s: what each 1,000 new (uncached) tokens add to the objective, in seconds.
        policy_module: ``sglang.srt.managers.schedule_policy``; ``SchedulePolicy`` is looked up
            in it at each sort, so a later patch of that class or of ``_shortest_prefill_work`` is seen.

    Returns:
        ``sort(waiting_queue, temporary_deprioritized)``, which sorts the list of requests in place by
        (pushed back for a duplicate prefix, late, new tokens, queue entry time); a request is late when
        it has waited longer than ``ttft_s + per_1k_s * new_tokens / 1000`` seconds.
    """

    def sort_late_last(waiting_queue: list, temporary_deprioritized: set) -> None:
        work_of = policy_module.SchedulePolicy._shortest_prefill_work
        now = time.perf_counter()  # seconds, the clock of wait_queue_entry_time

        def key(req: Any) -> tuple[bool, bool, int, float]:
            work = work_of(req)
            entered = req.time_stats.wait_queue_entry_time
            late = now - entered > ttft_s + per_1k_s * work / 1000
            return (req.rid in temporary_deprioritized, late, work, entered)

        waiting_queue.sort(key=key)

    return sort_late_last


def register() -> None:
    """SGLang's entry point (group ``sglang.srt.plugins``): replace the shortest-prefill-first order.

    Reads ``LAPS_TTFT_S`` (seconds, > 0) and ``LAPS_TTFT_PER_1K_NEW_TOKENS_S`` (seconds per 1,000 new
    tokens, >= 0, default 0). With ``LAPS_TTFT_S`` unset or empty it logs that and registers nothing; with
    a malformed value it logs an error and registers nothing, leaving SGLang's order (it never raises for
    a bad setting, so the engine starts either way).
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

    from sglang.srt.managers import schedule_policy
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(_TARGET, make_late_last_sort(ttft_s, per_1k_s, schedule_policy), HookType.REPLACE)
    logger.info("shortest-prefill-first now puts requests that have waited longer than %g s "
                "+ %g s per 1,000 new tokens behind all others", ttft_s, per_1k_s)
