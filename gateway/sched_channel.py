"""The local channel between gateway worker processes and the one scheduler process (issue 19, item 3).

Several gateway workers do HTTP, validation, tokenization and relaying; the
scheduling state (queues, AWD windows, prefix index, controller) stays in one
scheduler process so decisions stay global. A worker asks for each decision
over a Unix socket and tells the scheduler what it learns (first token,
completion) without waiting for an answer.

Wire format, both directions: frames of a 4-byte big-endian length followed by
that many bytes of msgpack (``msgspec.msgpack``), at most
:data:`MAX_FRAME_BYTES`. A frame is an array:

- ``[CALL, id, message]``: the worker asks; the scheduler answers once with
  ``[REPLY, id, result]`` or ``[FAILED, id, "error text"]``. Ids are the
  worker's (unique among its calls in flight), so many calls share one
  connection and replies may come in any order: a decision the ``laps``
  policy holds in its AWD window does not delay the ones behind it;
- ``[NOTE, 0, message]``: the worker tells; no answer.

``message`` and ``result`` are whatever msgpack carries (dicts, lists, str,
int, float, bytes, None); their meaning is the scheduler's business, not the
channel's (:mod:`gateway.sched_service` documents the gateway's messages).
The scheduler's handler gets each message with the :class:`Peer` (the worker's
connection) it came on, and ``on_disconnect(peer)`` when that connection is
lost, so it can release what a dead worker left.

Both sides coalesce: frames the kernel delivers together are decoded in one
``data_received``, a handler's immediate results are answered there without a
task, and every frame a side sends in one turn of its event loop (replies,
calls, notes) goes out in one ``transport.write`` at the end of that turn
(:class:`_FrameWriter`), so under load the syscalls and loop wake-ups per frame
amortise on both ends.

Measured round trip: ``bench/sched_channel_rtt.py`` (README, Several gateway
processes).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import types
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import msgspec

log = logging.getLogger("laps.sched_channel")

CALL, REPLY, FAILED, NOTE = 0, 1, 2, 3
MAX_FRAME_BYTES = 16 * 1024 * 1024
RECONNECT_S = 0.1  # how often a reconnecting worker's channel tries the scheduler's socket again
_HEADER_BYTES = 4
_LATER = (asyncio.Future, types.CoroutineType)  # a handler's results answered when done (exact types: a cheap test)


class Peer:
    """One worker's connection as the scheduler's handler sees it: ``id`` (unique within the server's life) and
    ``state``, a dict for the handler's own bookkeeping of that worker (e.g. its requests in flight)."""

    __slots__ = ("id", "state")

    def __init__(self, peer_id: int) -> None:
        self.id = peer_id
        self.state: dict[str, Any] = {}


Handler = Callable[[Any, Peer], Any | Awaitable[Any]]


class ChannelError(Exception):
    """The scheduler's handler raised while answering a call; the message is its error text."""


class ChannelClosed(ConnectionError):
    """The channel is closed (or was lost) before the call was answered."""


class FrameDecoder:
    """Cuts a byte stream into msgpack frames (module doc): :meth:`feed` returns the frames completed so far.

    Raises (from :meth:`feed`):
        ValueError: a frame announces more than ``max_frame_bytes``, or is not a 3-element msgpack array.
    """

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._buffer = bytearray()
        self._max = max_frame_bytes
        self._decode = msgspec.msgpack.Decoder().decode

    def feed(self, data: bytes) -> list[list]:
        buffer = self._buffer
        buffer += data
        frames, pos, end = [], 0, len(buffer)
        with memoryview(buffer) as view:  # released before the buffer is resized
            while end - pos >= _HEADER_BYTES:
                size = int.from_bytes(view[pos:pos + _HEADER_BYTES], "big")
                if size > self._max:
                    raise ValueError(f"frame of {size} bytes exceeds the channel's limit of {self._max}")
                if end - pos - _HEADER_BYTES < size:
                    break
                start = pos + _HEADER_BYTES
                try:
                    frame = self._decode(view[start:start + size])
                except msgspec.DecodeError as err:
                    raise ValueError(f"undecodable frame: {err}") from None
                if not isinstance(frame, list) or len(frame) != 3:
                    raise ValueError(f"a frame must be a 3-element array, got {type(frame).__name__}")
                frames.append(frame)
                pos = start + size
        if pos:
            del buffer[:pos]
        return frames


_encode = msgspec.msgpack.Encoder().encode


def encode_frame(kind: int, call_id: int, payload: Any) -> bytes:
    """One frame: length prefix + msgpack ``[kind, call_id, payload]``.

    Raises:
        TypeError: ``payload`` holds something msgpack cannot carry.
        ValueError: the encoded frame exceeds :data:`MAX_FRAME_BYTES`.
    """
    body = _encode([kind, call_id, payload])
    if len(body) > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {len(body)} bytes exceeds the channel's limit of {MAX_FRAME_BYTES}")
    return len(body).to_bytes(_HEADER_BYTES, "big") + body


class _FrameWriter:
    """Frames sent to ``transport`` in one turn of the event loop, written together at its end (one ``write``);
    frames go out in the order sent. Frames sent once the transport is closing are dropped."""

    __slots__ = ("_transport", "_frames", "_scheduled")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._frames: list[bytes] = []
        self._scheduled = False

    def send(self, frame: bytes) -> None:
        self._frames.append(frame)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Write what was sent so far now (also what the end of the turn does)."""
        self._scheduled = False
        if self._frames:
            if not self._transport.is_closing():
                self._transport.write(b"".join(self._frames))
            self._frames.clear()


# ---------------------------------------------------------------- the scheduler's side

class _ServerConnection(asyncio.Protocol):
    """One worker's connection: runs the handler per CALL / NOTE, answers immediate results at once and awaitable
    ones when they are done, every reply through one :class:`_FrameWriter`."""

    def __init__(self, handler: Handler, connections: set[_ServerConnection], peer: Peer,
                 on_disconnect: Callable[[Peer], None] | None) -> None:
        self._handler = handler
        self._connections = connections
        self._decoder = FrameDecoder()
        self._tasks: set[asyncio.Task] = set()
        self._on_disconnect = on_disconnect
        self._writer: _FrameWriter | None = None
        self.peer = peer
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self._writer = _FrameWriter(transport)
        self._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._connections.discard(self)
        for task in self._tasks:
            task.cancel()
        if self._on_disconnect is not None:
            try:
                self._on_disconnect(self.peer)
            except Exception:
                log.exception("scheduler channel: the on-disconnect hook failed")

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._decoder.feed(data)
        except ValueError as err:
            log.warning("scheduler channel: closing a worker's connection: %s", err)
            self.transport.close()
            return
        for kind, call_id, message in frames:
            try:
                result = self._handler(message, self.peer)
            except Exception as err:  # the handler's failure goes back to the caller, not into the loop
                if kind == CALL:
                    self._writer.send(encode_frame(FAILED, call_id, f"{type(err).__name__}: {err}"))
                else:
                    log.exception("scheduler channel: a note's handler failed")
                continue
            if isinstance(result, _LATER):
                pending = asyncio.ensure_future(result)
                if pending is not result:  # a coroutine's task is the channel's: cancelled when the worker goes
                    self._tasks.add(pending)
                    pending.add_done_callback(self._tasks.discard)
                pending.add_done_callback(partial(self._answer_later, kind, call_id))
            elif kind == CALL:
                self._writer.send(self._reply(call_id, result))

    @staticmethod
    def _reply(call_id: int, result: Any) -> bytes:
        try:
            return encode_frame(REPLY, call_id, result)
        except (TypeError, ValueError) as err:
            return encode_frame(FAILED, call_id, f"unsendable result: {err}")

    def _answer_later(self, kind: int, call_id: int, pending: asyncio.Future) -> None:
        if pending.cancelled():
            return
        err = pending.exception()
        if kind != CALL:
            if err is not None:
                log.error("scheduler channel: a note's handler failed", exc_info=err)
        elif err is not None:
            self._writer.send(encode_frame(FAILED, call_id, f"{type(err).__name__}: {err}"))
        else:
            self._writer.send(self._reply(call_id, pending.result()))


class ChannelServer:
    """Serves ``handler`` on the Unix socket ``path`` to any number of workers (the scheduler process's side).

    ``handler(message, peer)`` gets each CALL's and NOTE's message with the
    :class:`Peer` it came from and returns the result, or a coroutine of it (run
    as a task, concurrently), or an ``asyncio.Future`` of it (settled by
    whoever made it: the cheap way to answer later, no task). A cancelled
    future or task sends nothing. An exception it raises becomes the caller's
    :class:`ChannelError`; one from a NOTE is logged. ``on_disconnect(peer)``
    runs when a worker's connection is lost (the worker closed it or died; also
    at :meth:`close`), after that peer's coroutines' tasks were cancelled (its
    futures are the handler's to drop there).
    """

    def __init__(self, path: str | os.PathLike, handler: Handler, on_disconnect: Callable[[Peer], None] | None = None) -> None:
        self.path = Path(path)
        self._handler = handler
        self._on_disconnect = on_disconnect
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[_ServerConnection] = set()
        self._peer_ids = itertools.count(1)

    async def start(self) -> None:
        """Listen (a stale socket file at ``path`` is replaced).

        Raises:
            OSError: ``path`` cannot be bound (its directory is missing or not writable).
        """
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(
            lambda: _ServerConnection(self._handler, self._connections, Peer(next(self._peer_ids)), self._on_disconnect), str(self.path))

    async def close(self) -> None:
        """Stop listening, drop every worker's connection (their calls in flight fail with :class:`ChannelClosed`)."""
        if self._server is None:
            return
        self._server.close()
        for connection in list(self._connections):
            connection.transport.close()
        while self._connections:  # their connection_lost (and on_disconnect) run on the next loop iterations
            await asyncio.sleep(0)
        await self._server.wait_closed()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._server = None


# ---------------------------------------------------------------- a worker's side

class _ClientConnection(asyncio.Protocol):
    """One connection of ``client``: it becomes the client's as soon as it is made (:meth:`ChannelClient._use`),
    before ``create_unix_connection`` returns, so that a loss reported in between (uvloop may) closes the channel."""

    def __init__(self, client: ChannelClient) -> None:
        self._client = client
        self._decoder = FrameDecoder()
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._client._use(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._client.transport is self._transport:  # not a connection the client has already replaced
            self._client._lost(exc)

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._decoder.feed(data)
        except ValueError as err:
            self._client._lost(f"the scheduler sent a bad frame: {err}")
            self._transport.close()
            return
        pending = self._client._pending
        for kind, call_id, payload in frames:
            future = pending.pop(call_id, None)
            if future is None or future.done():  # its caller was cancelled
                continue
            if kind == REPLY:
                future.set_result(payload)
            else:
                future.set_exception(ChannelError(payload))


class ChannelClient:
    """A worker's connection to the scheduler: :meth:`call` (ask and wait) and :meth:`note` (tell), over one
    Unix socket, many calls in flight at once; what is sent in one turn of the event loop goes out in one write.

    Use ``client = await ChannelClient.connect(path)`` ... ``await client.close()``.
    """

    def __init__(self, path: str | os.PathLike = "", reconnect: bool = False) -> None:
        self.transport: asyncio.Transport | None = None
        self._writer: _FrameWriter | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._closed: str | None = None  # why the channel is closed, while it is
        self._path = str(path)
        self._reconnect = reconnect
        self._reconnecting: asyncio.Task | None = None
        self.on_lost: Callable[[str], None] | None = None  # called with the reason each time the channel closes
        self.on_restored: Callable[[], None] | None = None  # called each time a reconnecting channel is back

    @classmethod
    async def connect(cls, path: str | os.PathLike, reconnect: bool = False, within_s: float = 0.0) -> ChannelClient:
        """Connect to the scheduler listening on ``path``; while nothing listens there, try again every
        :data:`RECONNECT_S` for up to ``within_s`` seconds (a scheduler starting, or starting again). With
        ``reconnect``, a channel lost other than by :meth:`close` (the scheduler died) connects again every
        :data:`RECONNECT_S` until ``path`` listens again (the scheduler started again), then calls
        :attr:`on_restored`; meanwhile calls and notes raise :class:`ChannelClosed`.

        Raises:
            OSError: nothing listened there within ``within_s`` (``FileNotFoundError``, ``ConnectionRefusedError``).
        """
        client = cls(path, reconnect)
        deadline = asyncio.get_running_loop().time() + within_s
        while True:
            try:
                await client._open()
                return client
            except OSError:
                if asyncio.get_running_loop().time() + RECONNECT_S > deadline:
                    raise
            await asyncio.sleep(RECONNECT_S)

    async def _open(self) -> None:
        """Make a connection (:meth:`_use` makes it the channel's).

        Raises:
            OSError: nothing listens at the path.
        """
        await asyncio.get_running_loop().create_unix_connection(lambda: _ClientConnection(self), self._path)

    def _use(self, transport: asyncio.Transport) -> None:
        """The channel's connection is ``transport`` from now (it is open)."""
        self.transport = transport
        self._writer = _FrameWriter(transport)
        self._closed = None

    async def _connect_again(self) -> None:
        while True:
            await asyncio.sleep(RECONNECT_S)
            try:
                await self._open()
            except OSError:
                continue  # not listening yet
            if self._closed is None:  # not lost again already (then this task goes on: :meth:`_lost` started none)
                break
        log.info("the scheduler channel is back (%s)", self._path)
        if self.on_restored is not None:
            self.on_restored()

    async def call(self, message: Any) -> Any:
        """Send ``message``; the scheduler's result.

        Raises:
            ChannelError: the scheduler's handler raised (its error text).
            ChannelClosed: the channel is or got closed before the answer.
            TypeError, ValueError: ``message`` cannot be encoded, or exceeds :data:`MAX_FRAME_BYTES`.
        """
        if self._closed is not None:
            raise ChannelClosed(self._closed)
        call_id = next(self._ids)
        frame = encode_frame(CALL, call_id, message)
        future = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        self._writer.send(frame)
        try:
            return await future
        finally:
            self._pending.pop(call_id, None)

    def note(self, message: Any) -> None:
        """Send ``message`` without waiting for (or getting) an answer.

        Raises:
            ChannelClosed: the channel is closed.
            TypeError, ValueError: as :meth:`call`.
        """
        if self._closed is not None:
            raise ChannelClosed(self._closed)
        self._writer.send(encode_frame(NOTE, 0, message))

    async def close(self) -> None:
        """Send what is not sent yet, close the connection for good (no reconnecting); calls in flight fail with
        :class:`ChannelClosed`."""
        self._reconnect = False
        if self._reconnecting is not None:
            self._reconnecting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reconnecting
        if self.transport is not None and not self.transport.is_closing():
            self._writer.flush()
            self.transport.close()
        self._lost(None)

    def _lost(self, exc: BaseException | str | None) -> None:
        if self._closed is None:
            self._closed = f"the scheduler channel is closed{f': {exc}' if exc else ''}"
            if self.on_lost is not None:
                self.on_lost(self._closed)
            if self._reconnect and (self._reconnecting is None or self._reconnecting.done()):
                self._reconnecting = asyncio.get_running_loop().create_task(self._connect_again())
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ChannelClosed(self._closed))
        self._pending.clear()
