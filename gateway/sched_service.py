"""The scheduler process's side of several gateway workers: the gateway's messages over :mod:`gateway.sched_channel`.

With ``gateway.workers`` > 1 (:mod:`gateway.workers`) one process holds the
scheduling state, a whole :class:`~gateway.state.Gateway` started as in one
process (engines, registry and health, dispatcher queues and AWD windows,
prefix caches and KV events, controller), but serves no HTTP: the workers do,
and ask it through :class:`SchedulerService`. The worker's side is
:mod:`gateway.sched_worker`.

Messages (msgpack maps; ``op`` says which). Calls, answered:

- ``{"op": "state"}`` -> ``{"engines": [[id, url, pool, healthy, draining,
  stalled, in_flight, in_flight_prompt_tokens, kv_capacity_tokens,
  max_running_requests], ...],
  "roles": {id: role}, "context_tokens": int | None, "stats": {name: value}}``:
  the registry in configuration order, the role each engine runs now (the
  controller or the admin API may have moved it), the model's context length, the scheduler's
  :meth:`~policies.scheduler.Scheduler.stats`. Workers ask at start and then
  every :data:`gateway.sched_worker.STATE_POLL_S`.
- ``{"op": "place", "rid", "keys": bytes, "ids": bytes, "arrival_s",
  "deadline_s", "max_tokens", "reply_tokens", "stream", "priority"}``: an
  :class:`~gateway.dispatcher.Arrival` (``keys``/``ids``: the prompt chain's
  block keys as signed 64-bit and token ids as unsigned 32-bit machine
  integers, ``array.tobytes()``), classified here against the global prefix
  index and admitted (:meth:`gateway.dispatcher.Dispatcher.place`) ->
  ``{"engine", "class", "cached_by_engine": {engine: tokens}, "deadline_s"}``
  once dispatched, or ``{"error": {"status", "message", "type", "code"}}``
  (503 no engine, 500 policy failure, 503 shutting down). In a prefill-decode
  deployment ``engine`` is the prefill engine and the answer has ``"decode"``,
  the decode engine picked then (:meth:`gateway.pd_setup.PDDispatch.take_decode`;
  503 when none is healthy).

- ``{"op": "admin_engines"}`` -> ``{"engines": [row, ...]}``: ``GET /admin/engines``'
  rows (:func:`gateway.admin.engine_rows`);
- ``{"op": "admin_role", "engine", "role", "drain_timeout_s"}`` -> ``{"status":
  200 | 202, "answer": {...}}`` or ``{"error": {"status", "message", "type",
  "param", "code"}}``: the admin API's role switch, checked and started here
  (:func:`gateway.admin.begin_switch`; a worker has checked the key and the body).

Notes, one-way, applied in the order sent (one connection per worker):

- ``{"op": "first", "rid", "engine", "cached", "ends"}``: the request's first token
  (``cached``: the engine's reported ``cached_tokens`` or None); ``ends``: in PD, the
  prefill engine's answer, whose load ends there, as in one process
  (:meth:`gateway.dispatcher.Dispatcher.first_token`'s ``load_ends``);
- ``{"op": "decoding", "rid", "late"}``: in PD, the decode engine's first token
  reached the client (:meth:`gateway.pd_setup.PDDispatch.decoding`);
- ``{"op": "done", "rid"}``: the request ended (answered, failed, client gone);
  a ``place`` still waiting is withdrawn;
- ``{"op": "insert", "engine", "keys": bytes}``, ``{"op": "observe", "engine",
  "keys": bytes, "cached", "routed"}``: the prefix index learns what the engine holds
  (:meth:`policies.exact_prefix.PrefixCaches.insert` / ``observe``);
- ``{"op": "down", "engine", "why", "stalled"}``: a worker saw the engine fail:
  it leaves service here (:func:`gateway.health.take_out_of_service`); the
  health poll brings it back.

A worker whose connection drops (it died) has its requests released: those
waiting are withdrawn, those dispatched complete and are aborted on their
engines (``/abort_request``; in PD on both).
"""

from __future__ import annotations

import asyncio
import logging
from array import array
from dataclasses import dataclass
from functools import partial

