"""Fault injection for the simulated engine (``--sim-fault KIND[:N]``): how a broken engine looks from the gateway.

Kinds (``N`` defaults to 2):

* ``error-mid-stream:N``: a stream sends ``N`` events, then SGLang's in-stream
  error event (``data: {"error": {..., "code": 500}}``) and ``[DONE]``; a
  non-streamed answer is ``HTTP 500`` with a plain-text body;
* ``malformed:N``: a stream sends ``N`` events, then one that is not JSON, and
  ends; a non-streamed answer is not JSON;
* ``truncated:N``: a stream sends ``N`` events and part of the next, then drops
  the connection; a non-streamed answer drops it halfway through its body;
* ``hang:N``: a stream sends ``N`` events, then nothing more (the HTTP server
  still answers ``/ready``: a stuck scheduler); a non-streamed answer never
  comes, nor does the one-token generation of ``/health`` and
  ``/health_generate`` (503 after SGLang's health-check timeout);
* ``slow:N``: every forward pass takes ``N`` times as long (default 10).

Only the generation routes fail (and, under ``hang``, the generation probes);
``/ready`` and the rest answer as usual, so only the gateway's reading of
answers and its probes can notice.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from aiohttp import web

FAULT_KINDS = ("error-mid-stream", "malformed", "truncated", "hang", "slow")


@dataclass(frozen=True)
class Fault:
    """One ``--sim-fault``: its ``kind`` and ``n`` (events before it strikes, or the slowdown factor for ``slow``)."""

    kind: str
    n: int

    @property
    def slowdown(self) -> float:
        """How many times longer each forward pass takes."""
        return float(self.n) if self.kind == "slow" else 1.0


def parse_fault(spec: str | None) -> Fault | None:
    """``KIND[:N]`` as a :class:`Fault` (None: no fault).

    Raises:
        ValueError: an unknown kind, or ``N`` not a whole number >= 0 (>= 1 for ``slow``).
    """
    if spec is None:
        return None
    kind, _, n = spec.partition(":")
    if kind not in FAULT_KINDS:
        raise ValueError(f"--sim-fault: unknown kind {kind!r}; choose from {', '.join(FAULT_KINDS)}")
    try:
        count = int(n) if n else (10 if kind == "slow" else 2)
    except ValueError:
        raise ValueError(f"--sim-fault: {spec!r}: N must be a whole number") from None
    if count < (1 if kind == "slow" else 0):
        raise ValueError(f"--sim-fault: {spec!r}: N must be at least {1 if kind == 'slow' else 0}")
    return Fault(kind, count)


FAULT = web.AppKey("sim_fault", Fault)

_ERROR_EVENT = b'data: {"error": {"message": "simulated engine failure", "type": "InternalServerError", "param": null, "code": 500}}\n\n'


class FaultyStream(web.StreamResponse):
    """An SSE response that strikes ``fault`` after ``fault.n`` events (writes); later writes go nowhere."""

    def __init__(self, fault: Fault, headers: dict[str, str]) -> None:
        super().__init__(headers=headers)
        self._fault = fault
        self._events = 0
        self._struck = False

    async def write(self, data: bytes) -> None:
        if self._struck:
            return
        if self._events < self._fault.n:
            self._events += 1
            await super().write(data)
            return
        self._struck = True
        kind = self._fault.kind
        if kind == "error-mid-stream":
            await super().write(_ERROR_EVENT + b"data: [DONE]\n\n")
        elif kind == "malformed":
            await super().write(b"data: <html>simulated garbage</html>\n\n")
        elif kind == "truncated":
            await super().write(data[: max(1, len(data) // 2)])
            self._req.transport.close()
        elif kind == "hang":
            await asyncio.Event().wait()  # until the client goes away (the handler is cancelled then)


def hung(request: web.Request) -> bool:
    """Whether ``request``'s engine runs with ``--sim-fault hang`` (its scheduler stuck)."""
    fault = request.app.get(FAULT)
    return fault is not None and fault.kind == "hang"


def sse_response(request: web.Request, headers: dict[str, str]) -> web.StreamResponse:
    """An (unprepared) SSE response for ``request``: a :class:`FaultyStream` when the engine injects a stream fault."""
    fault = request.app.get(FAULT)
    if fault is None or fault.kind == "slow":
        return web.StreamResponse(headers=headers)
    return FaultyStream(fault, headers)


async def answer(request: web.Request, response: web.Response) -> web.StreamResponse:
    """A non-streamed OpenAI answer ``response`` of ``request`` as the engine's fault makes it."""
    fault = request.app.get(FAULT)
    if fault is None or fault.kind == "slow" or response.status != 200:
        return response
    if fault.kind == "error-mid-stream":
        return web.Response(status=500, text="Internal Server Error: simulated engine failure")
    if fault.kind == "malformed":
        return web.Response(body=b"{not json", content_type="application/json")
    if fault.kind == "hang":
        await asyncio.Event().wait()
    body = response.body
    broken = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": str(len(body))})
    await broken.prepare(request)
    await broken.write(body[: len(body) // 2])
    request.transport.close()
    return broken
