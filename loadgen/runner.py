"""Open-loop load: conversations arrive (at a rate, Poisson or bursty, or at trace times) and run their turns over HTTP.

The arrival plan is drawn before the clock starts (:func:`plan_arrivals`), so
the seed alone fixes which conversations start when and every think time; the
network only decides what the replies say and how long they take.

Each conversation runs as its own task: turn k+1 is sent a think time after
turn k's answer has fully arrived, with the real history (earlier user turns
and the assistant replies actually received). No conversation and no turn
starts at or after ``duration_s``; turns in flight then finish or hit the
request timeout. An error (HTTP status other than 200, an in-stream error, an answer the engine
ended with ``finish_reason`` ``abort``, a timeout, a broken connection, a stream
without ``[DONE]``) is recorded and ends its conversation.

All requests share one ``aiohttp.ClientSession`` whose connector has no
connection limit, so the client never caps concurrency (a capped pool would
turn open-loop load into closed-loop load).
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace

import aiohttp
import orjson

from laps.heap import frozen_heap
from loadgen.workloads import Conversation, Workload, arrival_times

THINK_DISTRIBUTIONS = ("exp", "fixed")
_ERROR_TEXT_LIMIT = 200


class LoadgenError(RuntimeError):
    """The load generator cannot start (server unreachable, no model listed, bad arguments)."""


@dataclass(frozen=True)
class Arrival:
    """A conversation scheduled at ``start_s`` (seconds after the run starts) with its think times.

    ``think_s[k]`` is the pause in seconds between the answer to turn k and the
    sending of turn k+1 (``len(think_s) == len(conversation.turns) - 1``).
    """

    start_s: float
    conversation: Conversation
    think_s: tuple[float, ...]


@dataclass
class RequestRecord:
    """What happened to one turn (one HTTP request). Times in seconds; ``start_s``/``end_s`` from run start.

    ``ttft_s`` is the time to the first chunk with non-empty content;
    ``itl_s`` the gaps between later content chunks; ``tpot_s`` =
    (e2e − ttft) / (completion_tokens − 1), ``None`` unless both are known and
    completion_tokens > 1. Token counts come from the usage chunk (``None`` if
    absent). ``laps_class`` is the ``x-laps-class`` response header or
    ``"unknown"``; ``status`` the HTTP status (``None`` if no response);
    ``error`` is ``None`` for a success. ``user`` and ``max_tokens`` make the
    record replayable (see :func:`loadgen.workloads.load_replay`).
    ``cached_tokens_est`` is the H the gateway routed by on the chosen engine
    (the ``x-laps-cached-tokens-est`` header; ``None`` without it);
    ``new_tokens_est`` the L it classified the request by at its arrival: the
    prompt minus the most any engine was estimated to cache of it (the
    ``x-laps-new-tokens`` header; ``None`` without it).
    """

    conversation_id: str
    source: str
    turn: int
    user: str
    max_tokens: int
    start_s: float
    end_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    tpot_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    cached_tokens_est: int | None = None
    new_tokens_est: int | None = None
    laps_class: str = "unknown"
    status: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        """True when the request succeeded."""
        return self.error is None

    def to_dict(self) -> dict:
        """The record as a JSON-ready dict (one line of a ``--trace-out`` file)."""
        return asdict(self)


def draw_think_time(mean_s: float, dist: str, rng: random.Random) -> float:
    """A think time in seconds: exponential with mean ``mean_s`` (``"exp"``) or exactly ``mean_s`` (``"fixed"``)."""
    if dist not in THINK_DISTRIBUTIONS:
        raise ValueError(f"think-time distribution must be one of {THINK_DISTRIBUTIONS}, got {dist!r}")
    if dist == "fixed" or mean_s <= 0:
        return max(0.0, mean_s)
    return rng.expovariate(1.0 / mean_s)


def plan_arrivals(
    workload: Workload,
    *,
    duration_s: float,
    rng: random.Random,
    rate: float | None = None,
    burstiness: float = 1.0,
    time_scale: float = 1.0,
    think_time_s: float = 1.0,
    think_dist: str = "exp",
    max_requests: int | None = None,
) -> list[Arrival]:
    """Every conversation start before ``duration_s``, in time order, with its think times.

    Timed workloads (trace replay) start at ``conversation.start_s * time_scale``
    (``time_scale`` 0.5 replays twice as fast) and ignore ``rate`` and ``burstiness``; the others
    arrive at ``rate`` conversations per second, as a Poisson process or, with ``burstiness`` other than 1, with gamma
    gaps (:func:`~loadgen.workloads.arrival_times`). Gaps and
    think times are drawn from ``rng`` in arrival order. With ``max_requests``
    the plan holds at most that many requests (turns): the conversation that
    reaches it keeps only its first turns, and none starts after it.

    Raises:
        ValueError: ``rate`` missing or <= 0, or ``burstiness`` out of range
            (:func:`~loadgen.workloads.arrival_times`), for a workload without times; ``time_scale``
            or ``duration_s`` <= 0, ``think_time_s`` < 0, ``max_requests`` < 1.
    """
    if time_scale <= 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    if not duration_s > 0:
        raise ValueError(f"duration must be > 0 s, got {duration_s}")
    if not think_time_s >= 0:
        raise ValueError(f"think time must be >= 0 s, got {think_time_s}")
    if max_requests is not None and max_requests < 1:
        raise ValueError(f"max_requests must be >= 1, got {max_requests}")
    if workload.timed:
        starts: Iterator[tuple[float, Conversation]] = ((c.start_s * time_scale, c) for c in workload.conversations)
    else:
        if rate is None:
            raise ValueError(f"dataset {workload.name} needs a rate (conversations/s)")
        starts = zip(arrival_times(rate, rng, burstiness), workload.conversations)
    plan = []
    left = max_requests
    for t, conv in itertools.takewhile(lambda tc: tc[0] < duration_s, starts):
        if left is not None:
            if len(conv.turns) > left:
                conv = replace(conv, turns=conv.turns[:left])
            left -= len(conv.turns)
        thinks = tuple(draw_think_time(think_time_s, think_dist, rng) for _ in conv.turns[1:])
        plan.append(Arrival(t, conv, thinks))
        if left == 0:
            break
    return plan


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The ``Authorization: Bearer`` header of ``api_key`` (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def discover_model_card(session: aiohttp.ClientSession, url: str, api_key: str | None = None) -> dict:
    """The first entry of ``GET {url}/v1/models`` (``id``; SGLang and the laps gateway also give ``max_model_len``),
    asked with ``api_key`` (``Authorization: Bearer``) when given.

    Raises:
        LoadgenError: unreachable server, non-200 answer (its error message too) or an empty list.
    """
    try:
        async with session.get(f"{url}/v1/models", headers=auth_headers(api_key), timeout=aiohttp.ClientTimeout(total=30)) as resp:
            if resp.status != 200:
                raise LoadgenError(f"GET {url}/v1/models answered HTTP {resp.status}: {error_text(await resp.read())}")
            data = (await resp.json()).get("data") or []
    except (aiohttp.ClientError, asyncio.TimeoutError) as err:
        raise LoadgenError(f"GET {url}/v1/models failed: {type(err).__name__}: {err}") from err
    if not data:
        raise LoadgenError(f"{url}/v1/models lists no model; pass --model")
    return data[0]


async def discover_model(session: aiohttp.ClientSession, url: str, api_key: str | None = None) -> str:
    """The first model id listed by ``GET {url}/v1/models`` (raises as :func:`discover_model_card`)."""
    return (await discover_model_card(session, url, api_key))["id"]


async def discover_context_tokens(url: str, api_key: str | None = None) -> int | None:
    """The ``max_model_len`` of the first model ``GET {url}/v1/models`` lists, or None when it gives none.

    Raises:
        LoadgenError: as :func:`discover_model_card`.
    """
    async with aiohttp.ClientSession() as session:
        value = (await discover_model_card(session, url.rstrip("/"), api_key)).get("max_model_len")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def error_text(body: bytes) -> str:
    """What a record says about an error response: its OpenAI ``error.message``, else the raw body (first 200 chars)."""
    try:
        message = orjson.loads(body)["error"]["message"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        message = body.decode("utf-8", "replace")
    return str(message).strip()[:_ERROR_TEXT_LIMIT]


class _Run:
    """One load run: the shared session, the clock origin and the collected records."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        model: str,
        duration_s: float,
        request_timeout_s: float,
        extra_body: dict,
        on_record: Callable[[RequestRecord], None] | None,
        api_key: str | None = None,
    ) -> None:
        self.session = session
        self.endpoint = f"{url}/v1/chat/completions"
        self.model = model
        self.duration_s = duration_s
        self.timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self.timeout_s = request_timeout_s
        self.extra_body = extra_body
        self.headers = {"Content-Type": "application/json", **auth_headers(api_key)}
        self.on_record = on_record
        self.loop = asyncio.get_running_loop()
        self.t0 = self.loop.time()
        self.records: list[RequestRecord] = []

    def now(self) -> float:
        return self.loop.time() - self.t0

    async def conversation(self, arrival: Arrival) -> None:
        conv = arrival.conversation
        history: list[dict[str, str]] = []
        for k, turn in enumerate(conv.turns):
            if k:
                await asyncio.sleep(arrival.think_s[k - 1])
                if self.now() >= self.duration_s:
                    return
            history.append({"role": "user", "content": turn.content})
            rec = RequestRecord(conv.id, conv.source, k, turn.content, turn.max_tokens, self.now())
            reply = await self.request(rec, history)
            self.records.append(rec)
            if self.on_record is not None:
                self.on_record(rec)
            if not rec.ok:
                return
            history.append({"role": "assistant", "content": reply})

    async def request(self, rec: RequestRecord, messages: list[dict[str, str]]) -> str:
        """Send one streaming chat completion, fill ``rec`` in place and return the reply text."""
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": rec.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            **self.extra_body,
        }
        pieces: list[str] = []
        try:
            async with self.session.post(
                self.endpoint, data=orjson.dumps(body), headers=self.headers, timeout=self.timeout
            ) as resp:
                rec.status = resp.status
                rec.laps_class = resp.headers.get("x-laps-class", "unknown")
                est = resp.headers.get("x-laps-cached-tokens-est")
                rec.cached_tokens_est = int(est) if est is not None and est.isdigit() else None
                new = resp.headers.get("x-laps-new-tokens")
                rec.new_tokens_est = int(new) if new is not None and new.isdigit() else None
                if resp.status != 200:
                    rec.error = f"HTTP {resp.status}: {error_text(await resp.read())}"
                else:
                    await self._read_stream(resp, rec, pieces)
        except asyncio.TimeoutError:
            rec.error = f"timeout after {self.timeout_s:g} s"
        except (aiohttp.ClientError, ValueError) as err:  # aiohttp raises ValueError for an over-long SSE line
            rec.error = f"{type(err).__name__}: {err}"[:_ERROR_TEXT_LIMIT]
        rec.end_s = self.now()
        if rec.ok:
            rec.e2e_s = rec.end_s - rec.start_s
            if rec.ttft_s is not None and rec.completion_tokens is not None and rec.completion_tokens > 1:
                rec.tpot_s = (rec.e2e_s - rec.ttft_s) / (rec.completion_tokens - 1)
        return "".join(pieces)

    async def _read_stream(self, resp: aiohttp.ClientResponse, rec: RequestRecord, pieces: list[str]) -> None:
        last: float | None = None
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            try:
                chunk = orjson.loads(data)
            except orjson.JSONDecodeError:
                rec.error = f"unparsable SSE chunk: {data[:80]!r}"
                return
            if chunk.get("error"):
                err = chunk["error"]
                rec.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"[:_ERROR_TEXT_LIMIT]
                return
            now = self.now()
            for choice in chunk.get("choices") or []:
                if choice.get("finish_reason") == "abort":  # SGLang's end of a request it aborted without an error status
                    rec.error = "the engine aborted the request (finish_reason abort)"
                    return
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if last is None:
                        rec.ttft_s = now - rec.start_s
                    else:
                        rec.itl_s.append(now - last)
                    last = now
                    pieces.append(piece)
            usage = chunk.get("usage")
            if usage:
                rec.prompt_tokens = usage.get("prompt_tokens")
                rec.completion_tokens = usage.get("completion_tokens")
                rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        rec.error = "stream ended before [DONE]"