from gateway.admin import begin_switch, engine_rows
from gateway.dispatcher import Arrival
from gateway.errors import APIError
from gateway.health import take_out_of_service
from gateway.pd_setup import no_decode_engine
from gateway.priority import engine_role
from gateway.relay import in_background
from gateway.sched_channel import ChannelServer, Peer
from gateway.state import Gateway
from policies.prefix_index import BlockChain
from policies.types import RequestView

log = logging.getLogger("laps.gateway")


def engines_of(gw: Gateway) -> list[list]:
    """The registry as the ``state`` call sends it (module doc)."""
    return [[e.id, e.url, e.pool, e.healthy, e.draining, e.stalled, e.in_flight, e.in_flight_prompt_tokens, e.kv_capacity_tokens,
             e.max_running_requests] for e in gw.registry]


@dataclass
class _Placed:
    """A dispatched request not done yet: its view, engine (in PD the prefill engine), worker, and in PD its
    ``decode`` engine."""

    view: RequestView
    engine: str
    peer: Peer
    decode: str | None = None


class SchedulerService:
    """Answers the workers' calls and notes (module doc) on ``gw``, the scheduler process's gateway (``switches``:
    its app's role switches in progress, :data:`gateway.admin.SWITCHES`).

    :meth:`start` listens on the Unix socket ``path``; :meth:`close` drops the workers.
    """

    def __init__(self, gw: Gateway, switches: dict[str, asyncio.Task]) -> None:
        self.gw = gw
        self.switches = switches
        self._placed: dict[str, _Placed] = {}
        # place calls not answered yet: view, the dispatcher's future, the channel's answer, its worker
        self._waiting: dict[str, tuple[RequestView, asyncio.Future[str], asyncio.Future[dict], Peer]] = {}
        self._server: ChannelServer | None = None
        self._ops = {"state": self._state, "place": self._place, "first": self._first, "done": self._done, "insert": self._insert,
                     "observe": self._observe, "down": self._down, "admin_engines": self._admin_engines, "admin_role": self._admin_role,
                     "decoding": self._decoding}

    async def start(self, path: str) -> None:
        """Listen for workers on ``path``.

        Raises:
            OSError: the socket cannot be bound there.
        """
        self._server = ChannelServer(path, self.handle, on_disconnect=self.worker_gone)
        await self._server.start()

    async def close(self) -> None:
        if self._server is not None:
            await self._server.close()

    def handle(self, message: dict, peer: Peer):
        """One worker message (module doc); an unknown ``op`` raises ``KeyError`` (the caller's ChannelError)."""
        return self._ops[message["op"]](message, peer)

    def worker_gone(self, peer: Peer) -> None:
        """Release what the worker of ``peer`` left: its waiting requests are withdrawn (first, so that the capacity
        freed next goes to others), its dispatched ones complete and are aborted on their engines."""
        for rid in [rid for rid, (_, _, _, owner) in self._waiting.items() if owner is peer]:
            self._withdraw(rid)
        rids = [rid for rid, placed in self._placed.items() if placed.peer is peer]
        for rid in rids:
            placed = self._placed.pop(rid)
            self._end(placed)
            for engine_id in (placed.engine, placed.decode):
                if engine_id is not None:
                    in_background(self.gw.client.abort(self.gw.registry[engine_id].url, rid))
        log.info("a gateway worker's channel closed; %d of its requests were in flight (released, aborted on their engines)", len(rids))

    def _state(self, message: dict, peer: Peer) -> dict:
        return {"engines": engines_of(self.gw), "roles": {e.id: engine_role(self.gw, e.id) for e in self.gw.registry}, "context_tokens": self.gw.context_tokens, "stats": self.gw.dispatcher.scheduler.stats()}

    def _place(self, message: dict, peer: Peer) -> dict | asyncio.Future[dict]:
        """The answer (module doc) when the dispatcher decides at once, else a future of it, set from the dispatcher's
        future's callback (no task per call)."""
        rid = message["rid"]
        chain = BlockChain(self.gw.prefix_index.block_tokens, array("q", message["keys"]), array("I", message["ids"]))
        arrival = Arrival(rid, chain, message["arrival_s"], message["deadline_s"], message["max_tokens"], tuple(message["reply_tokens"]),
                          message["stream"], message["priority"])
        view = self.gw.dispatcher.classify(arrival)
        decided = self.gw.dispatcher.enter(view, chain.keys)
        if decided.done():
            return self._answer(view, decided, peer)
        answer = asyncio.get_running_loop().create_future()
        self._waiting[rid] = (view, decided, answer, peer)
        decided.add_done_callback(partial(self._decided, rid))
        return answer

    def _decided(self, rid: str, decided: asyncio.Future[str]) -> None:
        waiting = self._waiting.pop(rid, None)
        if waiting is None:  # withdrawn (``decided`` was cancelled)
            return
        view, _, answer, peer = waiting
        try:
            answer.set_result(self._answer(view, decided, peer))
        except Exception as err:  # the caller's ChannelError
            answer.set_exception(err)

    def _answer(self, view: RequestView, decided: asyncio.Future[str], peer: Peer) -> dict:
        """The place call's answer from the dispatcher's done future; a dispatched request is ``peer``'s from now.

        Raises:
            Exception: ``decided``'s, when it is not an :class:`~gateway.errors.APIError` (a bug: the channel's error).
        """
        try:
            engine_id = decided.result()
        except APIError as err:
            return _error(err)
        answer = {"engine": engine_id, "class": view.request_class, "cached_by_engine": dict(view.cached_by_engine), "deadline_s": view.deadline_s}
        placed = _Placed(view, engine_id, peer)
        if self.gw.pd is not None:  # the decode engine is picked now, as one process picks it right after the prefill engine
            placed.decode = answer["decode"] = self.gw.pd.take_decode(self.gw.registry, view.rid, view.prompt_tokens, view.stream,
                                                                       self.gw.dispatcher.clock())
            if placed.decode is None:
                self.gw.dispatcher.complete(view, engine_id)
                return _error(no_decode_engine())
        self._placed[view.rid] = placed
        return answer

    def _withdraw(self, rid: str) -> None:
        view, decided, answer, _ = self._waiting.pop(rid)
        self.gw.dispatcher.withdraw(view, decided)
        answer.cancel()  # nobody to answer

    def _admin_engines(self, message: dict, peer: Peer) -> dict:
        return {"engines": engine_rows(self.gw, self.switches)}

    def _admin_role(self, message: dict, peer: Peer) -> dict:
        try:
            status, answer = begin_switch(self.gw, self.switches, message["engine"], message["role"], message["drain_timeout_s"])
        except APIError as err:
            return {"error": {"status": err.status, **err.body()["error"]}}
        return {"status": status, "answer": answer}

    def _first(self, message: dict, peer: Peer) -> None:
        if message["rid"] in self._placed:
            self.gw.dispatcher.first_token(message["rid"], message["engine"], message["cached"], message["ends"])

    def _decoding(self, message: dict, peer: Peer) -> None:
        placed = self._placed.get(message["rid"])
        if placed is not None and placed.decode is not None:
            self.gw.pd.decoding(self.gw.dispatcher.first_tokens, message["rid"], placed.decode, self.gw.dispatcher.clock(), message["late"])

    def _done(self, message: dict, peer: Peer) -> None:
        rid = message["rid"]
        placed = self._placed.pop(rid, None)
        if placed is not None:
            self._end(placed)
        elif rid in self._waiting:
            self._withdraw(rid)

    def _end(self, placed: _Placed) -> None:
        """Release a dispatched request's engines."""
        self.gw.dispatcher.complete(placed.view, placed.engine)
        if placed.decode is not None:
            self.gw.pd.release_decode(self.gw.registry, placed.view.rid, placed.decode, placed.view.prompt_tokens, self.gw.dispatcher.clock())

    def _insert(self, message: dict, peer: Peer) -> None:
        self.gw.prefix_index.insert(message["engine"], array("q", message["keys"]))

    def _observe(self, message: dict, peer: Peer) -> None:
        self.gw.prefix_index.observe(message["engine"], array("q", message["keys"]), message["cached"], message["routed"])

    def _down(self, message: dict, peer: Peer) -> None:
        engine = self.gw.registry[message["engine"]]
        if engine.serving:
            take_out_of_service(self.gw, engine, f"{message['why']} (seen by a gateway worker)", stalled=message["stalled"])


def _error(err: APIError) -> dict:
    """A place call's error answer (module doc)."""
    return {"error": {"status": err.status, "message": err.message, "type": err.type, "code": err.code}}
