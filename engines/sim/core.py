"""The simulated engine's scheduler: SGLang 0.5.23 batching semantics, pure and clock-injected.

No asyncio, no clock, no I/O: the caller passes ``now`` (seconds on any clock)
and runs the forward pass each :meth:`EngineCore.step` returns for
``duration_s``; the real-time HTTP shell and a virtual-time simulator drive the
same object. What it models (``managers/scheduler.py``, ``schedule_policy.py``):

* a FCFS waiting queue; each step is either a prefill (extend) batch or, when no
  request can be admitted, a decode step of every running request — SGLang's
  default; with ``enable_mixed_chunk`` the running decodes ride along in the
  prefill batch (``--enable-mixed-chunk``);
* admission under ``max_prefill_tokens`` (the first request of a batch may
  exceed it), ``chunked_prefill_size`` (a prompt longer than what is left is cut
  into chunks; one chunked request at a time, continued first in the next step),
  ``max_running_requests`` and the KV pool: a request needs its uncached tokens
  plus ``min(max_new_tokens, 4096)`` free, where running requests reserve their
  remaining ``min(max_new − produced, 4096) · new_token_ratio`` (ratio 0.7 decaying
  to 0.098 over 600 decode steps, reset when a decode step has to retract);
* a KV pool of ``max_total_tokens`` shared by running requests and a radix prefix
  cache (:class:`~engines.sim.radix.RadixCache`): prompts are matched on all but
  their last token (one token is always computed), every prefill chunk is
  inserted, a finished request inserts prompt and reply; unlocked entries are
  evicted least-recently-used when the pool is short;
* decode retraction when the pool cannot hold one more token per running
  request: fewest-produced-tokens first (ties: longest prompt), back to the head
  of the queue, to be re-prefilled with its reply so far.

Replies are real token ids (:mod:`engines.sim.replies`); ``stop`` strings are
matched on the decoded reply after every token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from engines.sim.latency import LatencyModel, SeqShape
from engines.sim.radix import RadixCache, RadixNode
from engines.sim.replies import IncrementalDetokenizer, ReplyPlan, ReplyPlanner, find_stop
from laps.tokenizer import ChatTokenizer

CLIP_MAX_NEW_TOKENS = 4096  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION
INIT_NEW_TOKEN_RATIO = 0.7  # SGLANG_INIT_NEW_TOKEN_RATIO
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14  # SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR
NEW_TOKEN_RATIO_DECAY_STEPS = 600  # SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS
RETRACT_DECODE_STEPS = 20  # SGLANG_RETRACT_DECODE_STEPS


def default_max_running_requests(max_total_tokens: int, context_length: int) -> int:
    """SGLang's default request-slot count: clip(max_total_tokens / context_length · 512, 2048, 4096)."""
    return min(max(int(max_total_tokens / context_length * 512), 2048), 4096)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Scheduler limits, in tokens and requests (SGLang flag names).

    ``chunked_prefill_size`` None disables chunking (SGLang's ``-1``).

    Raises:
        ValueError: on a non-positive limit.
    """

    max_total_tokens: int
    max_running_requests: int
    chunked_prefill_size: int | None = 8192
    max_prefill_tokens: int = 16384
    context_length: int = 32768
    enable_mixed_chunk: bool = False

    def __post_init__(self) -> None:
        for name in ("max_total_tokens", "max_running_requests", "max_prefill_tokens", "context_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 1:
            raise ValueError(f"chunked_prefill_size must be >= 1 or None, got {self.chunked_prefill_size}")


@dataclass(frozen=True, slots=True)
class RequestEvent:
    """What happened to one request in one step (or on abort).

    ``new_token_ids``: tokens produced now (EOS included when sampled);
    ``completion_tokens``: all produced so far; ``first_token``: this event
    carries the first one; ``finish_reason``: None while running, else
    ``"stop"`` (``matched_stop`` is the EOS id or the stop string), ``"length"``
    or ``"abort"``; ``queue_time_s``: arrival to first admission, set with the
    first token.
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

    @property
    def finished(self) -> bool:
        """True when the request ended with this event."""
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class StepResult:
    """One scheduled forward pass: its duration (s), its batch shapes and its events.

    An idle step (nothing schedulable) has ``duration_s == 0`` and an empty batch.
    """

    duration_s: float
    batch: tuple[SeqShape, ...]
    num_prefill_seqs: int
    num_decode_seqs: int
    events: tuple[RequestEvent, ...]

    @property
    def idle(self) -> bool:
        """True when no forward pass was scheduled."""
        return not self.batch


@dataclass(frozen=True, slots=True)
class CoreStats:
    """A load snapshot (SGLang's ``/v1/loads`` fields). Tokens, requests, rates per second.

    ``num_used_tokens`` excludes evictable cache (SGLang's convention);
    ``num_total_tokens`` adds the waiting requests' prompt tokens;
    ``num_waiting_uncached_tokens`` uses each waiting request's prefix match from
    its arrival or its last admission attempt (as SGLang does), plus what is left
    of a chunked prefill; ``num_running_reqs`` counts a chunked prefill in flight;
    ``cache_hit_rate`` is that of the last prefill batch; ``gen_throughput`` and
    ``utilization`` (busy fraction) are over the last 40 forward passes.
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


class _Req:
    __slots__ = (
        "rid", "input_ids", "max_new_tokens", "ignore_eos", "stop", "arrival", "plan", "output_ids",
        "kv_len", "node", "locked_len", "cached_tokens", "queue_time_s", "detok", "matched",
    )

    def __init__(self, rid: str, input_ids: tuple[int, ...], max_new_tokens: int, ignore_eos: bool,
                 stop: tuple[str, ...], arrival: float, plan: ReplyPlan, detok: IncrementalDetokenizer | None) -> None:
        self.rid = rid
        self.input_ids = input_ids
        self.max_new_tokens = max_new_tokens
        self.ignore_eos = ignore_eos
        self.stop = stop
        self.arrival = arrival
        self.plan = plan
        self.output_ids: list[int] = []
        self.kv_len = 0  # tokens of fill_ids whose KV is computed
        self.node: RadixNode | None = None  # locked cache node covering fill_ids[:locked_len]
        self.locked_len = 0
        self.cached_tokens: int | None = None  # prefix hit at first admission
        self.queue_time_s: float | None = None
        self.detok = detok  # reply text so far, kept only when there are stop strings
        self.matched = 0  # cached prefix found when last matched while waiting

    @property
    def fill_ids(self) -> tuple[int, ...]:
        return self.input_ids + tuple(self.output_ids)

    @property
    def fill_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)


class EngineCore:
    """SGLang-like continuous batching over a simulated GPU (see the module doc).

    ``tokenizer`` decodes replies for stop strings and supplies the reply
    vocabulary; ``latency`` prices every forward pass.
    """

    def __init__(self, config: EngineConfig, latency: LatencyModel, tokenizer: ChatTokenizer) -> None:
        self.config = config
        self.latency = latency
        self._tokenizer = tokenizer
        self._planner = ReplyPlanner(tokenizer)
        self.tree = RadixCache()
        self._waiting: list[_Req] = []
        self._running: list[_Req] = []
        self._chunked: _Req | None = None
        self._reqs: dict[str, _Req] = {}
        self._private = 0  # KV tokens held by requests outside the tree
        self._ratio = INIT_NEW_TOKEN_RATIO
        self._min_ratio = INIT_NEW_TOKEN_RATIO * MIN_NEW_TOKEN_RATIO_FACTOR
        self._ratio_decay = (self._ratio - self._min_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        self._last_hit_rate = 0.0
        self._total_prefill_uncached = 0
        self._total_prefill_busy_s = 0.0
        self._recent: list[tuple[float, float, int]] = []  # (start, duration, decode tokens) of recent passes

    @property
    def eos_token_id(self) -> int:
        """The token id replies end with."""
        return self._planner.eos_token_id

    # ---- requests ---------------------------------------------------------------------------

    def add_request(self, rid: str, input_ids: Sequence[int], max_new_tokens: int | None, ignore_eos: bool = False,
                    stop: Sequence[str] = (), now: float = 0.0) -> None:
        """Queue a request. ``max_new_tokens`` None means up to the context length.

        Raises:
            ValueError: duplicate rid, empty prompt, negative max_new_tokens, or a
                prompt (plus max_new_tokens) that does not fit the context length or the KV pool;
                messages are SGLang's.
        """
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
        if n >= cfg.max_total_tokens:
            raise ValueError(f"Input length ({n} tokens) exceeds the KV pool ({cfg.max_total_tokens} tokens).")
        limit = cfg.context_length - n - 1
        max_new = limit if max_new_tokens is None else min(max_new_tokens, limit)
        plan = self._planner.plan(rid, max_new, ignore_eos)
        stops = tuple(s for s in stop if s)
        detok = IncrementalDetokenizer(self._tokenizer) if stops else None
        req = _Req(rid, tuple(input_ids), max_new, ignore_eos, stops, now, plan, detok)
        req.matched = self.tree.peek_prefix(req.input_ids[:-1])
        self._reqs[rid] = req
        self._waiting.append(req)

    def abort(self, rid: str) -> RequestEvent | None:
        """End request ``rid`` now with ``"abort"``; None when it is unknown or already finished."""
        req = self._reqs.get(rid)
        if req is None:
            return None
        if req in self._waiting:
            self._waiting.remove(req)
        elif req is self._chunked:
            self._chunked = None
        else:
            self._running.remove(req)
        return self._finish(req, "abort", None, ())

    def abort_all(self) -> list[RequestEvent]:
        """Abort every unfinished request (queue order: chunked, running, waiting)."""
        order = ([self._chunked] if self._chunked else []) + list(self._running) + list(self._waiting)
        return [ev for ev in (self.abort(r.rid) for r in order) if ev is not None]

    def flush_cache(self) -> bool:
        """Empty the prefix cache; refused (False) while any request is waiting or running."""
        if self._reqs:
            return False
        self.tree.reset()
        self._last_hit_rate = 0.0
        return True

    def has_work(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self._reqs)

    # ---- the step ---------------------------------------------------------------------------

    def step(self, now: float) -> StepResult:
        """Schedule and apply one forward pass starting at ``now``; its events happen at ``now + duration_s``."""
        if not self._running and self._chunked is None:
            self._ratio = INIT_NEW_TOKEN_RATIO
        prefill = self._schedule_prefill(now)
        events: list[RequestEvent] = []
        decodes: list[_Req] = []
        retracted = False
        if (not prefill or self.config.enable_mixed_chunk) and self._running:
            decodes, retracted = self._prepare_decode(events)
        if not prefill and not decodes:
            return StepResult(0.0, (), 0, 0, tuple(events))
        batch = tuple([(ext, req.kv_len) for req, ext in prefill] + [(1, req.kv_len) for req in decodes])
        duration = self.latency.predict(batch)
        for req, ext in prefill:
            req.kv_len += ext
            self._cache_prefix(req)
            if req.kv_len < req.fill_len:
                self._chunked = req
                continue
            if req is self._chunked:
                self._chunked = None
            self._running.append(req)
            events.append(self._produce(req))
        for req in decodes:
            req.kv_len += 1
            events.append(self._produce(req))
        if prefill:
            self._total_prefill_busy_s += duration
        if decodes and not retracted:
            self._ratio = max(self._ratio - self._ratio_decay, self._min_ratio)
        self._recent.append((now, duration, len(decodes)))
        del self._recent[:-40]
        return StepResult(duration, batch, len(prefill), len(decodes), tuple(events))

    def _reserve(self, req: _Req) -> float:
        left = min(max(req.max_new_tokens - len(req.output_ids), 0), CLIP_MAX_NEW_TOKENS)
        return left * (1.0 if req.ignore_eos else self._ratio)

    def _schedule_prefill(self, now: float) -> list[tuple[_Req, int]]:
        cfg = self.config
        if self._chunked is None and not self._waiting:
            return []
        mixed = len(self._running) if cfg.enable_mixed_chunk else 0
        rem_input = cfg.max_prefill_tokens - mixed
        rem_chunk = None if cfg.chunked_prefill_size is None else cfg.chunked_prefill_size - mixed
        rem_total = (cfg.max_total_tokens - self.tree.total_size - self._private + self.tree.evictable_size
                     - sum(self._reserve(r) for r in self._running))
        batch: list[tuple[_Req, int]] = []
        chunked = self._chunked
        if chunked is not None:
            remaining = chunked.fill_len - chunked.kv_len
            ext = remaining if rem_chunk is None else min(remaining, max(rem_chunk, 1))
            if not self._alloc(ext):
                return []
            batch.append((chunked, ext))
            rem_input -= ext
            rem_chunk = None if rem_chunk is None else rem_chunk - ext
            rem_total -= ext + self._reserve(chunked)
            if ext < remaining:
                return batch
        slots = cfg.max_running_requests - len(self._running) - (1 if chunked is not None else 0)
        hit = new = 0
        while self._waiting and slots > 0 and rem_input > 0 and (rem_chunk is None or rem_chunk > 0):
            req = self._waiting[0]
            fill = req.fill_ids
            prefix_len, node = self.tree.match_prefix(fill[:-1])
            req.matched = prefix_len
            ext = len(fill) - prefix_len
            # Reserve room for the reply too, except for a request alone on an idle engine (liveness).
            reply = min(req.max_new_tokens - len(req.output_ids), CLIP_MAX_NEW_TOKENS)
            if ext + (reply if batch or self._running else 0) >= rem_total:
                break
            if rem_chunk is not None and ext > rem_chunk:
                ext = rem_chunk
            elif ext > rem_input and batch:
                break
            self.tree.lock(node)
            if not self._alloc(ext):
                self.tree.unlock(node)
                break
            self._waiting.pop(0)
            req.node, req.locked_len, req.kv_len = node, prefix_len, prefix_len
            if req.cached_tokens is None:
                req.cached_tokens = prefix_len
                req.queue_time_s = max(0.0, now - req.arrival)
            batch.append((req, ext))
            hit += prefix_len
            new += ext
            slots -= 1
            rem_input -= ext
            rem_total -= ext + self._reserve(req)
            if rem_chunk is not None:
                rem_chunk -= ext
            if ext < len(fill) - prefix_len:
                break  # chunked: it continues first next step
        if hit + new:
            self._last_hit_rate = hit / (hit + new)
        self._total_prefill_uncached += sum(ext for _, ext in batch)
        return batch

    def _prepare_decode(self, events: list[RequestEvent]) -> tuple[list[_Req], bool]:
        """Allocate one token per running request, retracting (or, alone, aborting) until they fit.

        Returns the requests to decode and whether any was retracted.
        """
        retracted: list[_Req] = []
        while self._running and not self._alloc(len(self._running)):
            if len(self._running) == 1:
                victim = self._running.pop()  # alone and still no room: the pool is too small for it
                events.append(self._finish(victim, "abort", None, ()))
                break
            order = sorted(self._running, key=lambda r: (len(r.output_ids), -len(r.input_ids)), reverse=True)
            victim = order[-1]
            self._running.remove(victim)
            self._release(victim, insert=False)
            victim.matched = self.tree.peek_prefix(victim.fill_ids[:-1])
            retracted.append(victim)
        if retracted:
            retracted.sort(key=lambda r: r.arrival)
            self._waiting[:0] = retracted
            total_out = sum(len(r.output_ids) for r in self._running)
            total_max = sum(r.max_new_tokens for r in self._running)
            self._ratio = min(1.0, (total_out + RETRACT_DECODE_STEPS * len(self._running)) / (total_max + 1))
        return list(self._running), bool(retracted)

    # ---- KV accounting ----------------------------------------------------------------------

    def _available(self) -> int:
        return self.config.max_total_tokens - self.tree.total_size - self._private

    def _alloc(self, n: int) -> bool:
        """Take ``n`` pool tokens for requests' private KV, evicting cache if needed."""
        short = n - self._available()
        if short > 0:
            self.tree.evict(short)
            if n > self._available():
                return False
        self._private += n
        return True

    def _cache_prefix(self, req: _Req) -> None:
        """Insert the computed part of a prefill into the tree and move the request's lock to it."""
        node, _ = self.tree.insert(req.fill_ids[: req.kv_len])
        self._private -= req.kv_len - req.locked_len
        self.tree.lock(node)
        if req.node is not None:
            self.tree.unlock(req.node)
        req.node, req.locked_len = node, req.kv_len

    def _release(self, req: _Req, insert: bool) -> None:
        """Give back a request's KV: its computed tokens go to the cache (``insert``) or are freed."""
        if insert and req.kv_len > req.locked_len:
            self.tree.insert(req.fill_ids[: req.kv_len])
        self._private -= req.kv_len - req.locked_len
        if req.node is not None:
            self.tree.unlock(req.node)
        req.node, req.locked_len, req.kv_len = None, 0, 0

    # ---- tokens and finishing ---------------------------------------------------------------

    def _produce(self, req: _Req) -> RequestEvent:
        """Sample the next planned token of ``req`` (or finish a max_new_tokens=0 request)."""
        first = req.cached_tokens is not None and not req.output_ids
        if req.max_new_tokens == 0:
            self._running.remove(req)
            return self._finish(req, "length", None, (), first=True)
        tok = req.plan.token_ids[len(req.output_ids)]
        req.output_ids.append(tok)
        new = (tok,)
        n = len(req.output_ids)
        if n == len(req.plan.token_ids) and req.plan.finish_reason == "stop":
            self._running.remove(req)
            return self._finish(req, "stop", tok, new, first)
        if req.detok is not None:
            start = req.detok.add(new)
            found = find_stop(req.detok.text, req.stop, start)
            if found is not None:
                self._running.remove(req)
                return self._finish(req, "stop", found[1], new, first)
        if n == len(req.plan.token_ids):
            self._running.remove(req)
            return self._finish(req, "length", None, new, first)
        return RequestEvent(req.rid, new, n, len(req.input_ids), req.cached_tokens or 0, first_token=first,
                            queue_time_s=req.queue_time_s if first else None)

    def _finish(self, req: _Req, reason: str, matched: int | str | None, new: tuple[int, ...],
                first: bool = False) -> RequestEvent:
        self._release(req, insert=True)
        del self._reqs[req.rid]
        return RequestEvent(req.rid, new, len(req.output_ids), len(req.input_ids), req.cached_tokens or 0,
                            first_token=first, finish_reason=reason, matched_stop=matched,
                            queue_time_s=req.queue_time_s if first else None)

    # ---- stats ------------------------------------------------------------------------------

    def stats(self) -> CoreStats:
        """The current load snapshot (see :class:`CoreStats`)."""
        cfg = self.config
        used = self.tree.protected_size + self._private
        waiting_uncached = sum(r.fill_len - r.matched for r in self._waiting)
        if self._chunked is not None:
            waiting_uncached += self._chunked.fill_len - self._chunked.kv_len
        busy = sum(d for _, d, _ in self._recent)
        span = (self._recent[-1][0] + self._recent[-1][1] - self._recent[0][0]) if self._recent else 0.0
        tokens = sum(t for _, _, t in self._recent)
        running = len(self._running) + (1 if self._chunked is not None else 0)
        return CoreStats(
            num_running_reqs=running,
            num_waiting_reqs=len(self._waiting),
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
        )
