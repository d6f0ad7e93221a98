"""Following each engine's KV cache events (SGLang ``--kv-events-config``) into the gateway's prefix caches.

One :class:`EventFollower` task per publishing engine subscribes to its PUB
socket (pyzmq, ``zmq.asyncio``) and turns each batch into
:mod:`policies.exact_prefix` events on ``gw.prefix_index``
(:class:`~policies.exact_prefix.PrefixCaches`). The wire format is
:mod:`engines.kv_events`.

* **Joining.** When the connection comes up (the ZMQ handshake, seen on a
  socket monitor), the follower asks the replay socket for every batch from
  seq 0. The engine's H becomes exact when that history is whole: it starts at
  seq 0, or at a batch that clears the cache (the engine's cache is then known
  from there); otherwise (a buffer that no longer reaches back, no replay
  socket, no answer) the engine stays on the estimate until its stream carries
  an ``AllBlocksCleared`` or it connects again. An engine dropped while
  connected (:meth:`~policies.exact_prefix.PrefixCaches.forget_engine`, bad
  frames) joins again at its next batch.
* **Gaps.** A batch whose seq skips ahead triggers a replay from the first
  one missed; if the buffer no longer holds it, the engine is joined again as
  above. A seq that goes back to 0 is a restarted publisher: the engine is
  reset and joined again. Events that do not fit the cache built so far
  (:class:`~policies.exact_prefix.EventsOutOfStep`) drop the engine back to
  the estimate until its next clear or connection.
* **Stops.** A disconnect (the publisher or its engine stopped) drops the
  engine back to the estimate; ZMQ keeps reconnecting, and the next handshake
  joins it again.
* **Bad frames** (wrong frame count, a seq that is not 8 bytes, a payload that
  is not an event batch) are logged, counted, and treated as a missed batch.
* **Big batches** (a long prompt stored at page size 1 is one page a token) are
  applied ``APPLY_CHUNK_PAGES`` pages at a time, yielding to the event loop in
  between, so requests are not held up behind them.

Counters per engine: ``laps_kv_event_batches_total`` (applied),
``laps_kv_event_gaps_total``, ``laps_kv_event_replays_total``,
``laps_kv_event_resets_total``, ``laps_kv_event_bad_frames_total``; gauge
``laps_kv_events_exact`` (1 while the engine's H comes from its events).
"""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from engines.kv_events import KVEventSource, decode_batch, decode_seq, encode_seq
from gateway.metrics import GatewayMetrics
from policies.exact_prefix import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, PrefixCaches

log = logging.getLogger("laps.kv_events")

REPLAY_TIMEOUT_S = 5.0  # no answer from the replay socket for this long: the replay failed
RECONNECT_IVL_MS = 200  # ZMQ's reconnect interval (its default is 100 ms, doubling to RECONNECT_IVL_MAX)
RECONNECT_IVL_MAX_MS = 2000
APPLY_CHUNK_PAGES = 256  # pages applied between yields to the event loop (~0.1-0.2 ms of work)
CLOSE_TIMEOUT_S = 5.0  # Following.close waits this long for its cancelled followers


class BadFrame(ValueError):
    """A message that is not ``[topic, seq, payload]`` with an 8-byte seq and an event batch."""


