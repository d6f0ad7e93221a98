"""The simulated engine's KV cache event publisher: SGLang 0.5.23's ``ZmqEventPublisher`` on the event loop.

Same sockets and frames as SGLang (:mod:`engines.kv_events`): a PUB socket
sends ``[topic, seq, payload]`` per batch, a ROUTER at ``replay_endpoint``
answers replay requests from a buffer of the last ``buffer_steps`` batches.
SGLang publishes from a thread of its own; here :meth:`KVEventPublisher.publish`
sends at once without blocking (a subscriber beyond the high-water mark
misses the batch, and sees the gap), and replays are served by a task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque

import zmq
import zmq.asyncio

from engines.kv_events import END_SEQ, KVEventsConfig, encode_batch, encode_seq
from policies.exact_prefix import KVEvent

log = logging.getLogger("engines.sim")


class KVEventPublisher:
    """Publishes batches of KV cache events as ``config`` says; :meth:`close` unbinds both sockets.

    Raises:
        zmq.ZMQError: an endpoint cannot be bound (e.g. its port is taken).
    """

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self._ctx = zmq.asyncio.Context()  # the replay ROUTER, awaited by a task
        self._pub_ctx = zmq.Context()  # the PUB socket, sent on without waiting
        self._topic = config.topic.encode()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._pub = self._pub_ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.linger = 0
        (self._pub.bind if config.binds() else self._pub.connect)(config.endpoint)
        self._replay: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        if config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.linger = 0
            self._replay.bind(config.replay_endpoint)
            self._task = asyncio.get_running_loop().create_task(self._serve_replay(), name="sim-kv-replay")
        log.info("publishing KV cache events on %s (replay %s)", config.endpoint, config.replay_endpoint)

    def publish(self, events: list[KVEvent]) -> None:
        """Send one batch of ``events`` (nothing when empty) under the next sequence number."""
        if not events:
            return
        seq, payload = self._seq, encode_batch(time.time(), events)
        self._seq += 1
        self._buffer.append((seq, payload))
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart((self._topic, encode_seq(seq), payload), flags=zmq.NOBLOCK)

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("invalid KV event replay request of %d frame(s)", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await self._replay.send_multipart((client, b"", self._topic, encode_seq(seq), payload))
            await self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    async def close(self) -> None:
        """Stop serving replays and close both sockets."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
        self._pub_ctx.term()
