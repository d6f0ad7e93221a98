"""Virtual-time simulation of a whole deployment: the gateway's policies in front of engine models, no sockets.

What runs is what runs live, minus sockets and the wall clock:

* the **load** of ``laps loadgen``: the same workload and arrival plan
  (:func:`~loadgen.runner.plan_arrivals`, seeded alike, so the same seed gives
  the same conversations, start times and think times); turn k+1 of a
  conversation is sent a think time after turn k's answer, unless the
  duration has passed, with a history that carries the reply the engine
  produced (its tokens, decoded); a request that fails or times out ends its
  conversation;
* the **gateway's path** (``gateway/handlers.py``, ``gateway/dispatcher.py``):
  tokenize with the chat template → prefix index H per engine → classify
  (:func:`~policies.admission.classified_view`) → ``scheduler.submit`` and
  ``decide`` after every arrival, cancel, first token and completion and at the
  time the scheduler asks to be woken → dispatch (counted in the
  :class:`~gateway.registry.EngineRegistry`) → first-token and completion hooks
  → ``prefix_index.observe`` with the engine's reported cached tokens; the
  classifier, prefix index and scheduler are built from the config by the
  same registry functions the gateway uses; with ``scheduling.kv_events`` the
  prefix caches (:class:`~policies.exact_prefix.PrefixCaches`) follow the
  events of every engine that would publish live, taken from its core's radix
  cache when each pass ends (when the live engine publishes them);
* each **engine** an :class:`~engines.sim.core.EngineCore` built from the
  command line the engine manager would give it (its role's flags, parsed by
  the simulated engine's own parser), stepped back to back as the live engine
  loop steps it: the next pass starts the moment the previous one ends, before
  the gateway sees that pass's tokens.

With ``controller.enabled`` the **pressure controller** runs as the gateway
runs it (``gateway/controller_loop.py``): every ``controller.interval_s`` it
decides on :func:`~policies.pool_signals.engine_signals` built from the same
sources (requests held undispatched, each engine core's ``/v1/loads`` fields,
first tokens against their deadlines), and a move is the live role switch
(``gateway/role_switch.py``) in virtual time. A move to a role with the
engine's own flags is instant. Otherwise the engine stops getting work and its
in-flight requests finish; then

* a **restart**: after ``controller.drain_timeout_s`` the requests still
  running fail with a 502 (as when the live engine stops under them), the
  engine is down for ``controller.sim_restart_s``, then a fresh engine core
  with the new role's flags (empty cache, its prefix-index entries forgotten)
  joins the other pool;
* a **flip** between the prefill and decode sides of a PD deployment
  (:meth:`~laps.config.Config.pd_flip`, SGLang's ``POST /pd_role_switch``):
  once the core holds no request at all (:meth:`EngineCore.fully_idle`; asked
  again every :data:`~gateway.role_switch.DRAIN_POLL_S`, as the gateway asks
  again while the engine answers "not idle") it switches its mode
  (:meth:`EngineCore.switch_disaggregation_mode`, cache flushed) and joins the
  other side at once, with no restart time (SGLang resets the radix cache,
  the request slots and the KV allocator in place; a first flip to decode
  also captures decode CUDA graphs, seconds we have not measured and do not
  charge). Still busy after ``drain_timeout_s``, the flip is given up as the
  gateway gives it up: the engine serves its old role again, nothing fails.

The event loop is a heap of ``(time, seq, kind, payload)``; ``seq`` breaks ties
in insertion order. Records are :class:`~loadgen.runner.RequestRecord` filled as
the live runner fills them (TTFT at the first text token, ITL between text
tokens, usage counts, class, errors as ``HTTP <status>: <message>``), so
:func:`loadgen.report.build_report` gives the same JSON.

HTTP hops, tokenization and gateway CPU time are not modelled, except as an
optional serving latency: ``serving_latency_s``, half of it between the
gateway's dispatch and the engine queueing the request, half between an engine
event and the gateway and client seeing it, and ``serving_latency_per_1k_s``
per 1,000 new prompt tokens (the prompt less its longest prefix cached on an
engine, as the gateway counts them) on the way in (tokenizing and moving the
prompt; new tokens are the proxy :mod:`loadgen.agreement` fits); both
0 by default (:func:`loadgen.agreement.serving_latency` measures them on the
live stack at idle).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Callable
from functools import partial
from typing import Any

import orjson

from engines.manager import sim_model, sim_roles
from engines.sim.core import EngineCore, RequestEvent, StepResult
from gateway.registry import EngineRegistry, EngineState
from gateway.role_switch import DRAIN_POLL_S
from laps.config import Config, EngineConfig
from laps.cost import engine_traits
from laps.tokenizer import ChatTokenizer
from loadgen.runner import Arrival, RequestRecord, error_text
from policies.admission import classified_view
from policies.output_predictor import reply_token_counts
from policies.controller import EngineSignals, Move
from policies.pool_signals import FirstTokenWindow, LoadSample, engine_signals, queued_new_tokens
from policies.exact_prefix import PrefixCaches
from policies.prefix_index import PrefixIndex, block_keys
from policies.registry import make_classifier, make_controller, make_scheduler
from policies.types import RequestView

_TURN, _STEP, _WAKE, _TIMEOUT, _ENGINE_IN, _CLIENT_IN, CALL = range(7)  # CALL: payload() at that time
NO_ENGINE_MESSAGE = "no healthy engine is available; retry later"  # the gateway dispatcher's 503


def engine_core(config: Config, engine: EngineConfig, tokenizer: ChatTokenizer, role: str | None = None) -> EngineCore:
    """The engine model of ``engine`` started with ``role``'s flags (default: its configured role); see :func:`engine_cores`.

    Raises:
        ValueError: the role's flags are not a valid (simulated) SGLang command line
            (``roles.<role>.flags.<flag> ...``, see :func:`engines.manager.sim_model`).
    """
    sim = sim_model(config, engine, role)
    return EngineCore(sim.config, sim.latency, tokenizer, kv_events=config.publishes_kv_events(engine))


def engine_cores(config: Config, tokenizer: ChatTokenizer) -> dict[str, EngineCore]:
    """One engine model per configured engine, from the arguments the engine manager would start it with.

    Every kind is modelled on ``config.sim``'s model and GPU, with its role's
    SGLang flags and ``--tp-size`` = its GPU count. The roles an engine may be
    moved to (:func:`engines.manager.sim_roles`) are checked here too, so a bad
    flag fails before the run, not at the first move.

    Raises:
        ValueError: a role's flags are not a valid (simulated) SGLang command line.
    """
    cores = {}
    for engine in config.engines:
        cores[engine.name] = engine_core(config, engine, tokenizer)
        for role in sim_roles(config, engine)[1:]:
            sim_model(config, engine, role)
    return cores


class _Conversation:
    __slots__ = ("arrival", "history", "turn")

    def __init__(self, arrival: Arrival) -> None:
        self.arrival = arrival
        self.history: list[dict[str, str]] = []
        self.turn = 0


class SimRequest:
    __slots__ = ("conv", "record", "view", "keys", "prompt_ids", "engine_id", "output_ids", "last_text_s", "done")

    def __init__(self, conv: _Conversation, record: RequestRecord, view: RequestView, keys: list[int],
                 prompt_ids: list[int]) -> None:
        self.conv = conv
        self.record = record
        self.view = view
        self.keys = keys
        self.prompt_ids = prompt_ids
        self.engine_id: str | None = None
        self.output_ids: list[int] = []
        self.last_text_s: float | None = None
        self.done = False


class EngineSlot:
    __slots__ = ("id", "core", "busy")

    def __init__(self, engine_id: str, core: EngineCore) -> None:
        self.id = engine_id
        self.core = core
        self.busy = False


class VirtualRun:
    """One simulated run of ``config``'s deployment (see the module doc); single use.

    ``ignore_eos`` sends ``ignore_eos`` with every request (``laps loadgen
    --ignore-eos``); a request unanswered after ``request_timeout_s`` is
    recorded as timed out and withdrawn (cancelled if queued at the gateway,
    aborted on its engine), as the live client's timeout does;
    ``serving_latency_s`` and ``serving_latency_per_1k_s`` are the serving path's latency (module doc).

    With ``config.controller.enabled``: ``controller`` is the pressure
    controller; ``moves`` one dict per finished move (engine, pools, role,
    ``kind`` (``instant``, ``flip`` or ``restart``), ``ok`` (False: a flip given
    up), start, drain and restart seconds, end, requests failed by the drain
    timeout); ``control_log`` its ``stats()`` at every decision (with ``t``);
    ``restart_engine_s`` / ``drain_engine_s`` the engine-seconds spent
    restarting / draining for moves.

    Raises:
        ValueError: as :func:`engine_cores`; a negative serving latency.
    """

    def __init__(self, config: Config, tokenizer: ChatTokenizer, *, request_timeout_s: float = 300.0,
                 ignore_eos: bool = False, serving_latency_s: float = 0.0, serving_latency_per_1k_s: float = 0.0) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.registry = EngineRegistry([EngineState(e.name, f"virtual://{e.name}", config.pool(e)) for e in config.engines])
        self.scheduler = make_scheduler(config.scheduling, engine_traits(config))
        self.classifier = make_classifier(config.scheduling)
        self.prefix_index = PrefixCaches(PrefixIndex.from_byte_budget(config.scheduling.prefix_block_tokens, config.scheduling.prefix_index_bytes, len(config.engines)))
        self._engine_configs = {e.name: e for e in config.engines}
        self._roles = {e.name: e.role for e in config.engines}  # the role each engine runs now
        self.engines = {name: EngineSlot(name, core) for name, core in engine_cores(config, tokenizer).items()}
        for name, engine in self.engines.items():  # as the live gateway does from /v1/loads
            self.prefix_index.set_capacity(name, engine.core.config.max_total_tokens)
            self._follow_kv_events(engine)
            self.registry[name].kv_capacity_tokens = engine.core.config.max_total_tokens
            self.registry[name].max_running_requests = engine.core.config.max_running_requests
        self.request_timeout_s = request_timeout_s
        self.ignore_eos = ignore_eos
        if serving_latency_s < 0 or serving_latency_per_1k_s < 0:
            raise ValueError(f"serving latency must be >= 0, got {serving_latency_s} s and {serving_latency_per_1k_s} s per 1k tokens")
        self._hop_s = serving_latency_s / 2
        self._hop_per_token_s = serving_latency_per_1k_s / 1000
        self._delayed_in = bool(self._hop_s or self._hop_per_token_s)  # a request reaches its engine after its decision
        self.records: list[RequestRecord] = []
        self.now = 0.0
        self._special = tokenizer.eos_token_ids
        self._engine_ids = [e.id for e in self.registry]
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self._pending_turns = 0  # _TURN events in the heap
        self._requests: dict[str, SimRequest] = {}
        self._wake_gen = 0
        self._to_kick: list[EngineSlot] = []
        self._failures: list[tuple[SimRequest, int, str]] = []
        self._duration_s = 0.0
        self._on_record: Callable[[RequestRecord], None] | None = None
        self._on_prompt: Callable[[RequestRecord, list[int]], None] | None = None
        self._on_pass: Callable[[str, float, StepResult], None] | None = None
        control = config.controller
        self.controller = make_controller(control.pressure_config(), config.controller_sizes_decode()) if control.enabled else None
        self.first_tokens = FirstTokenWindow(control.window_s, control.min_first_tokens)
        self.moves: list[dict[str, Any]] = []
        self.control_log: list[dict[str, float]] = []
        self.restart_engine_s = 0.0
        self.drain_engine_s = 0.0
        self._move_started_s = 0.0
        self._drained_s: float | None = None  # when the moving engine's drain ended (None: still draining)
        self._drain_failed = 0  # the moving engine's requests failed by the drain timeout

    def run(self, plan: list[Arrival], duration_s: float, on_record: Callable[[RequestRecord], None] | None = None,
            on_progress: Callable[[float], None] | None = None, progress_every_s: float = 1.0,
            on_prompt: Callable[[RequestRecord, list[int]], None] | None = None,
            on_pass: Callable[[str, float, StepResult], None] | None = None) -> list[RequestRecord]:
        """Run every conversation of ``plan`` to its end; the records in completion order.

        ``on_record`` is called as each request ends, ``on_progress(sim_time)``
        about every ``progress_every_s`` simulated seconds, ``on_prompt(record, prompt_ids)`` as each request
        arrives, with its record so far and its prompt's token ids (the chat template applied; do not modify them),
        ``on_pass(engine_id, start_s, result)`` as each forward pass starts (every engine's, in time order).
        """
        self._duration_s = duration_s
        self._on_record = on_record
        self._on_prompt = on_prompt
        self._on_pass = on_pass
        for arrival in plan:
            self._push(arrival.start_s, _TURN, _Conversation(arrival))
        if self.controller is not None:
            self._push(self.config.controller.interval_s, CALL, self._control)
        next_progress = 0.0
        heap = self._heap
        while heap:
            t, _, kind, payload = heapq.heappop(heap)
            self.now = t
            if kind == _STEP:
                self._on_step(*payload)
            elif kind == _TURN:
                self._pending_turns -= 1
                self._on_turn(payload)
            elif kind == _CLIENT_IN:
                self._deliver(*payload)
            elif kind == _ENGINE_IN:
                self._engine_in(*payload)
            elif kind == _WAKE:
                if payload == self._wake_gen:
                    self._decide()
            elif kind == CALL:
                payload()
            else:
                self._on_timeout(payload)
            if self._to_kick:
                self._kick()
            if on_progress is not None and t >= next_progress:
                on_progress(t)
                next_progress = t + progress_every_s
        return self.records

    def _push(self, t: float, kind: int, payload: Any) -> None:
        if kind == _TURN:
            self._pending_turns += 1
        heapq.heappush(self._heap, (t, next(self._seq), kind, payload))

    # ---- client side ---------------------------------------------------------------------------

    def _on_turn(self, conv: _Conversation) -> None:
        now = self.now
        k = conv.turn
        if k and now >= self._duration_s:
            return  # no turn starts at or after the duration
        c = conv.arrival.conversation
        turn = c.turns[k]
        conv.history.append({"role": "user", "content": turn.content})
        rid = f"{c.id}/{k}"
        record = RequestRecord(c.id, c.source, k, turn.content, turn.max_tokens, now)
        prompt_ids = self.tokenizer.encode_chat(conv.history)
        if self._on_prompt is not None:
            self._on_prompt(record, prompt_ids)
        replies = reply_token_counts(conv.history, self.tokenizer.encode) if self.config.scheduling.policy == "backlog" else ()
        view, chain = classified_view(rid, prompt_ids, now, now + self.config.slo.ttft_s, self._engine_ids,
                                      self.prefix_index, self.classifier, turn.max_tokens, replies)
        if self.config.slo.ttft_per_1k_new_tokens_s is not None:
            view = dataclasses.replace(view, length_deadline_s=self.config.slo.length_deadline_s(now, view.new_tokens))
        record.laps_class = view.request_class
        req = SimRequest(conv, record, view, chain.keys, prompt_ids)
        self._requests[rid] = req
        self._push(now + self.request_timeout_s, _TIMEOUT, req)
        self.scheduler.submit(view, now)
        self._decide()

    def _end(self, req: SimRequest) -> None:
        """The request is over for its client: record it; on success the conversation goes on."""
        req.done = True
        self._requests.pop(req.view.rid, None)
        self.prefix_index.in_flight.end(req.view.rid)
        rec = req.record
        self.records.append(rec)
        if self._on_record is not None:
            self._on_record(rec)
        conv = req.conv
        if rec.ok and conv.turn + 1 < len(conv.arrival.conversation.turns):
            reply = self.tokenizer.decode([t for t in req.output_ids if t not in self._special])
            conv.history.append({"role": "assistant", "content": reply})
            conv.turn += 1
            self._push(self.now + conv.arrival.think_s[conv.turn - 1], _TURN, conv)

    def _on_timeout(self, req: SimRequest) -> None:
        if req.done:
            return
        rec = req.record
        rec.error = f"timeout after {self.request_timeout_s:g} s"
        rec.end_s = self.now
        rid = req.view.rid
        if req.engine_id is None:
            self.scheduler.cancel(rid, self.now)
            self._end(req)
            self._decide()
            return
        self.engines[req.engine_id].core.abort(rid)  # the gateway aborts when its client goes away
        self._end(req)
        self._release(req)

    # ---- gateway side (the dispatcher) ---------------------------------------------------------

    def _decide(self) -> None:
        now = self.now
        decision = self.scheduler.decide(self.registry.views(), now)
        for group in decision.dispatches:
            for rid in group.rids:
                self._dispatch(self._requests[rid], group.engine_id)
        for rid in decision.rejected:
            self._fail(self._requests[rid], 503, NO_ENGINE_MESSAGE)
        self._wake_gen += 1
        if decision.wake_at_s is not None:
            self._push(max(now, decision.wake_at_s), _WAKE, self._wake_gen)
        failures, self._failures = self._failures, []
        for req, status, message in failures:
            self._fail(req, status, message)
            self._release(req)

    def _dispatch(self, req: SimRequest, engine_id: str) -> None:
        self.registry.acquire(engine_id, req.view.prompt_tokens)
        self.prefix_index.in_flight.start(req.view.rid, engine_id, req.keys)
        req.engine_id = engine_id
        req.record.cached_tokens_est = req.view.cached_by_engine.get(engine_id, 0)  # as the gateway's headers
        req.record.new_tokens_est = req.view.new_tokens
        if self._delayed_in:
            self._push(self.now + self._hop_s + self._hop_per_token_s * req.view.new_tokens, _ENGINE_IN, (req, self.engines[engine_id]))
        else:
            self._engine_in(req, self.engines[engine_id])

    def _engine_in(self, req: SimRequest, engine: EngineSlot) -> None:
        """The request reaches its engine, which queues it or answers 400."""
        if req.done:
            return  # timed out on the way
        view = req.view
        try:
            engine.core.add_request(view.rid, req.prompt_ids, req.record.max_tokens, self.ignore_eos, (), self.now)
        except ValueError as err:  # the engine answers 400; the gateway relays it
            if self._delayed_in:
                self._fail(req, 400, str(err))
                self._release(req)
            else:
                self._failures.append((req, 400, str(err)))  # inside a decision: after it
            return
        req.record.status = 200  # the engine opens its event stream at once
        if not engine.busy and engine not in self._to_kick:
            self._to_kick.append(engine)

    def _fail(self, req: SimRequest, status: int, message: str) -> None:
        """The gateway answered ``status`` with an OpenAI error carrying ``message``."""
        rec = req.record
        rec.status = status
        rec.error = f"HTTP {status}: {error_text(orjson.dumps({'error': {'message': message}}))}"
        rec.end_s = self.now
        self._end(req)

    def _release(self, req: SimRequest) -> None:
        """The gateway's ``Dispatcher.complete``: the request no longer counts on its engine."""
        assert req.engine_id is not None
        self.registry.release(req.engine_id, req.view.prompt_tokens)
        self.scheduler.on_complete(req.view.rid, req.engine_id, self.now)
        self._decide()
        self._check_drain(req.engine_id)

    def _check_drain(self, engine_id: str) -> None:
        """A request no longer counts on ``engine_id``: if it is the draining engine of a move, see whether it is drained."""
        moving = self.controller.in_progress if self.controller is not None else None
        if moving is not None and moving.engine_id == engine_id and self._drained_s is None:
            self._restart_if_drained(moving)

    # ---- engines -------------------------------------------------------------------------------

    def _kick(self) -> None:
        kicks, self._to_kick = self._to_kick, []
        for engine in kicks:
            if not engine.busy:
                self._step(engine)

    def _follow_kv_events(self, engine: EngineSlot) -> None:
        """Follow ``engine``'s (fresh) core's KV cache events, when it publishes them."""
        if self.config.publishes_kv_events(self._engine_configs[engine.id]):
            self.prefix_index.follow(engine.id, self.config.page_tokens(self._engine_configs[engine.id], self._roles[engine.id]))
            self._publish_kv_events(engine)

    def _publish_kv_events(self, engine: EngineSlot) -> None:
        """Apply the events ``engine``'s core recorded since the last call (a replaced core's are dropped with it)."""
        if self.engines.get(engine.id) is engine:
            self.prefix_index.apply(engine.id, engine.core.take_kv_events())

    def _step(self, engine: EngineSlot) -> None:
        result = engine.core.step(self.now)
        if result.idle:
            self._publish_kv_events(engine)
        if result.admitted:  # tokens streamed at the pass's start (a PD decode engine's arrived requests)
            self._send(engine.id, result.admitted)
        if result.idle:
            engine.busy = False
            self._send(engine.id, result.events)
        else:
            engine.busy = True
            if self._on_pass is not None:
                self._on_pass(engine.id, self.now, result)
            self._push(self.now + result.duration_s, _STEP, (engine, result))

    def _on_step(self, engine: EngineSlot, result: StepResult) -> None:
        engine.busy = False
        self._publish_kv_events(engine)  # the pass ended: its cache changes are published
        if engine.core.has_work():
            self._step(engine)  # the next pass starts before the gateway sees this one's tokens
        self._send(engine.id, result.events)

    def _send(self, engine_id: str, events: tuple[RequestEvent, ...]) -> None:
        """An engine's events leave for the gateway and client."""
        if not events:
            return
        if self._hop_s:
            self._push(self.now + self._hop_s, _CLIENT_IN, (engine_id, events))
        else:
            self._deliver(engine_id, events)

    def _deliver(self, engine_id: str, events: tuple[RequestEvent, ...]) -> None:
        now = self.now
        for ev in events:
            req = self._requests.get(ev.rid)
            if req is None or req.done:
                continue  # timed out and withdrawn
            self._record_tokens(req, ev)
            if ev.first_token:
                # Prefilled: cached there from now on (as the live relay).
                self.prefix_index.in_flight.end(ev.rid)
                self.prefix_index.insert_prefilled(engine_id, req.keys, req.view.cached_by_engine.get(engine_id, 0))
                if self.controller is not None:
                    self.first_tokens.record(engine_id, now, req.view.deadline_s)
                self.scheduler.on_first_token(ev.rid, engine_id, now, ev.cached_tokens)
                self._decide()
            if ev.finished:
                self._complete(req, ev)

    def _record_tokens(self, req: SimRequest, ev: RequestEvent) -> None:
        """The client receives ``ev``'s tokens now: TTFT at the first text token, ITL between text tokens."""
        now, rec = self.now, req.record
        for token in ev.new_token_ids:
            req.output_ids.append(token)
            if token in self._special:
                continue  # EOS carries no text: the client sees no chunk content
            if req.last_text_s is None:
                rec.ttft_s = now - rec.start_s
            else:
                rec.itl_s.append(now - req.last_text_s)
            req.last_text_s = now

    def _complete(self, req: SimRequest, ev: RequestEvent) -> None:
        rec = req.record
        rec.end_s = self.now
        rec.prompt_tokens, rec.completion_tokens, rec.cached_tokens = ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens
        rec.e2e_s = rec.end_s - rec.start_s
        if rec.ttft_s is not None and ev.completion_tokens > 1:
            rec.tpot_s = (rec.e2e_s - rec.ttft_s) / (ev.completion_tokens - 1)
        assert req.engine_id is not None
        # As the live gateway does: the engine now caches the prompt and the reply (re-encoded from its text).
        reply_ids = self.tokenizer.encode(self.tokenizer.decode([t for t in req.output_ids if t not in self._special]))
        self.prefix_index.observe(req.engine_id, block_keys(req.prompt_ids + reply_ids, self.prefix_index.block_tokens), ev.cached_tokens,
                                  req.view.cached_by_engine.get(req.engine_id, 0))
        self._end(req)
        self._release(req)

    # ---- the pressure controller (as gateway/controller_loop.py and gateway/role_switch.py) ----

    def pool_signals(self) -> list[EngineSignals]:
        """The controller's :class:`~policies.controller.EngineSignals` now (see :func:`~policies.pool_signals.engine_signals`)."""
        queued = queued_new_tokens(r.view for r in self._requests.values() if r.engine_id is None and not r.done)
        loads = {}
        for engine_id, engine in self.engines.items():
            s = engine.core.stats()
            loads[engine_id] = LoadSample(s.num_waiting_uncached_tokens, s.num_running_reqs, s.token_usage, s.num_waiting_reqs,
                                          s.max_running_requests)
        return engine_signals(self.registry.views(), queued, loads, self.first_tokens, self.now, decode=self.registry.decode_views())

    def _control(self) -> None:
        """One controller decision; the next one ``interval_s`` later while a request is active or a turn is yet to start.

        Leftover request-timeout events of finished requests do not count, so
        the decisions stop with the load (a move in progress still completes).
        """
        assert self.controller is not None
        move = self.controller.decide(self.pool_signals(), self.now)
        self.control_log.append({"t": self.now, **self.controller.stats()})
        if move is not None:
            self._start_move(move)
        if self._requests or self._pending_turns:
            self._push(self.now + self.config.controller.interval_s, CALL, self._control)

    def _start_move(self, move: Move) -> None:
        """Stop routing to the engine; it flips or restarts once drained (module doc), or joins the other pool now
        when the new role has its flags (as ``gateway/role_switch.py``: with its requests and its cache)."""
        role = self.config.controller.role_for(move.to_pool)
        self._move_started_s = self.now
        if self.config.instant_move(self._roles[move.engine_id], role):
            self._joined(move, role, "instant")
            return
        self.registry[move.engine_id].draining = True
        self._drained_s = None
        self._drain_failed = 0
        self._push(self.now + self.config.controller.drain_timeout_s, CALL, partial(self._drain_timeout, move))
        self._restart_if_drained(move)

    def _flips(self, move: Move) -> bool:
        return self.config.pd_flip(self._roles[move.engine_id], self.config.controller.role_for(move.to_pool))

    def _drain_timeout(self, move: Move) -> None:
        if self._drained_s is not None or self.controller is None or self.controller.in_progress is not move:
            return  # drained in time
        engine_id = move.engine_id
        if self._flips(move):  # the engine refuses the flip while busy; the gateway gives the move up
            self.registry[engine_id].draining = False
            self._drained_s = self.now
            self.drain_engine_s += self.now - self._move_started_s
            self._record_move(move, self.config.controller.role_for(move.to_pool), "flip", ok=False)
            return
        message = (f"engine {engine_id} at virtual://{engine_id} failed: stopped for a role switch after "
                   f"{self.config.controller.drain_timeout_s:g} s of draining")
        stuck = [r for r in self._requests.values() if r.engine_id == engine_id and not r.done]
        self._drain_failed = len(stuck)
        self.engines[engine_id].core.abort_all()
        for req in stuck:  # the last release restarts the engine
            self._fail(req, 502, message)
            self._release(req)

    def _restart_if_drained(self, move: Move) -> None:
        if self._drained_s is not None or self.controller is None or self.controller.in_progress is not move:
            return  # done already, or given up
        if self.registry[move.engine_id].in_flight:
            return
        if self._flips(move):
            core = self.engines[move.engine_id].core
            if not core.fully_idle():  # "not idle": asked again shortly
                self._push(self.now + DRAIN_POLL_S, CALL, partial(self._restart_if_drained, move))
                return
            self._drained_s = self.now
            self.drain_engine_s += self.now - self._move_started_s
            role = self.config.controller.role_for(move.to_pool)
            core.switch_disaggregation_mode("decode" if move.to_pool == "decode" else "prefill")
            self.prefix_index.forget_engine(move.engine_id)
            self._follow_kv_events(self.engines[move.engine_id])  # from the flushed cache on
            self._joined(move, role, "flip")
            return
        self._drained_s = self.now
        self.drain_engine_s += self.now - self._move_started_s
        self._push(self.now + self.config.controller.sim_restart_s, CALL, partial(self._rejoin, move))

    def _rejoin(self, move: Move) -> None:
        """The engine is back with the new role's flags (a fresh core, empty cache) and serves the other pool."""
        assert self._drained_s is not None
        engine_id = move.engine_id
        role = self.config.controller.role_for(move.to_pool)
        core = engine_core(self.config, self._engine_configs[engine_id], self.tokenizer, role)
        self.engines[engine_id] = EngineSlot(engine_id, core)  # a step still pending on the old core finds nothing to send
        self._roles[engine_id] = role
        self.prefix_index.forget_engine(engine_id)
        self.prefix_index.set_capacity(engine_id, core.config.max_total_tokens)
        self._follow_kv_events(self.engines[engine_id])
        self.registry[engine_id].kv_capacity_tokens = core.config.max_total_tokens
        self.registry[engine_id].max_running_requests = core.config.max_running_requests
        self.restart_engine_s += self.now - self._drained_s
        self._joined(move, role, "restart")

    def _joined(self, move: Move, role: str, kind: str) -> None:
        """The moved engine serves ``move.to_pool`` with ``role`` from now on; the move is over."""
        engine_id = move.engine_id
        self._roles[engine_id] = role
        state = self.registry[engine_id]
        state.pool, state.draining = move.to_pool, False
        self.first_tokens.forget_engine(engine_id)  # as the gateway does after every move
        self._record_move(move, role, kind, ok=True)
        self._decide()

    def _record_move(self, move: Move, role: str, kind: str, ok: bool) -> None:
        """Keep the finished move in :attr:`moves` and tell the controller it is over."""
        assert self.controller is not None
        drained = self.now if kind == "instant" else self._drained_s
        self.moves.append({"engine": move.engine_id, "from_pool": move.from_pool, "to_pool": move.to_pool, "role": role,
                           "kind": kind, "ok": ok, "start_s": self._move_started_s, "drain_s": drained - self._move_started_s,
                           "restart_s": self.now - drained, "end_s": self.now,
                           "drain_failed": 0 if kind == "instant" else self._drain_failed})
        self.controller.on_move_done(move.engine_id, self.now)

    def summary(self) -> dict[str, Any]:
        """What the run did besides serving requests, JSON-ready.

        ``scheduler``: the scheduling policy's ``name`` and its counters at the end of the run (the ``_total``
        entries of its ``stats()``, which the live gateway exports as ``laps_scheduler_<name>``: for laps its short
        batches by trigger, the spill-overs between pools, the requests sent to a prefill in flight). With the
        controller also ``controller`` {``decisions`` (count), ``moves`` (the :attr:`moves` dicts),
        ``restart_engine_s``, ``drain_engine_s``}.
        """
        counters = {name: int(value) if value == int(value) else value  # counts as integers, whatever the policy's type
                    for name, value in self.scheduler.stats().items() if name.endswith("_total")}
        out: dict[str, Any] = {"scheduler": {"name": self.config.scheduling.policy, **counters}}
        if self.controller is not None:
            out["controller"] = {"decisions": len(self.control_log), "moves": list(self.moves),
                                 "restart_engine_s": self.restart_engine_s, "drain_engine_s": self.drain_engine_s}
        return out
