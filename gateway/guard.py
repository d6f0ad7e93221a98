"""Per-request cut-offs: how long a request may wait on its engine, and the gateway's shutdown.

A :class:`RequestGuard` watches one request while it waits on an engine
(:meth:`RequestGuard.watching`). It ends that wait with an explicit error:

* :class:`~gateway.errors.EngineTimeout` when the engine sent nothing for the
  current limit: ``gateway.first_byte_timeout_s`` until the first byte of a
  stream, ``gateway.stall_timeout_s`` between two chunks after it (time spent
  writing to a slow client does not count); a non-streamed answer has no byte
  limit (its first byte is its whole answer), only the engine's health;
* :class:`~gateway.errors.EngineTimeout` too when its engine is taken out of
  service (:func:`gateway.health.take_out_of_service`) before the client got
  anything: the request is then retried elsewhere at once;
* :class:`~gateway.errors.ShuttingDown` when the gateway's grace period is
  over (:meth:`RequestGuard.shut`).

The cut-off cancels the watched task and the cancellation is turned back into
that error where the watch ends, so the code around it handles a cut-off as it
handles any engine failure: retried once if nothing reached the client, an
in-stream error event and ``[DONE]`` once a stream has started. A cancellation
from elsewhere (the client went away) stays a cancellation.

The timer is not moved on every chunk: a chunk only records the time, and the
timer, when it fires early, re-arms itself at the last chunk + the limit.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Iterator

from gateway.errors import APIError, EngineTimeout, ShuttingDown
from gateway.registry import EngineState


class RequestGuard:
    """The cut-offs of one request (see the module docstring); ``first_byte_s`` and ``stall_s`` in seconds."""

    def __init__(self, first_byte_s: float, stall_s: float) -> None:
        self.first_byte_s = first_byte_s
        self.stall_s = stall_s
        self.engine: EngineState | None = None  # the engine waited on, while watching
        self.also: EngineState | None = None  # a second engine waited on (see watching)
        self.sent = False  # the client has received part of its answer (a retry is no longer possible)
        self.since_s = 0.0  # when the current wait on an engine began (the event loop's time)
        self.reason: APIError | None = None  # why the guard fired
        self._loop = asyncio.get_running_loop()
        self._task: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._limit_s = 0.0
        self._last_s = 0.0
        self.paused = False  # set while writing to the client
        self._shut = False

    @contextlib.contextmanager
    def watching(self, engine: EngineState, stream: bool, also: EngineState | None = None) -> Iterator["RequestGuard"]:
        """Watch the current task's wait on ``engine`` (a stream: with the first-byte limit, see :meth:`progress`);
        ``also``: a second engine the wait depends on (a PD request's prefill engine), blamed for a timeout until
        :attr:`also` is cleared (its part is done).

        Raises:
            EngineTimeout: the engine sent nothing in time, or was taken out of service before the client got anything.
            ShuttingDown: the gateway's grace period ended (also on entry, when it has already ended).
        """
        if self._shut:
            raise ShuttingDown()
        self.engine, self.also, self.reason = engine, also, None
        self.since_s = self._loop.time()
        self._task = asyncio.current_task()
        if stream:
            self._limit_s, self._last_s = self.first_byte_s, self._loop.time()
            self._timer = self._loop.call_at(self._last_s + self._limit_s, self._check)
        try:
            yield self
        except asyncio.CancelledError:
            if self.reason is not None and self._task.uncancel() == 0:
                raise self.reason from None
            raise
        finally:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._task = None
            self.engine = self.also = None

    def started(self) -> None:
        """The client has the first part of its answer: no retry from now on; the limit becomes the stall timeout
        (the timer, armed for the first-byte limit, is brought forward: it only ever re-arms itself later)."""
        self.sent = True
        self._limit_s = self.stall_s
        if self._timer is not None:
            self._timer.cancel()
            self._timer = self._loop.call_at(self._loop.time() + self.stall_s, self._check)

    def progress(self) -> None:
        """Bytes came from the engine (call it after relaying them: time spent writing to a slow client, with
        :attr:`paused` set, is no engine stall)."""
        self._last_s = self.engine.last_byte_s = self._loop.time()

    def engine_down(self, engine: EngineState) -> None:
        """``engine`` was taken out of service: end the wait on it if the client has nothing yet (it is retried)."""
        if (self.engine is engine or self.also is engine) and not self.sent:
            self._fire(EngineTimeout(engine, "taken out of service before its first byte"))

    def shut(self) -> None:
        """The grace period of the shutdown is over: end the request now (or as soon as it waits on an engine)."""
        self._shut = True
        self._fire(ShuttingDown())

    def _check(self) -> None:
        due = self._last_s + self._limit_s
        now = self._loop.time()
        if self.paused or now < due:
            self._timer = self._loop.call_at(now + self._limit_s if self.paused else due, self._check)
            return
        self._timer = None
        what = "next chunk" if self.sent else "first byte"
        self._fire(EngineTimeout(self.also or self.engine, f"no {what} within {self._limit_s:g} s"))

    def _fire(self, reason: APIError) -> None:
        if self._task is not None and self.reason is None:
            self.reason = reason
            self._task.cancel()
