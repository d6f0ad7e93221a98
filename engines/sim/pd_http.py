"""Prefill–decode disaggregation in the simulated engine's HTTP shell: the KV hand-off between two engine processes.

SGLang 0.5.23 runs PD with a router that sends one request body to a prefill
engine and a decode engine at once, carrying ``bootstrap_host``,
``bootstrap_port`` (the prefill engine's ``--disaggregation-bootstrap-port``)
and ``bootstrap_room`` (one id per transfer). The simulated engines do the
same hand-off over plain HTTP, honestly but simply:

* **Prefill engine** (``--disaggregation-mode prefill``): runs the request in
  its :class:`~engines.sim.core.EngineCore` (prefill plus the first token;
  the core then holds the KV, event ``kv_ready``). It serves a *bootstrap
  server* on its bootstrap port: ``GET /sim/kv/{room}`` answers once that
  room's KV is ready (``{"rid", "prompt_tokens"}``; 410 when the request
  ended without it, e.g. aborted, or has ended; 404 while the room is not
  open yet), and ``POST /sim/kv/{room}/done`` ends the transfer
  (:meth:`EngineCore.finish_transfer`): the prefill engine's answer (the first
  token, ``finish_reason`` ``length``) completes then, as SGLang's does. A ``kv_ready`` request without a room (a health check, a direct
  request) is released at once.
* **Decode engine** (``--disaggregation-mode decode``): answers a request only
  with a room. It long-polls the prefill engine's bootstrap server (asking again
  every ``ROOM_POLL_S`` while the room is unknown there: the router sends both
  sides at once, so the decode side can ask before the prefill engine has the
  request, and SGLang's decode side waits for it too), waits the
  modelled transfer time ``prompt_tokens · kv_bytes_per_token / link``
  (``--sim-kv-link-gb-s``; KV bytes per token of one TP rank: each rank sends
  its share over its own link), reports the transfer done, then hands the request to its core
  (:meth:`EngineCore.add_transferred_request`): no prefill compute; its first
  token streams when a pass admits it. A failed hand-off ends the request
  with ``finish_reason`` ``abort``.

With ``--enable-pd-role-switch`` an idle engine flips between the two
(:mod:`engines.sim.role_switch`: :attr:`PDShell.mode` changes) and every PD
engine serves the bootstrap server, as SGLang runs one on every flip-capable
instance.

Not modelled live: transfers sharing a link (each one gets the full
bandwidth; :mod:`engines.sim.kv_transfer` models the sharing in virtual time),
the decode engine's KV pre-allocation before the transfer, and any
transfer-backend specifics (``--disaggregation-transfer-backend`` is accepted
and ignored).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol

import aiohttp
from aiohttp import web

from engines.sim.core import RequestEvent


class PDHost(Protocol):
    """What a :class:`PDShell` asks of the engine it is part of (:class:`engines.sim.realtime.SimEngine`).

    A *track* is the engine's handle on one request's events; the shell hands it back to the caller unopened.
    """

    def submit(self, rid: str, input_ids: list[int], max_new_tokens: int | None, ignore_eos: bool,
               stop: list[str], priority: int | None = None) -> Any: ...

    def open_track(self, rid: str) -> Any: ...

    def add_transferred(self, rid: str, input_ids: list[int], max_new_tokens: int | None, ignore_eos: bool,
                        stop: list[str], priority: int | None = None) -> None: ...

    def finish_transfer(self, rid: str) -> bool: ...

    def deliver(self, events: Iterable[RequestEvent]) -> None: ...


log = logging.getLogger("engines.sim")

KV_POLL_TIMEOUT_S = 600.0  # a decode request waits at most this long for its prefill (SGLang: bootstrap timeout)
ROOM_POLL_S = 0.002  # a decode request asks again this often for a room its prefill engine has not opened yet
CLOSED_ROOMS_KEPT = 65536  # a prefill engine tells a room that has closed (410) from one not opened yet (404) this long


@dataclass
class _Room:
    """One transfer on the prefill side: its request and whether its KV is ready (or lost)."""

    rid: str
    prompt_tokens: int = 0
    state: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class PDShell:
    """The PD side of one simulated engine (``mode`` ``prefill`` or ``decode``); see the module docstring.

    ``link_bytes_per_s``: the KV link's bandwidth; ``kv_bytes_per_token``: KV
    bytes of one token on one TP rank (the ranks transfer in parallel).
    """

    def __init__(self, engine: PDHost, mode: str, link_bytes_per_s: float, kv_bytes_per_token: float) -> None:
        if mode not in ("prefill", "decode"):
            raise ValueError(f"PDShell needs --disaggregation-mode prefill or decode, got {mode!r}")
        self.engine = engine
        self.mode = mode
        self.link_bytes_per_s = link_bytes_per_s
        self.kv_bytes_per_token = kv_bytes_per_token
        self._rooms: dict[int, _Room] = {}  # prefill: by bootstrap_room
        self._room_of: dict[str, int] = {}  # prefill: rid -> room
        self._closed: dict[int, None] = {}  # prefill: the last CLOSED_ROOMS_KEPT rooms closed, oldest first (410, not 404)
        self._receiving: dict[str, asyncio.Task] = {}  # decode: rid -> hand-off task
        self._session: aiohttp.ClientSession | None = None

    def busy(self) -> bool:
        """True while a room is open (prefill side) or a KV hand-off is in flight (decode side)."""
        return bool(self._rooms or self._receiving)

    def transfer_s(self, prompt_tokens: int) -> float:
        """Modelled time to move ``prompt_tokens`` tokens of KV over the link (seconds)."""
        return prompt_tokens * self.kv_bytes_per_token / self.link_bytes_per_s

    # ---- both sides ------------------------------------------------------------------------------

    def submit(self, rid: str, body: dict[str, Any], input_ids: list[int], max_new_tokens: int | None,
               ignore_eos: bool, stop: list[str], priority: int | None) -> Any:
        """Queue an OpenAI request on this PD engine; its events arrive on the returned track (the engine's).

        Raises:
            ValueError: a bad request (as :meth:`SimEngine.submit`), a reused
                room, or, on a decode engine, missing or malformed bootstrap fields.
        """
        room = body.get("bootstrap_room")
        if self.mode == "prefill":
            if room is not None and room in self._rooms:
                raise ValueError(f"bootstrap_room {room} is already in use on this prefill engine")
            track = self.engine.submit(rid, input_ids, max_new_tokens, ignore_eos, stop, priority)
            if room is not None:
                self._rooms[room] = _Room(rid, len(input_ids))
                self._room_of[rid] = room
            return track
        host, port = body.get("bootstrap_host"), body.get("bootstrap_port")
        if not (isinstance(host, str) and isinstance(port, int) and isinstance(room, int)):
            raise ValueError("a --disaggregation-mode decode engine needs bootstrap_host (str), bootstrap_port (int) "
                             "and bootstrap_room (int): send the request through a PD router")
        track = self.engine.open_track(rid)
        self._receiving[rid] = asyncio.get_running_loop().create_task(
            self._receive(rid, f"http://{host}:{port}", room, input_ids, max_new_tokens, ignore_eos, stop, priority))
        return track

    def cancel(self, rid: str) -> RequestEvent | None:
        """Decode side: stop waiting for ``rid``'s KV; its abort event, or None when it is not waiting."""
        task = self._receiving.pop(rid, None)
        if task is None:
            return None
        task.cancel()
        return RequestEvent(rid, (), 0, 0, 0, finish_reason="abort")

    # ---- prefill side ----------------------------------------------------------------------------

    def on_event(self, ev: RequestEvent) -> None:
        """Prefill side: follow each delivered event (KV ready: the room opens; finished: it closes)."""
        room_id = self._room_of.get(ev.rid)
        if ev.kv_ready:
            if room_id is None:  # nobody will fetch it (health check, a request sent here directly)
                self.engine.finish_transfer(ev.rid)
            elif not self._rooms[room_id].state.done():
                self._rooms[room_id].state.set_result(True)
        if ev.finished and room_id is not None:
            room = self._rooms.pop(room_id)
            del self._room_of[ev.rid]
            self._closed[room_id] = None
            if len(self._closed) > CLOSED_ROOMS_KEPT:
                del self._closed[next(iter(self._closed))]
            if not room.state.done():
                room.state.set_result(False)

    def bootstrap_app(self) -> web.Application:
        """The prefill engine's bootstrap server (``GET /sim/kv/{room}``, ``POST /sim/kv/{room}/done``)."""
        app = web.Application()
        app.router.add_get("/sim/kv/{room}", self._kv_get)
        app.router.add_post("/sim/kv/{room}/done", self._kv_done)
        return app

    async def _kv_get(self, request: web.Request) -> web.Response:
        room_id = _room_id(request)
        room = self._rooms.get(room_id)
        if room is None and room_id in self._closed:
            return web.json_response({"error": "the room's request has ended"}, status=410)
        if room is None:  # not opened yet: the decode side asks again
            return web.json_response({"error": "unknown room"}, status=404)
        ready = await asyncio.shield(room.state)
        if not ready:
            return web.json_response({"error": f"request {room.rid} ended before its KV was ready"}, status=410)
        return web.json_response({"rid": room.rid, "prompt_tokens": room.prompt_tokens})

    async def _kv_done(self, request: web.Request) -> web.Response:
        room = self._rooms.get(_room_id(request))
        if room is None or not self.engine.finish_transfer(room.rid):
            return web.json_response({"error": "no transfer in flight for this room"}, status=404)
        return web.json_response({"ok": True})

    # ---- decode side -----------------------------------------------------------------------------

    async def _receive(self, rid: str, bootstrap_url: str, room: int, input_ids: list[int],
                       max_new_tokens: int | None, ignore_eos: bool, stop: list[str], priority: int | None) -> None:
        """Wait for the room's KV at the prefill engine, model its transfer, then decode (module docstring)."""
        try:
            if self._session is None:
                self._session = aiohttp.ClientSession()
            timeout = aiohttp.ClientTimeout(total=KV_POLL_TIMEOUT_S)
            give_up_s = asyncio.get_running_loop().time() + KV_POLL_TIMEOUT_S
            while True:  # the room opens when the prefill engine has the request, which may reach it after this one
                async with self._session.get(f"{bootstrap_url}/sim/kv/{room}", timeout=timeout) as resp:
                    if resp.status == 200:
                        break
                    if resp.status != 404 or asyncio.get_running_loop().time() > give_up_s:
                        raise RuntimeError(f"prefill bootstrap at {bootstrap_url} answered {resp.status}: {await resp.text()}")
                await asyncio.sleep(ROOM_POLL_S)
            await asyncio.sleep(self.transfer_s(len(input_ids)))
            async with self._session.post(f"{bootstrap_url}/sim/kv/{room}/done", timeout=timeout) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"prefill bootstrap at {bootstrap_url} refused the transfer's end: {resp.status}")
            self._receiving.pop(rid, None)
            self.engine.add_transferred(rid, input_ids, max_new_tokens, ignore_eos, stop, priority)
        except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError) as err:
            log.warning("rid=%s: KV hand-off of room %d failed: %s", rid, room, err)
            event = self.cancel(rid)
            if event is not None:
                self.engine.deliver([event])

    async def close(self) -> None:
        """Stop every hand-off in flight and close the HTTP session."""
        for rid in list(self._receiving):
            self.cancel(rid)
        if self._session is not None:
            await self._session.close()


def _room_id(request: web.Request) -> int:
    try:
        return int(request.match_info["room"])
    except ValueError:
        raise web.HTTPBadRequest(text="room must be an integer") from None
