"""The simulated engine's scheduler: SGLang 0.5.23 batching semantics, pure and clock-injected.

No asyncio, no clock, no I/O: the caller passes ``now`` (seconds on any clock)
and runs the forward pass each :meth:`EngineCore.step` returns for
``duration_s``; the real-time HTTP shell (:mod:`engines.sim.server`) and the
virtual-time simulator (:mod:`loadgen.virtual`) drive the same object. What it
models, read from SGLang 0.5.23 (``managers/scheduler.py``
``get_next_batch_to_run`` / ``_get_new_batch_prefill_raw`` /
``update_running_batch``, ``managers/schedule_policy.py`` ``SchedulePolicy`` and
``PrefillAdder``, ``mem_cache/prefill_budget.py``, ``managers/schedule_batch.py``
``retract_decode``), at page size 1 without overlap scheduling:

* **One pass per step.** A prefill (extend) batch runs whenever one can be
  formed; otherwise every running request decodes one token. With
  ``enable_mixed_chunk`` the running decodes ride along in the prefill pass when
  their next tokens fit. With ``prefill_decode_interval`` N > 0 (SGLang's
  ``_should_defer_prefill`` / ``_arm_prefill_decode_interval``) a prefill pass
  is followed by N decode passes before the next prefill, while at least
  ``prefill_decode_interval_min_bs`` requests run (fewer: prefill at once, the
  interval dropped). SGLang spends a deferred round with nothing running as an
  empty loop turn; the model skips it (it takes no time). With laps' plugin's
  decode turns (``decode_turn_short_tokens`` T) an owed decode
  pass is kept only while no chunked prefill is in progress and every waiting
  request has at most T uncached tokens (``max(1, len(fill) − matched)``, as
  last matched; the plugin's ``decode_turn_due``), else the passes owed are
  dropped and the prefill runs. The model matches a request when it arrives;
  the plugin matches one that has no match yet (it arrived since the last
  prefill pass) when it first judges it.
* **Waiting-queue order** (``--schedule-policy``), re-sorted in place (stable)
  every pass: ``fcfs`` keeps arrival order, or with
  ``--enable-priority-scheduling`` sorts by (priority, queue-entry time);
  ``lof`` sorts by the largest ``max_new_tokens`` (priority first when enabled);
  ``lpm`` by the longest cached prefix; ``shortest-prefill-first`` by the
  fewest uncached tokens ``max(1, len(fill) − matched)`` then entry time;
  ``hrrn`` by the highest response ratio with token aging,
  (prefill tokens processed since the request queued) / (uncached prompt
  tokens); ``random`` shuffles with a seeded RNG. The cache-aware ones (lpm, spf,
  hrrn) match every waiting request against the cache each pass (stamping its
  LRU time) and push back a request whose own hit is ≤ 32 tokens but which
  shares ≥ 32 tokens with one earlier in the queue (in-batch prefix caching);
  lpm and hrrn fall back to fcfs when more than 128 wait. With a cache-agnostic
  order every 32nd pass touches the prefixes of the first 128 waiting requests
  (head last), as SGLang's waiting-prefix refresh does.
* **Admission** (``PrefillAdder``): a prefill-in-progress (chunked) request
  continues first; then requests are taken in queue order while
  ``len(running) + len(batch) < max_running_requests``. A request is matched
  against the cache on all but its last token and needs
  ``uncached + min(max_new − produced, 4096) + 1 < available + evictable −
  offsets`` (its matched prefix pinned during the check), where the offsets
  are each running request's ``min(max_new − produced, 4096) · ratio`` (ratio
  1.0 for ``ignore_eos``) and each admitted request's ``extend + 1 +
  min(max_new, 4096)`` (``extend + 1`` for a chunk); ``ratio`` starts at 0.7,
  decays by (0.7 − 0.098)/600 per decode pass to 0.098, is reset when the
  engine idles and re-estimated after a retraction. A request longer than what
  is left of ``chunked_prefill_size`` is cut (a new chunked request; under
  shortest-prefill-first only if none is in progress); without chunking a
  request that does not fit ``max_prefill_tokens`` waits unless it is the
  first of the batch. Admission stops at the first request that does not fit
  ("no token": no further prefill until a running request leaves) or when the
  chunk or input budget is spent.
* **shortest-prefill-first** also caps the continuing chunk so the shortest
  waiting requests (each shorter than what the long one has left) fit in the
  same pass. With laps' SGLang plugin (``engines/sglang_plugin``; here
  ``late_last_ttft_s``) a request that has waited in the queue longer than its
  TTFT objective, ``late_last_ttft_s + late_last_per_1k_s`` per 1,000 uncached
  tokens, sorts behind every request still within it (pushed-back ones stay last);
  with ``late_last_deadline_order_tokens`` N, the requests in time go those of
  at most N tokens first, the longer ones by deadline less those Moore's
  algorithm moves behind them where, prefilled back to back after the rest of
  the chunked prefill in progress at ``late_last_prefill_s_per_1k`` (an
  estimate), one would end past its objective (the plugin's deadline order);
  with ``late_last_short_pass_tokens`` S too, a pass whose queue so ordered
  starts with requests in time of at most N tokens holds at most S tokens, or
  what they need where more (the plugin's short pass, its
  ``short_pass_budget`` at page size 1: the pass's chunk budget is cut).
* **Priority preemption** (``--enable-priority-scheduling`` without
  ``--disable-priority-preemption``): when the request slots are full, running
  requests whose priority is worse by more than
  ``priority_scheduling_preemption_threshold`` are released, lowest priority and
  newest first, if that frees enough room; they requeue.
* **KV pool** of ``max_total_tokens`` shared by running requests and a radix
  prefix cache (:class:`~engines.sim.radix.RadixCache`) evicted LRU: every
  prefill (chunk) is inserted and stays pinned while its request runs; a
  finished request inserts prompt and reply (whose last token has no KV).
  ``cached_tokens`` is the hit at a request's first admission.
* **Decode retraction** when the pool cannot hold one more token per running
  request: requests are retracted in order of fewest produced tokens, ties the
  longest prompt, at least one and until the rest fit, never the last (which is
  aborted if even it does not fit); each release also evicts 20 cache tokens
  per request still running; the retracted requeue at the back (entry time
  now) and are prefilled again with their reply so far.
* ``max_new_tokens`` is clipped on arrival to the context length and the pool.
* **Prefill–decode disaggregation** (``--disaggregation-mode``, SGLang's
  ``disaggregation/prefill.py`` and ``decode.py``). A *prefill* engine runs a
  request with ``max_new_tokens`` 1 for admission, as SGLang does; when its
  prefill completes it samples the first token (event ``kv_ready``) and keeps
  the KV pinned, outside the running batch, until the caller reports the
  transfer done (:meth:`EngineCore.finish_transfer`); the prompt then stays in
  its prefix cache. A *decode* engine takes requests only with their KV
  (:meth:`EngineCore.add_transferred_request`), queues them FIFO and, at the
  start of a pass, admits them (no prefill compute) while a request slot is free
  and ``prompt + 512 ≤ room − 512·running`` (``--num-reserved-decode-tokens``
  512 for each running request and the new one); the first token is streamed
  then (``StepResult.admitted``) and the request decodes in that same pass.
  SGLang's decode engine reserves this KV *before* the transfer starts (its
  pre-allocation queue, which also holds the transfer back when the pool is
  full); here the KV is taken when it arrives. A retracted request is
  prefilled again on the decode engine (SGLang backs its KV up to the host).

Replies are real token ids (:mod:`engines.sim.replies`); ``stop`` strings are
matched on the decoded reply after every token.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple, Sequence

from engines.sglang_plugin.laps_sglang_plugin import decode_turn_due, deadline_order, short_pass_budget
from engines.sim.latency import LatencyModel, SeqShape
from engines.sim.radix import RadixCache, RadixNode
from engines.sim.replies import IncrementalDetokenizer, ReplyPlanner, find_stop
from laps.tokenizer import ChatTokenizer
from policies.exact_prefix import KVEvent

CLIP_MAX_NEW_TOKENS = 4096  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION
INIT_NEW_TOKEN_RATIO = 0.7  # SGLANG_INIT_NEW_TOKEN_RATIO
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14  # SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR
NEW_TOKEN_RATIO_DECAY_STEPS = 600  # SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS
RETRACT_DECODE_STEPS = 20  # SGLANG_RETRACT_DECODE_STEPS
IN_BATCH_PREFIX_CHECK_THRESHOLD = 32  # IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD
IN_BATCH_PREFIX_DEPRIORITIZE_THRESHOLD = 32  # IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD
WAITING_QUEUE_PREFIX_MATCH_MAX = 128
WAITING_PREFIX_REFRESH_INTERVAL = 32

DISAGGREGATION_MODES = ("null", "prefill", "decode")
"""``--disaggregation-mode`` values: a whole engine, a prefill-only engine, a decode-only engine."""
NUM_RESERVED_DECODE_TOKENS = 512  # --num-reserved-decode-tokens (PD decode admission)

SCHEDULE_POLICIES = ("fcfs", "lof", "random", "lpm", "hrrn", "shortest-prefill-first")
"""The ``--schedule-policy`` values the engine model implements."""
CACHE_AWARE_POLICIES = frozenset({"lpm", "hrrn", "shortest-prefill-first"})

_CONTINUE, _NO_TOKEN, _OTHER = 0, 1, 2  # AddReqResult


def default_max_running_requests(max_total_tokens: int, context_length: int) -> int:
    """SGLang's default request-slot count: min(clip(tokens / context · 512, 2048, 4096), tokens / 2)."""
    return min(min(max(int(max_total_tokens / context_length * 512), 2048), 4096), max_total_tokens // 2)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Scheduler settings (SGLang flag names, see the module doc); limits in tokens and requests.

    ``chunked_prefill_size`` None disables chunking (SGLang's ``-1``).

    Raises:
        ValueError: on a non-positive limit, or a schedule policy SGLang 0.5.23
            rejects or this model does not implement (messages say which).
    """

    max_total_tokens: int
    max_running_requests: int
    chunked_prefill_size: int | None = 8192
    max_prefill_tokens: int = 16384
    context_length: int = 32768
    enable_mixed_chunk: bool = False
    prefill_decode_interval: int = 0
    prefill_decode_interval_min_bs: int = 0
    decode_turn_short_tokens: int | None = None
    schedule_policy: str = "fcfs"
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10
    disable_priority_preemption: bool = False
    schedule_conservativeness: float = 1.0
    random_seed: int = 0
    disaggregation_mode: str = "null"
    late_last_ttft_s: float | None = None
    late_last_per_1k_s: float = 0.0
    late_last_deadline_order_tokens: int | None = None
    late_last_prefill_s_per_1k: float | None = None
    late_last_short_pass_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            raise ValueError(f"--disaggregation-mode {self.disaggregation_mode}: choose from {', '.join(DISAGGREGATION_MODES)}")
        for name in ("max_total_tokens", "max_running_requests", "max_prefill_tokens", "context_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.late_last_ttft_s is not None and not self.late_last_ttft_s > 0:
            raise ValueError(f"late_last_ttft_s must be > 0 or None, got {self.late_last_ttft_s}")
        if not self.late_last_per_1k_s >= 0:
            raise ValueError(f"late_last_per_1k_s must be >= 0, got {self.late_last_per_1k_s}")
        if self.late_last_deadline_order_tokens is not None and (
                self.late_last_ttft_s is None or self.late_last_deadline_order_tokens < 0
                or not (self.late_last_prefill_s_per_1k or 0) > 0):
            raise ValueError("late_last_deadline_order_tokens must be >= 0 and needs late_last_ttft_s and "
                             f"late_last_prefill_s_per_1k > 0, got {self.late_last_deadline_order_tokens}, "
                             f"{self.late_last_ttft_s} and {self.late_last_prefill_s_per_1k}")
        if self.late_last_short_pass_tokens is not None and (
                self.late_last_deadline_order_tokens is None or self.late_last_short_pass_tokens < 1):
            raise ValueError("late_last_short_pass_tokens must be >= 1 and needs late_last_deadline_order_tokens, "
                             f"got {self.late_last_short_pass_tokens} and {self.late_last_deadline_order_tokens}")
        if self.prefill_decode_interval < 0 or self.prefill_decode_interval_min_bs < 0:  # SGLang's messages
            raise ValueError("--prefill-decode-interval must be non-negative." if self.prefill_decode_interval < 0
                             else "--prefill-decode-interval-min-bs must be non-negative.")
        if self.decode_turn_short_tokens is not None and self.decode_turn_short_tokens < 0:
            raise ValueError("decode_turn_short_tokens must be >= 0 or None, got "
                             f"{self.decode_turn_short_tokens}")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 1:
            raise ValueError(f"chunked_prefill_size must be >= 1 or None, got {self.chunked_prefill_size}")
        policy = self.schedule_policy
        if policy == "priority":
            raise ValueError("Unknown schedule_policy: policy='priority' (SGLang 0.5.23's scheduler refuses it; "
                             "use --enable-priority-scheduling with fcfs or lof)")
        if policy not in SCHEDULE_POLICIES:
            raise ValueError(f"--schedule-policy {policy}: the simulated engine implements {', '.join(SCHEDULE_POLICIES)}")
        if self.enable_priority_scheduling and policy not in ("fcfs", "lof"):
            raise ValueError(f"To use priority scheduling, schedule_policy must be 'fcfs' or 'lof'. "
                             f"'{policy}' is not supported.")


class RequestEvent(NamedTuple):
    """What happened to one request in one step (or on abort).

    ``new_token_ids``: tokens produced now (EOS included when sampled);
    ``completion_tokens``: all produced so far; ``first_token``: this event
    carries the first one; ``finish_reason``: None while running, else
    ``"stop"`` (``matched_stop`` is the EOS id or the stop string), ``"length"``
    or ``"abort"``; ``queue_time_s``: arrival to first admission, set with the
    first token; ``kv_ready``: a prefill-only engine (``--disaggregation-mode
    prefill``) finished this request's prefill and sampled its first token, and
    now holds its KV for the transfer to a decode engine
    (:meth:`EngineCore.finish_transfer` ends it).
    """

    rid: str
    new_token_ids: tuple[int, ...]
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int
    first_token: bool = False
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    queue_time_s: float | None = None
    kv_ready: bool = False

    @property
    def finished(self) -> bool:
        """True when the request ended with this event."""
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class StepResult:
    """One scheduled forward pass: its duration (s), its shapes and its events.

    ``prefill``: (new tokens, cached prefix) of each prefill (extend) sequence;
    ``num_decode_seqs`` sequences decoded one token each over
    ``decode_context_tokens`` cached tokens in total; ``graph``: the CUDA-graph
    size that replayed the pass (None: eager). An idle step (nothing
    schedulable) has ``duration_s == 0`` and no sequences; it may still carry an
    abort event. ``admitted``: events at the pass's *start*, not its end: on a
    decode-only engine, the first tokens of requests whose KV arrived, streamed
    when they join the running batch before it decodes (SGLang's prebuilt batch).
    """

    duration_s: float
    prefill: tuple[SeqShape, ...]
    num_decode_seqs: int
    decode_context_tokens: int
    graph: int | None
    events: tuple[RequestEvent, ...]
    admitted: tuple[RequestEvent, ...] = ()

    @property
    def idle(self) -> bool:
        """True when no forward pass was scheduled."""
        return not self.prefill and not self.num_decode_seqs

    @property
    def num_prefill_seqs(self) -> int:
        """Sequences in the prefill part of the pass."""
        return len(self.prefill)


@dataclass(frozen=True, slots=True)
class CoreStats:
    """A load snapshot (SGLang's ``/v1/loads`` fields). Tokens, requests, rates per second.

    ``num_used_tokens`` excludes evictable cache (SGLang's convention);
    ``num_total_tokens`` adds the waiting requests' prompt tokens;
    ``num_waiting_uncached_tokens`` uses each waiting request's prefix match from
    its arrival or its last match (as SGLang does), plus what is left of a
    chunked prefill; ``num_running_reqs`` counts a chunked prefill in flight;
    ``cache_hit_rate`` is that of the last prefill batch; ``gen_throughput`` and
    ``utilization`` (busy fraction) are over the last 40 forward passes;
    ``num_retracted_reqs`` counts retractions so far; ``new_token_ratio`` is the
    admission estimate of the share of ``max_new_tokens`` running requests will use.
    """

    num_running_reqs: int
    num_waiting_reqs: int
    num_waiting_uncached_tokens: int
    num_used_tokens: int
    num_total_tokens: int
    max_total_num_tokens: int
    max_running_requests: int
    token_usage: float
    cache_hit_rate: float
    gen_throughput: float
    utilization: float
    evictable_tokens: int
    total_prefill_uncached_tokens: int
    total_prefill_busy_s: float
    num_retracted_reqs: int
    new_token_ratio: float


class _Req:
    __slots__ = (
        "rid", "input_ids", "output_ids", "max_new_tokens", "ignore_eos", "stop", "priority", "arrival", "entry_time",
        "plan", "plan_reason", "detok", "kv_len", "node", "locked_len", "prefix_len", "matched", "cached_tokens",
        "queue_time_s", "arrival_processed",
    )

    def __init__(self, rid: str, input_ids: tuple[int, ...], max_new_tokens: int, ignore_eos: bool,
                 stop: tuple[str, ...], priority: int, arrival: float, plan: tuple[int, ...], plan_reason: str,
                 detok: IncrementalDetokenizer | None) -> None:
        self.rid = rid
        self.input_ids = input_ids
        self.output_ids: list[int] = []
        self.max_new_tokens = max_new_tokens
        self.ignore_eos = ignore_eos
        self.stop = stop
        self.priority = priority
        self.arrival = arrival
        self.entry_time = arrival  # wait_queue_entry_time: reset when requeued after a retraction
        self.plan = plan
        self.plan_reason = plan_reason
        self.detok = detok  # reply text so far, kept only when there are stop strings
        self.kv_len = 0  # tokens of fill_ids whose KV is computed
        self.node: RadixNode | None = None  # locked cache node covering fill_ids[:locked_len]
        self.locked_len = 0
        self.prefix_len = 0  # cached prefix at the last admission match
        self.matched = 0  # cached prefix found when last matched while waiting
        self.cached_tokens: int | None = None  # prefix hit at first admission
        self.queue_time_s: float | None = None
        self.arrival_processed = 0  # HRRN: prefill tokens processed when it (re)entered the queue

    def fill_ids(self) -> tuple[int, ...]:
        return self.input_ids + tuple(self.output_ids) if self.output_ids else self.input_ids

    @property
    def fill_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def prefill_work(self) -> int:
        """Tokens left to prefill as of the last match, at least 1: SGLang's ``SchedulePolicy._shortest_prefill_work``."""
        return max(1, self.fill_len - self.matched)


class EngineCore:
    """SGLang-like continuous batching over a simulated GPU (see the module doc).

    ``tokenizer`` decodes replies for stop strings and supplies the reply
    vocabulary; ``latency`` prices every forward pass. ``kv_events``: the prefix
    cache records SGLang's KV cache events (:mod:`engines.sim.radix`), taken
    with :meth:`take_kv_events`.
    """

    def __init__(self, config: EngineConfig, latency: LatencyModel, tokenizer: ChatTokenizer, kv_events: bool = False) -> None:
        self.config = config
        self.latency = latency
        self._tokenizer = tokenizer
        self._planner = ReplyPlanner(tokenizer)
        self.tree = RadixCache([] if kv_events else None)
        self._waiting: list[_Req] = []
        self._running: list[_Req] = []
        self._chunked: _Req | None = None
        self._reqs: dict[str, _Req] = {}
        self._transferring: dict[str, _Req] = {}  # prefill mode: KV held until the transfer is done
        self._arrived: list[_Req] = []  # decode mode: KV arrived, not yet in the running batch
        self._private = 0  # KV tokens held by requests outside the tree
        self._running_ctx = 0  # Σ kv_len over running requests (a decode pass's cached context)
        self._batch_is_full = False
        init = min(INIT_NEW_TOKEN_RATIO * config.schedule_conservativeness, 1.0)
        self._init_ratio = init
        self._ratio = init
        self._min_ratio = min(init * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        self._ratio_decay = (init - self._min_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        self._priority_sign = 1 if config.schedule_low_priority_values_first else -1
        self._preemption = config.enable_priority_scheduling and not config.disable_priority_preemption
        self._rng = random.Random(config.random_seed)
        self._refresh_calls = 0
        self._processed_tokens = 0  # HRRN's prefill-token clock
        self._now = 0.0
        self._last_hit_rate = 0.0
        self._total_prefill_uncached = 0
        self._total_prefill_busy_s = 0.0
        self._pass_budget_tokens: int | None = None  # the next pass's token budget under the short pass rule (None: the chunk's)
        self._decode_rounds_owed = 0  # decode passes still due before the next prefill (prefill_decode_interval)
        self._num_retracted = 0
        self._recent: list[tuple[float, float, int]] = []  # (start, duration, decode tokens) of recent passes

    @property
    def eos_token_id(self) -> int:
        """The token id replies end with."""
        return self._planner.eos_token_id

    # ---- requests ---------------------------------------------------------------------------

    def add_request(self, rid: str, input_ids: Sequence[int], max_new_tokens: int | None, ignore_eos: bool = False,
                    stop: Sequence[str] = (), now: float = 0.0, priority: int | None = None) -> None:
        """Queue a request. ``max_new_tokens`` None means up to the context length.

        ``max_new_tokens`` is clipped as SGLang's ``init_req_max_new_tokens``
        does: to ``min(context, max_total_tokens) − 1 − prompt`` and to
        ``max_total_tokens − prompt − 2``. ``priority`` counts only with
        priority scheduling (default: the lowest priority).

        On a prefill-only engine the reply is planned in full (so its first
        token is the one the decode engine continues from) but admission
        reserves room for one new token, as SGLang sets ``max_new_tokens = 1``.

        Raises:
            ValueError: duplicate rid, empty prompt, negative max_new_tokens, or a
                prompt (plus max_new_tokens) that does not fit the context length or the KV pool;
                messages are SGLang's; on a decode-only engine always (requests
                come with their KV: :meth:`add_transferred_request`).
        """
        if self.config.disaggregation_mode == "decode":
            raise ValueError("this engine runs --disaggregation-mode decode: requests arrive with their KV cache "
                             "from a prefill engine (bootstrap_host/bootstrap_room), not as plain requests")
        req = self._new_req(rid, input_ids, max_new_tokens, ignore_eos, stop, now, priority)
        if self.config.disaggregation_mode == "prefill":
            req.max_new_tokens = min(req.max_new_tokens, 1)
        req.matched = self.tree.peek_prefix(req.input_ids[:-1])
        req.arrival_processed = self._processed_tokens
        self._reqs[rid] = req
        self._waiting.append(req)

    def add_transferred_request(self, rid: str, input_ids: Sequence[int], max_new_tokens: int | None,
                                ignore_eos: bool = False, stop: Sequence[str] = (), now: float = 0.0,
                                priority: int | None = None) -> None:
        """A decode-only engine receives request ``rid`` whose prompt KV has just arrived at ``now``.

        Arguments as for :meth:`add_request` (the same body the prefill engine
        got). The request waits, FIFO, until a pass admits it (module doc);
        its first token, the one the prefill engine sampled, is in that pass's
        ``StepResult.admitted``.

        Raises:
            ValueError: the engine is not ``--disaggregation-mode decode``, or as
                :meth:`add_request` for a bad request.
        """
        if self.config.disaggregation_mode != "decode":
            raise ValueError(f"add_transferred_request needs --disaggregation-mode decode, "
                             f"this engine runs {self.config.disaggregation_mode}")
        req = self._new_req(rid, input_ids, max_new_tokens, ignore_eos, stop, now, priority)
        self._reqs[rid] = req
        self._arrived.append(req)

    def _new_req(self, rid: str, input_ids: Sequence[int], max_new_tokens: int | None, ignore_eos: bool,
                 stop: Sequence[str], now: float, priority: int | None) -> _Req:
        """Validate a request and plan its reply (see :meth:`add_request`)."""
        cfg = self.config
        if rid in self._reqs:
            raise ValueError(f"Duplicate request ID: {rid}")
        n = len(input_ids)
        if n == 0:
            raise ValueError("The input is empty: a request needs at least one token.")
        if n >= cfg.context_length:
            raise ValueError(f"The input ({n} tokens) is longer than the model's context length "
                             f"({cfg.context_length} tokens).")
        if max_new_tokens is not None:
            if max_new_tokens < 0:
                raise ValueError(f"max_new_tokens must be at least 0, got {max_new_tokens}.")
            if max_new_tokens + n > cfg.context_length:
                raise ValueError(
                    f"Requested token count exceeds the model's maximum context length of {cfg.context_length} "
                    f"tokens. You requested a total of {max_new_tokens + n} tokens: {n} tokens from the input "
                    f"messages and {max_new_tokens} tokens for the completion. Please reduce the number of "
                    f"tokens in the input messages or the completion to fit within the limit.")
        if n >= cfg.max_total_tokens - 1:
            raise ValueError(f"Request prompt exceeds the KV memory budget: input_len={n}.")
        max_req_len = min(cfg.context_length - 1, cfg.max_total_tokens - 1)
        limit = max(0, min(max_req_len - n - 1, cfg.max_total_tokens - n - 2))
        max_new = limit if max_new_tokens is None else min(max_new_tokens, limit)
        plan = self._planner.plan(rid, max_new, ignore_eos)
        stops = tuple(s for s in stop if s)
        detok = IncrementalDetokenizer(self._tokenizer) if stops else None
        if priority is None and cfg.enable_priority_scheduling:
            priority = sys.maxsize if cfg.schedule_low_priority_values_first else -sys.maxsize - 1
        return _Req(rid, tuple(input_ids), max_new, ignore_eos, stops, priority or 0, now, plan.token_ids,
                    plan.finish_reason, detok)

    def abort(self, rid: str) -> RequestEvent | None:
        """End request ``rid`` now with ``"abort"``; None when it is unknown or already finished."""
        req = self._reqs.get(rid)
        if req is None:
            return None
        if req is self._chunked:
            self._chunked = None
        elif rid in self._transferring:
            del self._transferring[rid]
        elif req in self._arrived:
            self._arrived.remove(req)
        elif req in self._running:
            self._running.remove(req)
            self._running_ctx -= req.kv_len
            self._batch_is_full = False
        else:
            self._waiting.remove(req)
        return self._finish(req, "abort", None, ())

    def finish_transfer(self, rid: str) -> RequestEvent | None:
        """A prefill-only engine's KV transfer of ``rid`` is done: unpin its KV (kept as prefix cache) and end it.

        Returns the final event (``finish_reason`` ``"length"``, no new tokens,
        as SGLang's prefill engine ends a transferred request), or None when
        ``rid`` is not waiting for its transfer here.
        """
        req = self._transferring.pop(rid, None)
        if req is None:
            return None
        return self._finish(req, "length", None, ())

    def abort_all(self) -> list[RequestEvent]:
        """Abort every unfinished request (queue order: chunked, transferring, running, arrived, waiting)."""
        order = (([self._chunked] if self._chunked else []) + list(self._transferring.values()) + list(self._running)
                 + list(self._arrived) + list(self._waiting))
        return [ev for ev in (self.abort(r.rid) for r in order) if ev is not None]

    def fully_idle(self) -> bool:
        """True when no request is waiting, running or holding KV for a transfer."""
        return not self._reqs

    def flush_cache(self) -> bool:
        """Empty the prefix cache; refused (False) while any request is waiting or running."""
        if not self.fully_idle():
            return False
        self.tree.reset()
        self._last_hit_rate = 0.0
        return True

    def take_kv_events(self) -> list[KVEvent]:
        """The KV cache events recorded since the last call, oldest first ([] without ``kv_events``)."""
        events = self.tree.events
        if not events:
            return []
        self.tree.events = []
        return events

    def switch_disaggregation_mode(self, mode: str) -> bool:
        """Flip an idle PD engine to ``mode`` (``"prefill"`` or ``"decode"``) and empty its prefix cache.

        SGLang 0.5.23 (``disaggregation/role_switch.py``) resets the radix cache and the KV pool on a
        flip: cached prefixes would be stale in the new role. Refused (False) while any request is
        waiting, running or holding KV for a transfer, as :meth:`flush_cache`.

        Raises:
            ValueError: ``mode`` is not a PD mode.
        """
        if mode not in ("prefill", "decode"):
            raise ValueError(f"a PD engine flips to prefill or decode, not {mode!r}")
        if not self.flush_cache():
            return False
        self.config = replace(self.config, disaggregation_mode=mode)
        return True

    def has_work(self) -> bool:
        """True while any request is waiting or running (not counting prefilled ones waiting for their KV transfer)."""
        return len(self._reqs) > len(self._transferring)

    # ---- the step ---------------------------------------------------------------------------

    def step(self, now: float) -> StepResult:
        """Schedule and apply one forward pass starting at ``now``; its events happen at ``now + duration_s``
        (``admitted`` ones at ``now``)."""
        self._now = now
        if not self._running and self._chunked is None:
            self._ratio = self._init_ratio  # SGLang resets the ratio whenever it idles
        admitted = self._admit_transferred() if self._arrived else ()
        events: list[RequestEvent] = []
        prefill = [] if self._defer_prefill() else self._get_new_batch_prefill()
        decodes: list[_Req] = []
        retracted = False
        if prefill:
            self._decode_rounds_owed = self.config.prefill_decode_interval
            if self.config.enable_mixed_chunk and self._running and self._decode_fits(len(self._running)):
                decodes = self._running
        elif self._running:
            retracted = self._update_running_batch(events)
            decodes = self._running
        if not prefill and not decodes:
            return StepResult(0.0, (), 0, 0, None, tuple(events), admitted)
        shapes = tuple((ext, req.kv_len) for req, ext in prefill)
        seqs, ctx = len(decodes), self._running_ctx if decodes else 0
        tokens, pairs, kv = seqs, ctx + seqs, ctx + 2 * seqs
        for new, cached in shapes:
            tokens += new
            pairs += new * cached + new * (new + 1) // 2
            kv += 2 * new + cached
        # Decode length spread (engines.sim.latency, decode_spread_fraction): n·max(H) − Σ H.
        padding = seqs * max(r.kv_len for r in decodes) - ctx if decodes and self.latency.decode_spread_fraction else 0
        breakdown = self.latency.breakdown_totals(seqs + len(shapes), tokens, pairs, kv, decode=not shapes,
                                                  decode_padding_tokens=padding)
        duration = breakdown.total_s
        decoding = list(decodes)
        for req, ext in prefill:
            req.kv_len += ext
            self._cache_prefix(req)
            if req.kv_len < req.fill_len:
                continue  # a chunk; the request stays self._chunked
            if self.config.disaggregation_mode == "prefill":
                events.append(self._hand_off(req))
                continue
            self._running.append(req)
            self._running_ctx += req.kv_len
            events.append(self._produce(req))
        if decoding:
            if not self._alloc(seqs):
                raise RuntimeError("KV pool accounting error: a checked decode pass does not fit")
            for req in decoding:
                req.kv_len += 1
            self._running_ctx += seqs
            for req in decoding:
                events.append(self._produce(req))
        if prefill:
            self._total_prefill_busy_s += duration
            self._processed_tokens += sum(ext for _, ext in prefill)
        elif not retracted:
            self._ratio = max(self._ratio - self._ratio_decay, self._min_ratio)
        self._recent.append((now, duration, seqs))
        if len(self._recent) > 80:
            del self._recent[:-40]
        return StepResult(duration, shapes, seqs, ctx, breakdown.graph, tuple(events), admitted)

    # ---- prefill-decode disaggregation ----------------------------------------------------------

    def _hand_off(self, req: _Req) -> RequestEvent:
        """Prefill mode: sample the first token and hold the prompt's KV for the transfer (``kv_ready``)."""
        self._transferring[req.rid] = req
        new = req.plan[:1]
        req.output_ids.extend(new)
        return RequestEvent(req.rid, new, len(new), len(req.input_ids), req.cached_tokens or 0, True, None, None,
                            req.queue_time_s, True)

    def _admit_transferred(self) -> tuple[RequestEvent, ...]:
        """Decode mode: move arrived requests (FIFO) into the running batch with their first token (module doc)."""
        events = []
        while self._arrived:
            req = self._arrived[0]
            n = len(req.input_ids)
            running = len(self._running)
            if running >= self.config.max_running_requests:
                break
            if running and n + NUM_RESERVED_DECODE_TOKENS * (running + 1) > self._room():
                break  # an idle engine takes any prompt that fits its pool (add_request's check)
            self._arrived.pop(0)
            if not self._alloc(n):
                raise RuntimeError("KV pool accounting error: an arrived request does not fit")
            req.kv_len, req.cached_tokens, req.queue_time_s = n, 0, max(0.0, self._now - req.arrival)
            self._running.append(req)
            self._running_ctx += n
            events.append(self._produce(req))
        return tuple(events)

    # ---- waiting-queue order ------------------------------------------------------------------

    def _calc_priority(self) -> None:
        """Sort the waiting queue in place as SGLang's ``SchedulePolicy.calc_priority`` does."""
        cfg, waiting = self.config, self._waiting
        policy = cfg.schedule_policy
        if policy in ("lpm", "hrrn") and len(waiting) > WAITING_QUEUE_PREFIX_MATCH_MAX:
            policy = "fcfs"  # the expensive matching is switched off for long queues
        sign = self._priority_sign
        self._pass_budget_tokens = None
        if policy in CACHE_AWARE_POLICIES:
            pushed_back = self._match_waiting()
            if policy == "lpm":
                waiting.sort(key=lambda r: float("inf") if r.rid in pushed_back else -r.matched)
            elif policy == "shortest-prefill-first" and cfg.late_last_ttft_s is not None:
                waiting.sort(key=self._late_last_key(pushed_back))
                if cfg.late_last_deadline_order_tokens is not None:
                    self._deadline_order_in_time(pushed_back)
            elif policy == "shortest-prefill-first":
                waiting.sort(key=lambda r: (r.rid in pushed_back, r.prefill_work, r.entry_time))
            else:
                clock = self._processed_tokens

                def hrrn_key(r: _Req) -> tuple[float, str]:
                    if r.rid in pushed_back:
                        return float("inf"), r.rid
                    uncached = len(r.input_ids) - r.matched
                    if uncached <= 0:
                        return -float("inf"), r.rid
                    return -max(0, clock - r.arrival_processed) / uncached, r.rid

                waiting.sort(key=hrrn_key)
            return
        if cfg.schedule_policy == "fcfs" and cfg.enable_priority_scheduling:
            waiting.sort(key=lambda r: (r.priority * sign, r.entry_time))
        elif policy == "lof":
            if cfg.enable_priority_scheduling:
                waiting.sort(key=lambda r: (r.priority * sign, -r.max_new_tokens))
            else:
                waiting.sort(key=lambda r: -r.max_new_tokens)
        elif policy == "random":
            self._rng.shuffle(waiting)
        self._refresh_waiting_prefixes()

    def _match_waiting(self) -> set[str]:
        """Match every waiting request against the cache; the rids pushed back by in-batch prefix caching."""
        pushed_back: set[str] = set()
        in_queue = RadixCache()
        for r in self._waiting:
            fill = r.fill_ids()
            r.matched, _ = self.tree.match_prefix(fill[:-1])
            if r.matched <= IN_BATCH_PREFIX_CHECK_THRESHOLD:
                shared, _ = in_queue.match_prefix(fill)
                if shared >= IN_BATCH_PREFIX_DEPRIORITIZE_THRESHOLD:
                    pushed_back.add(r.rid)
                else:
                    in_queue.insert(fill)
        return pushed_back

    def _refresh_waiting_prefixes(self) -> None:
        refresh = self._refresh_calls % WAITING_PREFIX_REFRESH_INTERVAL == 0
        self._refresh_calls += 1
        if refresh and self._waiting:
            for r in reversed(self._waiting[:WAITING_QUEUE_PREFIX_MATCH_MAX]):
                self.tree.touch_prefix(r.fill_ids())

    # ---- prefill admission (PrefillAdder) -----------------------------------------------------

    def _defer_prefill(self) -> bool:
        """Whether this pass decodes though a prefill could run: a decode round still owed after the last prefill
        (``prefill_decode_interval``) while at least ``prefill_decode_interval_min_bs`` requests run, at least one
        (fewer: the rounds owed are dropped); with ``decode_turn_short_tokens``, only while the plugin's
        ``decode_turn_due`` holds too (else dropped as well)."""
        if not self._decode_rounds_owed:
            return False
        short = self.config.decode_turn_short_tokens
        if (not self._running or len(self._running) < self.config.prefill_decode_interval_min_bs
                or short is not None and not decode_turn_due(
                    self._chunked is not None, (r.prefill_work for r in self._waiting), short)):
            self._decode_rounds_owed = 0
            return False
        self._decode_rounds_owed -= 1
        return True

    def _get_new_batch_prefill(self) -> list[tuple[_Req, int]]:
        cfg = self.config
        if not self._running or self._preemption:
            self._batch_is_full = False
        if (self._batch_is_full or not self._waiting) and self._chunked is None:
            return []
        if (len(self._running) >= cfg.max_running_requests and self._chunked is None
                and not self._preemption):
            self._batch_is_full = True
            return []
        self._calc_priority()
        adder = _Adder(self)
        if self._pass_budget_tokens is not None and adder.rem_chunk is not None:
            adder.rem_chunk = min(adder.rem_chunk, self._pass_budget_tokens)
        chunked = self._chunked
        if chunked is not None:
            limit = self._spf_chunk_limit(chunked, adder.rem_chunk or 0)
            self._chunked = adder.add_chunked(chunked, limit)
        preempted: list[_Req] = []
        for req in list(self._waiting):
            if adder.budget_state() == _OTHER:
                break
            if len(self._running) + len(adder.batch) >= cfg.max_running_requests:
                self._batch_is_full = True
            if self._batch_is_full:
                if not self._preemption or not self._preempt_to_schedule(req, adder, preempted):
                    break
            req.prefix_len, node = self.tree.match_prefix(req.fill_ids()[:-1])
            req.matched = req.prefix_len
            res = adder.add_one(req, node, has_chunked=self._chunked is not None)
            if res != _CONTINUE:
                if res == _NO_TOKEN:
                    self._batch_is_full = bool(adder.batch) or bool(self._running)
                break
        if not adder.batch:
            self._requeue(preempted)
            return []
        admitted = {id(req) for req, _ in adder.batch}
        self._waiting = [r for r in self._waiting if id(r) not in admitted]
        self._requeue(preempted)
        if adder.new_chunked is not None:
            self._chunked = adder.new_chunked
        hit = new = 0
        for req, ext in adder.batch:
            if not self._alloc(ext):
                raise RuntimeError("KV pool accounting error: an admitted prefill does not fit")
            if req.cached_tokens is None:
                req.cached_tokens = req.prefix_len
                req.queue_time_s = max(0.0, self._now - req.arrival)
            if req is not chunked:
                req.locked_len = req.kv_len = req.prefix_len
                hit += req.prefix_len
            new += ext
        if hit + new:
            self._last_hit_rate = hit / (hit + new)
        self._total_prefill_uncached += new
        return adder.batch

    def _late_last_key(self, pushed_back: set[str]) -> Callable[[_Req], tuple]:
        """shortest-prefill-first's sort key with laps' plugin (``late_last_ttft_s``): pushed back last, then those
        waiting past their TTFT objective, then the fewest uncached tokens, then queue-entry time (module doc)."""
        now = self._now

        def key(r: _Req) -> tuple:
            work = r.prefill_work
            return r.rid in pushed_back, now - r.entry_time > self._late_last_objective_s(work), work, r.entry_time

        return key

    def _late_last_objective_s(self, work: int) -> float:
        """The plugin's TTFT objective of a request with ``work`` tokens to prefill (seconds from its queue entry)."""
        return self.config.late_last_ttft_s + self.config.late_last_per_1k_s * work / 1000

    def _deadline_order_in_time(self, pushed_back: set[str]) -> None:
        """After the late-last sort: the leading requests, those neither late nor pushed back, in the plugin's deadline
        order (:func:`engines.sglang_plugin.laps_sglang_plugin.deadline_order`) after the rest of the chunked
        prefill in progress; with ``late_last_short_pass_tokens``, the next pass's token budget under the plugin's
        short pass rule (:func:`~engines.sglang_plugin.laps_sglang_plugin.short_pass_budget`)."""
        cfg, now = self.config, self._now
        in_time = []
        for r in self._waiting:  # in time, then late, then pushed back
            work = r.prefill_work
            objective_s = self._late_last_objective_s(work)
            if r.rid in pushed_back or now - r.entry_time > objective_s:
                break
            in_time.append((r, work, r.entry_time + objective_s))
        chunked = self._chunked
        ahead = 0 if chunked is None else chunked.fill_len - chunked.kv_len
        self._waiting[:len(in_time)] = deadline_order(in_time, now, cfg.late_last_deadline_order_tokens,
                                                      cfg.late_last_prefill_s_per_1k, ahead)
        if cfg.late_last_short_pass_tokens is not None:  # the plugin's short pass, from the same requests in time
            shorts = [work for _, work, _ in in_time if work <= cfg.late_last_deadline_order_tokens]
            self._pass_budget_tokens = short_pass_budget(shorts, cfg.late_last_short_pass_tokens, ahead)

    def _spf_chunk_limit(self, chunked: _Req, budget: int) -> int | None:
        """shortest-prefill-first: cap the continuing chunk so shorter waiting prefills fit (None: no cap)."""
        if self.config.schedule_policy != "shortest-prefill-first" or budget < 2:
            return None
        remaining = chunked.fill_len - chunked.kv_len
        reserved = 0
        for req in self._waiting:
            work = req.prefill_work
            if work >= remaining or reserved + work > budget - 1:
                break
            reserved += work
        return budget - reserved if reserved else None

    def _preempt_to_schedule(self, req: _Req, adder: _Adder, preempted: list[_Req]) -> bool:
        """Release running requests of sufficiently lower priority to make room for ``req`` (SGLang's rule)."""
        sign = self._priority_sign
        candidates = sorted(self._running, key=lambda r: (r.priority * -sign, -r.entry_time))
        max_new = min(req.max_new_tokens, CLIP_MAX_NEW_TOKENS)
        to_remove = req.fill_len - req.prefix_len + max_new - adder.remaining_total()
        chosen: list[_Req] = []
        for r in candidates:
            if (req.priority - r.priority) * -sign <= self.config.priority_scheduling_preemption_threshold:
                break
            chosen.append(r)
            to_remove -= adder.running_offset(r)
            if to_remove <= 0:
                break
        if not chosen or to_remove > 0:
            return False
        chosen_ids = {id(r) for r in chosen}
        keep = [r for r in self._running if id(r) not in chosen_ids]
        count = len(self._running)
        for r in self._running:
            if id(r) in chosen_ids:
                adder.total_offset -= adder.running_offset(r)
                count -= 1
                self._release_running(r, remaining=count)
        self._running = keep
        preempted.extend(chosen)
        return True

    def _requeue(self, reqs: list[_Req]) -> None:
        """Put released requests at the back of the queue, as new arrivals (``_add_request_to_queue``)."""
        for r in reqs:
            r.entry_time = self._now
            r.arrival_processed = self._processed_tokens
            self._waiting.append(r)

    # ---- decode (update_running_batch) ---------------------------------------------------------

    def _update_running_batch(self, events: list[RequestEvent]) -> bool:
        """Make room for one token per running request, retracting if needed; True when it retracted."""
        if self._decode_fits(len(self._running)):
            return False
        order = sorted(self._running, key=lambda r: (len(r.output_ids), -len(r.input_ids)), reverse=True)
        retracted: list[_Req] = []
        first = True
        while first or not self._decode_fits(len(order)):
            if len(order) == 1:
                break
            first = False
            victim = order.pop()
            self._release_running(victim, remaining=len(order))
            retracted.append(victim)
        if len(order) <= 1 and not self._decode_fits(len(order)):
            last = order.pop()
            self._running_ctx -= last.kv_len
            events.append(self._finish(last, "abort", None, ()))
        self._running = order
        self._batch_is_full = False
        self._num_retracted += len(retracted)
        self._requeue(retracted)
        total_out = sum(len(r.output_ids) for r in order)
        total_max = sum(r.max_new_tokens for r in order)
        self._ratio = min(1.0, (total_out + RETRACT_DECODE_STEPS * len(order)) / (total_max + 1))
        return True

    def _release_running(self, req: _Req, remaining: int) -> None:
        """Retract or preempt ``req``: free its private KV (not cached), then evict 20 tokens per request left."""
        self._running_ctx -= req.kv_len
        self._release(req, insert=False)
        req.prefix_len = 0
        req.matched = self.tree.peek_prefix(req.fill_ids()[:-1])
        self.tree.evict(remaining * RETRACT_DECODE_STEPS)

    # ---- KV accounting ----------------------------------------------------------------------

    def _room(self) -> int:
        """Free plus evictable pool tokens."""
        return self.config.max_total_tokens - self.tree.protected_size - self._private

    def _decode_fits(self, n: int) -> bool:
        return n <= self._room()

    def _alloc(self, n: int) -> bool:
        """Take ``n`` pool tokens for requests' private KV, evicting cache if needed."""
        short = n - (self.config.max_total_tokens - self.tree.total_size - self._private)
        if short > 0:
            self.tree.evict(short)
            if n > self.config.max_total_tokens - self.tree.total_size - self._private:
                return False
        self._private += n
        return True

    def _cache_prefix(self, req: _Req) -> None:
        """Insert the computed part of a prefill into the tree and move the request's lock to it."""
        node, _ = self.tree.insert(req.fill_ids()[: req.kv_len])
        self._private -= req.kv_len - req.locked_len
        self.tree.lock(node)
        if req.node is not None:
            self.tree.unlock(req.node)
        req.node, req.locked_len = node, req.kv_len

    def _release(self, req: _Req, insert: bool) -> None:
        """Give back a request's KV: its computed tokens go to the cache (``insert``) or are freed."""
        if insert and req.kv_len > req.locked_len:
            self.tree.insert(req.fill_ids()[: req.kv_len])
        self._private -= req.kv_len - req.locked_len
        if req.node is not None:
            self.tree.unlock(req.node)
        req.node, req.locked_len, req.kv_len = None, 0, 0

    # ---- tokens and finishing ---------------------------------------------------------------

    def _produce(self, req: _Req) -> RequestEvent:
        """Sample the next planned token of ``req`` (or finish a max_new_tokens=0 request)."""
        out = req.output_ids
        first = not out
        if req.max_new_tokens == 0:
            self._drop_running(req)
            return self._finish(req, "length", None, (), first=True)
        tok = req.plan[len(out)]
        out.append(tok)
        new = (tok,)
        n = len(out)
        if n == len(req.plan):
            self._drop_running(req)
            return self._finish(req, req.plan_reason, tok if req.plan_reason == "stop" else None, new, first)
        if req.detok is not None:
            start = req.detok.add(new)
            found = find_stop(req.detok.text, req.stop, start)
            if found is not None:
                self._drop_running(req)
                return self._finish(req, "stop", found[1], new, first)
        if first:
            return RequestEvent(req.rid, new, n, len(req.input_ids), req.cached_tokens or 0, True, None, None,
                                req.queue_time_s)
        return RequestEvent(req.rid, new, n, len(req.input_ids), req.cached_tokens or 0)

    def _drop_running(self, req: _Req) -> None:
        self._running.remove(req)
        self._running_ctx -= req.kv_len
        self._batch_is_full = False

    def _finish(self, req: _Req, reason: str, matched: int | str | None, new: tuple[int, ...],
                first: bool = False) -> RequestEvent:
        self._release(req, insert=True)
        del self._reqs[req.rid]
        return RequestEvent(req.rid, new, len(req.output_ids), len(req.input_ids), req.cached_tokens or 0,
                            first, reason, matched, req.queue_time_s if first else None)

    # ---- stats ------------------------------------------------------------------------------

    def stats(self) -> CoreStats:
        """The current load snapshot (see :class:`CoreStats`)."""
        cfg = self.config
        used = self.tree.protected_size + self._private
        waiting_uncached = sum(r.fill_len - r.matched for r in self._waiting)
        if self._chunked is not None:
            waiting_uncached += self._chunked.fill_len - self._chunked.kv_len
        recent = self._recent[-40:]
        busy = sum(d for _, d, _ in recent)
        span = (recent[-1][0] + recent[-1][1] - recent[0][0]) if recent else 0.0
        tokens = sum(t for _, _, t in recent)
        running = len(self._running) + (1 if self._chunked is not None else 0)
        return CoreStats(
            num_running_reqs=running,
            num_waiting_reqs=len(self._waiting) + len(self._arrived),
            num_waiting_uncached_tokens=waiting_uncached,
            num_used_tokens=used,
            num_total_tokens=used + sum(r.fill_len for r in self._waiting),
            max_total_num_tokens=cfg.max_total_tokens,
            max_running_requests=cfg.max_running_requests,
            token_usage=used / cfg.max_total_tokens,
            cache_hit_rate=self._last_hit_rate,
            gen_throughput=tokens / span if span > 0 else 0.0,
            utilization=busy / span if span > 0 else 0.0,
            evictable_tokens=self.tree.evictable_size,
            total_prefill_uncached_tokens=self._total_prefill_uncached,
            total_prefill_busy_s=self._total_prefill_busy_s,
            num_retracted_reqs=self._num_retracted,
            new_token_ratio=self._ratio,
        )


class _Adder:
    """One pass's prefill budgets (SGLang's ``PrefillAdder`` with a ``PrefillBudget`` at page size 1)."""

    def __init__(self, core: EngineCore) -> None:
        cfg = core.config
        self.core = core
        mixed = len(core._running) if cfg.enable_mixed_chunk else 0
        self.rem_input = cfg.max_prefill_tokens - mixed
        self.rem_chunk = None if cfg.chunked_prefill_size is None else cfg.chunked_prefill_size - mixed
        self.total_offset = mixed + sum(self.running_offset(r) for r in core._running)
        self.current_offset = mixed
        self.batch: list[tuple[_Req, int]] = []
        self.new_chunked: _Req | None = None

    def running_offset(self, req: _Req) -> float:
        """Decode room a running request may still need: min(max_new − produced, 4096) · ratio."""
        ratio = 1.0 if req.ignore_eos else self.core._ratio
        return min(req.max_new_tokens - len(req.output_ids), CLIP_MAX_NEW_TOKENS) * ratio

    def remaining_total(self) -> float:
        """Pool room left after every reservation (SGLang's ``rem_total_tokens``)."""
        return self.core._room() - self.total_offset

    def budget_state(self) -> int:
        """Whether admission may go on: no room left, a spent input or chunk budget, or continue."""
        room = self.core._room()
        if not (room - self.total_offset > 0 and room - self.current_offset > 0):
            return _NO_TOKEN
        if self.rem_input <= 0 or (self.rem_chunk is not None and self.rem_chunk <= 0):
            return _OTHER
        return _CONTINUE

    def _reserve(self, extend: int, max_new: int) -> None:
        self.total_offset += extend + 1 + max_new
        self.current_offset += extend + 1
        self.rem_input -= extend
        if self.rem_chunk is not None:
            self.rem_chunk -= extend

    def add_chunked(self, req: _Req, limit: int | None) -> _Req | None:
        """Continue the chunked request; returns it while chunks remain after this one, else None."""
        assert self.rem_chunk is not None
        rem = min(self.rem_chunk, int(self.remaining_total()))
        if rem <= 0:
            rem = self.rem_chunk  # a continuing chunk must progress to release its KV
        if limit is not None:
            rem = min(rem, limit)
        cand = req.fill_len - req.kv_len
        truncated = cand > rem
        ext = min(cand, rem)
        self.batch.append((req, ext))
        self._reserve(ext, 0 if truncated else min(req.max_new_tokens, CLIP_MAX_NEW_TOKENS))
        return req if truncated else None

    def add_one(self, req: _Req, node: RadixNode, has_chunked: bool) -> int:
        """Try to admit ``req``, whose cached prefix (``req.prefix_len`` tokens) ends at ``node``.

        On admission ``req`` takes a lock on ``node``; returns an AddReqResult code.
        """
        core = self.core
        tree = core.tree
        cand = req.fill_len - req.prefix_len
        reserve_new = min(max(req.max_new_tokens - len(req.output_ids), 0), CLIP_MAX_NEW_TOKENS)
        tree.lock(node)  # the matched prefix is not evictable room for itself
        if not cand + reserve_new + 1 < self.remaining_total():
            tree.unlock(node)
            return _NO_TOKEN
        if self.rem_chunk is None and self.batch and cand >= self.rem_input:
            tree.unlock(node)
            return _OTHER
        ext, max_new = cand, min(req.max_new_tokens, CLIP_MAX_NEW_TOKENS)
        if self.rem_chunk is not None and cand > self.rem_chunk:
            if has_chunked and core.config.schedule_policy == "shortest-prefill-first":
                tree.unlock(node)
                return _OTHER  # only one unfinished chunked request can be tracked
            ext, max_new = self.rem_chunk, 0
            if ext <= 0:
                tree.unlock(node)
                return _OTHER
            self.new_chunked = req
        req.node = node
        self.batch.append((req, ext))
        self._reserve(ext, max_new)
        return self.budget_state()