def parse_frames(frames: list[bytes]) -> tuple[int, list[KVEvent]]:
    """(seq, events) of one published message.

    Raises:
        BadFrame: the message is malformed (the message says how).
    """
    if len(frames) != 3:
        raise BadFrame(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    try:
        return decode_seq(frames[1]), decode_batch(frames[2])
    except ValueError as err:
        raise BadFrame(str(err)) from None


def known_from(seq: int, events: list[KVEvent]) -> list[KVEvent] | None:
    """The events of batch ``seq`` to apply to an empty cache when the batch tells the whole cache from there on: those
    after its last ``AllBlocksCleared``, else all of the publisher's first batch (seq 0); None otherwise."""
    for i in range(len(events) - 1, -1, -1):
        if isinstance(events[i], AllBlocksCleared):
            return events[i + 1:]
    return events if seq == 0 else None


def chunked(events: list[KVEvent], max_pages: int) -> list[list[KVEvent]]:
    """``events`` in order, cut into lists of at most ``max_pages`` pages, a store or removal split where needed (a
    split store's later part hangs under the last page of the part before)."""
    chunks: list[list[KVEvent]] = [[]]
    room = max_pages
    for event in events:
        if isinstance(event, AllBlocksCleared):
            chunks[-1].append(event)
            continue
        hashes, done = event.block_hashes, 0
        while done < len(hashes):
            if room == 0:
                chunks.append([])
                room = max_pages
            take = min(room, len(hashes) - done)
            if isinstance(event, BlockStored):
                size = event.block_size
                parent = event.parent_block_hash if done == 0 else hashes[done - 1]
                chunks[-1].append(BlockStored(hashes[done:done + take], parent, event.token_ids[done * size:(done + take) * size], size))
            else:
                chunks[-1].append(BlockRemoved(hashes[done:done + take]))
            done += take
            room -= take
    return chunks


class EventFollower:
    """Follows one engine's KV event stream into ``caches`` (module doc); :meth:`run` until cancelled."""

    def __init__(self, engine_id: str, source: KVEventSource, caches: PrefixCaches, metrics: GatewayMetrics,
                 replay_timeout_s: float = REPLAY_TIMEOUT_S) -> None:
        self.engine_id = engine_id
        self.source = source
        self.caches = caches
        self.replay_timeout_s = replay_timeout_s
        self.last_seq: int | None = None  # the last batch applied; None: not joined
        self._await_clear = False  # a join failed: until the next connection, only a batch that clears the cache joins
        self._ctx = zmq.asyncio.Context.instance()
        labels = (engine_id,)
        self._batches = metrics.kv_event_batches.labels(*labels)
        self._gaps = metrics.kv_event_gaps.labels(*labels)
        self._replays = metrics.kv_event_replays.labels(*labels)
        self._resets = metrics.kv_event_resets.labels(*labels)
        self._bad_frames = metrics.kv_event_bad_frames.labels(*labels)
        metrics.kv_events_exact.labels(*labels).set_function(lambda: float(caches.is_exact(engine_id)))

    async def run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.linger = 0
        sub.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.source.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        log.info("engine %s: following KV cache events at %s (replay %s)", self.engine_id, self.source.endpoint,
                 self.source.replay_endpoint or "none")
        try:
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    event = parse_monitor_message(await monitor.recv_multipart())
                    if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                        log.info("engine %s: KV event stream connected", self.engine_id)
                        self._await_clear = False
                        await self._join()
                    elif event["event"] == zmq.EVENT_DISCONNECTED:
                        log.warning("engine %s: KV event stream disconnected; its prefix hits are estimated until it is back", self.engine_id)
                        self._drop()
                if sub in ready:
                    await self.on_message(await sub.recv_multipart())
        finally:
            self._drop()
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def on_message(self, frames: list[bytes]) -> None:
        """Apply one published message (module doc: joining, gaps, restarts, bad frames)."""
        try:
            seq, events = parse_frames(frames)
        except BadFrame as err:
            self._bad_frames.inc()
            log.warning("engine %s: bad KV event frame (%s); rejoining its stream", self.engine_id, err)
            self._drop()
            return
        if self.last_seq is not None and self.caches.is_exact(self.engine_id):
            if seq == self.last_seq + 1:
                await self._apply(seq, events)
                return
            if 0 < seq <= self.last_seq:
                return  # already applied (replayed meanwhile)
            if seq == 0:
                self._resets.inc()
                log.warning("engine %s: its KV event stream restarted (seq 0 after %d); following it afresh", self.engine_id, self.last_seq)
                self._drop()
            else:
                self._gaps.inc()
                log.info("engine %s: KV event gap (seq %d after %d); replaying", self.engine_id, seq, self.last_seq)
                await self._catch_up(self.last_seq + 1)
                return
        start = known_from(seq, events)
        if start is not None:
            await self._follow(seq, start)
        elif not self._await_clear:
            await self._join()

    async def _follow(self, seq: int, events: list[KVEvent]) -> bool:
        """Start the engine's exact cache from an empty one, with ``events`` (of batch ``seq``) applied."""
        self.caches.follow(self.engine_id, self.source.page_tokens)
        self.last_seq = seq - 1
        return await self._apply(seq, events)

    async def _apply(self, seq: int, events: list[KVEvent]) -> bool:
        """Apply batch ``seq`` (in chunks, yielding between them); False when the engine is no longer followed."""
        chunks = chunked(events, APPLY_CHUNK_PAGES)
        for i, chunk in enumerate(chunks):
            if i:
                await asyncio.sleep(0)
                if not self.caches.is_exact(self.engine_id):  # forgotten meanwhile: joins again at its next batch
                    self.last_seq = None
                    return False
            if not self.caches.apply(self.engine_id, chunk):
                break
        else:
            self.last_seq = seq
            self._batches.inc()
            return True
        self._resets.inc()
        log.warning("engine %s: KV event batch %d does not fit the cache built so far (missed events, or pages of another "
                    "size than %d tokens); estimated until its cache is next cleared", self.engine_id, seq, self.source.page_tokens)
        self._drop()
        self._await_clear = True
        return False

    def _drop(self) -> None:
        """Back to the estimate, until joined again."""
        self.caches.unfollow(self.engine_id)
        self.last_seq = None

    async def _join(self) -> None:
        """Follow the engine from its replayed history: from its last clear in it, else from seq 0 (module doc)."""
        self._drop()
        batches = await self._replay(0)
        if batches is None:
            self._await_clear = True
            return
        if not batches:  # nothing published yet: the cache holds what its first batch will say
            self.caches.follow(self.engine_id, self.source.page_tokens)
            self.last_seq = -1
            return
        for i in range(len(batches) - 1, -1, -1):
            start = known_from(*batches[i])
            if start is not None:
                break
        else:
            log.warning("engine %s: its KV event history is no longer whole (replay starts at seq %d); its prefix hits are "
                        "estimated until its cache is next cleared", self.engine_id, batches[0][0])
            self._await_clear = True
            return
        if not await self._follow(batches[i][0], start):
            return
        for seq, events in batches[i + 1:]:
            if not await self._apply(seq, events):
                return
        log.info("engine %s: prefix hits exact from its KV events (through seq %d)", self.engine_id, self.last_seq)

    async def _catch_up(self, first: int) -> None:
        """Apply the replayed batches from ``first`` on; join again when they do not start there."""
        batches = await self._replay(first)
        if batches is None or not batches or batches[0][0] != first:
            await self._join()
            return
        for seq, events in batches:
            if not await self._apply(seq, events):
                return

    async def _replay(self, first: int) -> list[tuple[int, list[KVEvent]]] | None:
        """The replay socket's batches from seq ``first`` on; None when there is none, it does not answer, or answers garbage."""
        if self.source.replay_endpoint is None:
            return None
        self._replays.inc()
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.connect(self.source.replay_endpoint)
        batches: list[tuple[int, list[KVEvent]]] = []
        try:
            await dealer.send_multipart((b"", encode_seq(first)))
            while True:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancel that lands as the answer
                # comes, and the follower then outlived Following.close (the gateway's shutdown hung)
                async with asyncio.timeout(self.replay_timeout_s):
                    frames = await dealer.recv_multipart()
                if len(frames) == 4 and frames[2] == encode_seq(-1):
                    return batches
                batches.append(parse_frames(frames[1:]))
        except TimeoutError:
            log.warning("engine %s: no KV event replay from %s within %.0f s", self.engine_id, self.source.replay_endpoint, self.replay_timeout_s)
        except BadFrame as err:
            self._bad_frames.inc()
            log.warning("engine %s: bad KV event replay frame (%s)", self.engine_id, err)
        finally:
            dealer.close(linger=0)
        return None


class Following:
    """The :class:`EventFollower` tasks of a gateway's engines; :meth:`close` stops them all."""

    def __init__(self, sources: dict[str, KVEventSource], caches: PrefixCaches, metrics: GatewayMetrics) -> None:
        self.followers = {name: EventFollower(name, source, caches, metrics) for name, source in sources.items()}
        self._tasks = [asyncio.create_task(f.run(), name=f"kv-events-{name}") for name, f in self.followers.items()]

    async def close(self) -> None:
        """Cancel every follower and wait for them, at most :data:`CLOSE_TIMEOUT_S`: one still running then (its cancel
        was lost) or that had failed is logged, and the gateway's shutdown goes on without it."""
        for task in self._tasks:
            task.cancel()
        if not self._tasks:
            return
        done, pending = await asyncio.wait(self._tasks, timeout=CLOSE_TIMEOUT_S)
        for task in pending:
            log.error("%s did not stop within %.0f s of its cancel; shutting down without it", task.get_name(), CLOSE_TIMEOUT_S)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                log.error("%s had failed: %r", task.get_name(), task.exception())