async def run_loadgen(
    url: str,
    workload: Workload,
    *,
    duration_s: float,
    seed: int,
    rate: float | None = None,
    burstiness: float = 1.0,
    model: str | None = None,
    time_scale: float = 1.0,
    think_time_s: float = 1.0,
    think_dist: str = "exp",
    request_timeout_s: float = 300.0,
    extra_body: dict | None = None,
    on_record: Callable[[RequestRecord], None] | None = None,
    session: aiohttp.ClientSession | None = None,
    max_requests: int | None = None,
    api_key: str | None = None,
) -> list[RequestRecord]:
    """Run ``workload`` against the OpenAI-compatible server at ``url`` and return one record per request sent.

    Arrivals: at ``rate`` conversations/s, Poisson or with gamma gaps of ``burstiness`` (:func:`plan_arrivals`), or the
    trace's own times scaled by ``time_scale`` for timed workloads; think times exponential
    (``think_dist="exp"``, mean ``think_time_s``) or fixed. Arrival gaps and
    think times come from ``random.Random(f"arrivals/{seed}")`` (the workload
    has its own RNG); ``max_requests`` caps the requests sent (:func:`plan_arrivals`). ``model`` defaults to the first id of ``GET /v1/models``.
    ``extra_body`` is merged into every request body (e.g. ``{"ignore_eos":
    True}``). ``on_record`` is called as each request finishes. ``session`` is
    used as given (left open); otherwise one is created and closed. ``api_key`` goes with every request as
    ``Authorization: Bearer`` (a gateway with ``gateway.api_keys``).
    Records come back in completion order. While requests go out the process's heap is frozen out of the garbage
    collector's full passes (:func:`laps.heap.frozen_heap`), which would otherwise pause the client and skew what it
    times.

    Raises:
        LoadgenError: no model could be discovered.
        ValueError: bad ``rate``, ``burstiness``, ``time_scale`` or ``think_dist``.
    """
    url = url.rstrip("/")
    plan = await asyncio.to_thread(
        plan_arrivals,
        workload,
        duration_s=duration_s,
        rng=random.Random(f"arrivals/{seed}"),
        rate=rate,
        burstiness=burstiness,
        time_scale=time_scale,
        think_time_s=think_time_s,
        think_dist=think_dist,
        max_requests=max_requests,
    )
    own_session = session is None
    if own_session:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None))
    try:
        if model is None:
            model = await discover_model(session, url, api_key)
        tasks: list[asyncio.Task] = []
        with frozen_heap():  # the workload and the modules out of the collector's full passes while it times
            run = _Run(session, url, model, duration_s, request_timeout_s, extra_body or {}, on_record, api_key)  # t0: now
            try:
                for arrival in plan:
                    delay = arrival.start_s - run.now()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    tasks.append(asyncio.create_task(run.conversation(arrival)))
                await asyncio.gather(*tasks)
            finally:  # cancelled (Ctrl-C): no conversation outlives the run or its session
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        return run.records
    finally:
        if own_session:
            await session.close()
