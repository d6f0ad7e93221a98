"""KV cache events on the wire: SGLang's frames, the simulated engine's publisher, the gateway's follower."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import yaml
import zmq
from aiohttp.test_utils import TestClient, TestServer

from engines.kv_events import KVEventSource, decode_batch, encode_batch, encode_seq, loopback_publisher
from engines.manager import free_ports
from engines.sim.args import SimServerArgs
from engines.sim.kv_publisher import KVEventPublisher
from engines.sim.realtime import ENGINE
from engines.sim.server import create_app as sim_app
from gateway.app import create_app as gateway_app
from gateway import kv_events
from gateway.kv_events import EventFollower, chunked
from gateway.metrics import GatewayMetrics
from gateway.state import GATEWAY
from laps.config import DEFAULT_CONFIG_PATH, parse_config
from policies.exact_prefix import AllBlocksCleared, BlockRemoved, BlockStored, EngineBlocks, PrefixCaches
from policies.prefix_index import BlockChain, PrefixIndex

MODEL = "Qwen2.5-7B-Instruct"


def sglang_payload(events: list[dict]) -> bytes:
    """A batch exactly as SGLang 0.5.23's ZmqEventPublisher encodes it: ``[ts, events, attn_dp_rank]``, tagged maps."""
    return msgspec.msgpack.encode([1733100000.5, events, 0])


def test_sglang_batches_decode_to_plain_events_and_other_tiers_are_dropped():
    payload = sglang_payload([
        {"type": "AllBlocksCleared"},
        {"type": "BlockStored", "block_hashes": [-5, 7], "parent_block_hash": None, "token_ids": [1, 2], "block_size": 1,
         "lora_id": None, "medium": "GPU", "session_id": "s1"},
        {"type": "BlockStored", "block_hashes": [9], "parent_block_hash": 7, "token_ids": [3], "block_size": 1,
         "lora_id": None, "medium": "CPU_PINNED"},
        {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"},
        {"type": "BlockRemoved", "block_hashes": [9], "medium": "CPU_PINNED"},
    ])
    events = decode_batch(payload)
    assert [type(e) for e in events] == [AllBlocksCleared, BlockStored, BlockRemoved]
    stored = events[1]
    assert (list(stored.block_hashes), stored.parent_block_hash, list(stored.token_ids), stored.block_size) == ([-5, 7], None, [1, 2], 1)
    assert list(events[2].block_hashes) == [7]


def test_the_simulated_engine_encodes_what_sglang_encodes():
    ours = encode_batch(1733100000.5, [AllBlocksCleared(), BlockStored([-5, 7], None, [1, 2], 1), BlockRemoved([7])])
    sglang = sglang_payload([
        {"type": "AllBlocksCleared"},
        {"type": "BlockStored", "block_hashes": [-5, 7], "parent_block_hash": None, "token_ids": [1, 2], "block_size": 1,
         "lora_id": None, "medium": "GPU"},
        {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"},
    ])
    assert msgspec.msgpack.decode(ours) == msgspec.msgpack.decode(sglang)


@pytest.mark.parametrize("payload", [b"", b"\x93", msgspec.msgpack.encode([1.0, [{"type": "Nope"}], 0]),
                                     msgspec.msgpack.encode({"ts": 1})])
def test_payloads_that_are_not_event_batches_raise_value_error(payload):
    with pytest.raises(ValueError, match="not a KV event batch"):
        decode_batch(payload)


class DropOnce:
    """A PUB socket that loses the next ``drop`` sends (what a slow subscriber past the high-water mark sees)."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock, self.drop = sock, 0

    def send_multipart(self, frames, flags=0):
        if self.drop:
            self.drop -= 1
            return None
        return self.sock.send_multipart(frames, flags=flags)

    def close(self, linger=None):
        self.sock.close(linger=linger)


async def wait_for(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def sample(metrics: GatewayMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(name, {"engine": "e"}) or 0.0


async def test_the_follower_joins_follows_catches_up_and_falls_back_while_the_stream_is_down():
    port, replay = free_ports(2, set())
    config = loopback_publisher(port, replay)
    caches, metrics = PrefixCaches(PrefixIndex(block_tokens=4)), GatewayMetrics()
    publisher = KVEventPublisher(config)
    publisher.publish([AllBlocksCleared(), BlockStored([1, 2, 3], None, [10, 11, 12], 1)])  # before anyone follows
    follower = EventFollower("e", KVEventSource(config.endpoint, config.replay_endpoint), caches, metrics, replay_timeout_s=5)
    task = asyncio.create_task(follower.run())
    prompt = BlockChain(4).extend([10, 11, 12, 13, 14, 15, 16])
    caches.insert("e", prompt.keys)  # the estimate says 4
    try:
        await wait_for(lambda: caches.is_exact("e"))  # joined from the replayed history
        assert caches.cached_tokens("e", prompt) == 3
        publisher.publish([BlockStored([4, 5], 3, [13, 14], 1)])
        await wait_for(lambda: caches.cached_tokens("e", prompt) == 5)
        publisher._pub = DropOnce(publisher._pub)
        publisher._pub.drop = 1
        publisher.publish([BlockRemoved([5])])  # lost on the way: seen as a gap at the next batch, then replayed
        publisher.publish([BlockStored([6], 5 - 1, [99], 1)])
        await wait_for(lambda: sample(metrics, "laps_kv_event_gaps_total") == 1)
        await wait_for(lambda: follower.last_seq == 3)
        assert caches.is_exact("e") and caches.cached_tokens("e", prompt) == 4
        assert sample(metrics, "laps_kv_event_batches_total") == 4

        await publisher.close()  # the stream stops: back to the estimate
        await wait_for(lambda: not caches.is_exact("e"))
        assert caches.cached_tokens("e", prompt) == 4 and sample(metrics, "laps_kv_events_exact") == 0

        publisher = KVEventPublisher(config)  # a restarted publisher: seq from 0 again, a fresh cache
        publisher.publish([AllBlocksCleared(), BlockStored([1, 2], None, [10, 11], 1)])
        await wait_for(lambda: caches.is_exact("e") and caches.cached_tokens("e", prompt) == 2)
        assert sample(metrics, "laps_kv_events_exact") == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await publisher.close()


async def test_an_engine_whose_history_is_gone_is_estimated_until_its_cache_is_cleared_without_a_replay_a_batch():
    port, replay = free_ports(2, set())
    config = loopback_publisher(port, replay).model_copy(update={"buffer_steps": 1})
    caches, metrics = PrefixCaches(PrefixIndex(block_tokens=4)), GatewayMetrics()
    publisher = KVEventPublisher(config)
    publisher.publish([AllBlocksCleared(), BlockStored([1], None, [10], 1)])
    publisher.publish([BlockStored([2], 1, [11], 1)])  # the buffer now holds this one only
    follower = EventFollower("e", KVEventSource(config.endpoint, config.replay_endpoint), caches, metrics, replay_timeout_s=5)
    task = asyncio.create_task(follower.run())
    try:
        await wait_for(lambda: sample(metrics, "laps_kv_event_replays_total") == 1 and follower._await_clear)
        for h in (3, 4):
            publisher.publish([BlockStored([h], h - 1, [9 + h], 1)])
        publisher.publish([AllBlocksCleared(), BlockStored([7], None, [20], 1)])
        await wait_for(lambda: caches.is_exact("e"))
        assert sample(metrics, "laps_kv_event_replays_total") == 1 and follower.last_seq == 4
        assert caches.cached_tokens("e", BlockChain(4).extend([20, 21])) == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await publisher.close()


async def test_bad_frames_are_counted_and_the_engine_is_estimated_until_it_is_followed_again():
    port, replay = free_ports(2, set())
    config = loopback_publisher(port, replay)
    caches, metrics = PrefixCaches(PrefixIndex(block_tokens=4)), GatewayMetrics()
    publisher = KVEventPublisher(config)
    follower = EventFollower("e", KVEventSource(config.endpoint, config.replay_endpoint), caches, metrics, replay_timeout_s=5)
    task = asyncio.create_task(follower.run())
    prompt = BlockChain(4).extend([10, 11, 12, 13, 14])
    try:
        await wait_for(lambda: caches.is_exact("e"))  # nothing published yet: an empty cache
        for frames in ([b"", encode_seq(0)], [b"", b"\x00\x01", b""], [b"", encode_seq(0), b"\x93garbage"]):
            publisher._pub.send_multipart(frames)
        await wait_for(lambda: sample(metrics, "laps_kv_event_bad_frames_total") == 3)
        assert not caches.is_exact("e") and not task.done()
        publisher.publish([AllBlocksCleared(), BlockStored([1, 2, 3], None, [10, 11, 12], 1)])
        await wait_for(lambda: caches.is_exact("e") and caches.cached_tokens("e", prompt) == 3)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await publisher.close()


class HeldAnswer:
    """A replay DEALER whose answer comes when the test says (``answer``, a future), for the follower's ``_replay``;
    it records where it was connected, what was sent and whether it was closed."""

    def __init__(self) -> None:
        self.answer = asyncio.get_running_loop().create_future()
        self.linger = None
        self.endpoint: str | None = None
        self.sent: list[tuple[bytes, ...]] = []
        self.closed = False

    def connect(self, endpoint: str) -> None:
        self.endpoint = endpoint

    async def send_multipart(self, frames) -> None:
        self.sent.append(tuple(frames))

    def recv_multipart(self):
        return self.answer

    def close(self, linger=None) -> None:
        self.closed = True


async def test_a_replay_cancelled_as_its_answer_comes_ends_cancelled():
    """The gateway's shutdown cancels every follower; one that an engine's replay answers in the same loop turn still
    stops. (With ``asyncio.wait_for`` around the receive, Python 3.11 returned the answer and dropped the cancel: the
    follower joined and ran on, and the scheduler process's shutdown hung.)"""
    follower = EventFollower("e", KVEventSource("tcp://127.0.0.1:1", "tcp://127.0.0.1:2"), PrefixCaches(PrefixIndex(block_tokens=4)),
                             GatewayMetrics())
    dealer = HeldAnswer()
    follower._ctx = type("Ctx", (), {"socket": staticmethod(lambda kind: dealer)})()
    task = asyncio.create_task(follower._replay(0))
    await asyncio.sleep(0)  # the replay is asked for and waits for its answer
    dealer.answer.set_result([b"", b"", encode_seq(-1), b""])  # the end of an empty history ...
    task.cancel()  # ... and the shutdown's cancel, before the follower runs again
    with pytest.raises(asyncio.CancelledError):
        await task
    assert dealer.endpoint == "tcp://127.0.0.1:2" and dealer.sent == [(b"", encode_seq(0))]  # the history from seq 0
    assert dealer.closed  # the replay socket is closed on the way out


async def test_close_goes_on_without_a_follower_that_outlives_its_cancel(monkeypatch, caplog):
    """A follower task that does not stop when cancelled (a lost cancel) is logged and left after CLOSE_TIMEOUT_S: the
    gateway's shutdown goes on; one that had failed is logged too."""
    monkeypatch.setattr(kv_events, "CLOSE_TIMEOUT_S", 0.05)
    lost = 0

    async def deaf() -> None:
        nonlocal lost
        while lost < 2:  # the first cancel is lost; the test's second one ends it
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                lost += 1

    async def failed() -> None:
        raise RuntimeError("bad socket")

    following = kv_events.Following({}, PrefixCaches(PrefixIndex(block_tokens=4)), GatewayMetrics())
    following._tasks = [asyncio.create_task(deaf(), name="kv-events-e0"), asyncio.create_task(failed(), name="kv-events-e1")]
    await asyncio.sleep(0)
    await asyncio.wait_for(following.close(), 5)
    assert "kv-events-e0 did not stop within 0 s of its cancel" in caplog.text
    assert "kv-events-e1 had failed: RuntimeError('bad socket')" in caplog.text
    following._tasks[0].cancel()
    await following._tasks[0]


async def test_the_gateway_serves_on_the_estimate_while_an_engines_stream_is_down_and_is_exact_again_when_it_is_back():
    """An engine publishing on its own (``external``, named endpoints): its stream stops and comes back as a fresh
    publisher (as a restarted SGLang scheduler's does: seq from 0, its first batch clearing the cache)."""
    port, replay = free_ports(2, set())
    publishing = loopback_publisher(port, replay)
    engine_app = sim_app(SimServerArgs(enable_cache_report=True, max_total_tokens=200_000, max_running_requests=96,
                                       served_model_name=MODEL, kv_events_config=publishing.model_dump_json()))
    data = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    async with TestServer(engine_app) as engine_server:
        url = str(engine_server.make_url("")).rstrip("/")
        data["engines"] = [{"name": "e", "kind": "external", "role": "short-prefill", "url": url,
                            "kv_events_endpoint": publishing.endpoint, "kv_events_replay_endpoint": publishing.replay_endpoint}]
        async with TestClient(TestServer(gateway_app(parse_config(data), engine_urls={"e": url}))) as client:
            gw, engine = client.app[GATEWAY], engine_app[ENGINE]
            # The gateway read the engine's KV pool and request slots from /v1/loads at start-up.
            assert (gw.registry["e"].kv_capacity_tokens, gw.registry["e"].max_running_requests) == (200_000, 96)
            history: list[dict] = []

            async def turn(text: str) -> tuple[int, int]:
                history.append({"role": "user", "content": text})
                resp = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": history, "max_tokens": 7, "ignore_eos": True})
                assert resp.status == 200, await resp.text()
                body = await resp.json()
                history.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
                if gw.prefix_index.is_exact("e"):
                    # a client's think time: the turn's cache insertions (its prompt's at prefill, its reply's when it
                    # finished) reach the gateway, which then matches the conversation so far as the engine does
                    ids = gw.tokenizer.encode_chat(history)
                    chain = BlockChain(gw.prefix_index.block_tokens).extend(ids)
                    await wait_for(lambda: gw.prefix_index.cached_tokens("e", chain) == engine.core.tree.peek_prefix(ids[:-1]))
                return int(resp.headers["x-laps-cached-tokens-est"]), body["usage"]["prompt_tokens_details"]["cached_tokens"]

            await wait_for(lambda: gw.prefix_index.is_exact("e"))
            assert await turn("Tell me about the harbour.") == (0, 0)
            h, cached = await turn("And the lighthouse?")
            assert h == cached and cached % gw.prefix_index.block_tokens  # exact, inside a block

            await engine.kv_publisher.close()  # the stream stops; the engine serves on
            engine.kv_publisher = None
            await wait_for(lambda: not gw.prefix_index.is_exact("e"))
            h, cached = await turn("What about the boats?")
            assert h % gw.prefix_index.block_tokens == 0 and 0 < h <= cached + gw.prefix_index.block_tokens  # the estimate

            engine.kv_publisher = KVEventPublisher(publishing)  # back, fresh
            resp = await client.session.post(url + "/flush_cache")
            assert resp.status == 200
            await wait_for(lambda: gw.prefix_index.is_exact("e"))
            assert await turn("And the gulls?") == (0, 0)
            h, cached = await turn("Tell me more.")
            assert h == cached > 0


def test_the_simulated_engine_takes_sglangs_kv_events_config():
    from engines.sim.args import parse_server_args, resolve_args

    on = resolve_args(parse_server_args(["--kv-events-config", '{"publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv"}']))
    assert (on.kv_events.endpoint, on.kv_events.replay_endpoint, on.kv_events.topic, on.kv_events.binds()) == ("tcp://*:5557", None, "kv", True)
    assert not loopback_publisher(1, 2).model_copy(update={"bind": None}).binds()  # a concrete host connects, as in SGLang
    assert resolve_args(parse_server_args(["--kv-events-config", '{"publisher": "null"}'])).kv_events is None
    assert resolve_args(parse_server_args([])).kv_events is None
    with pytest.raises(ValueError, match="--kv-events-config: .*publisher"):
        resolve_args(parse_server_args(["--kv-events-config", '{"publisher": "kafka"}']))
    with pytest.raises(ValueError, match="--kv-events-config"):
        resolve_args(parse_server_args(["--kv-events-config", "{not json"]))


def test_big_batches_are_cut_into_chunks_that_apply_to_the_same_cache():
    events = [AllBlocksCleared(), BlockStored(range(1, 8), None, list(range(100, 107)), 1), BlockRemoved([7, 6, 5]),
              BlockStored([8, 9], 4, [200, 201], 1)]
    chunks = chunked(events, 3)
    assert [sum(len(e.block_hashes) for e in c if not isinstance(e, AllBlocksCleared)) for c in chunks] == [3, 3, 3, 3]
    assert chunks[1][0] == BlockStored(range(4, 7), 3, [103, 104, 105], 1)
    whole, pieces = EngineBlocks(4), EngineBlocks(4)
    whole.apply(events)
    for chunk in chunks:
        pieces.apply(chunk)
    prompt = BlockChain(4).extend([100, 101, 102, 103, 200, 201, 0])
    assert whole.cached_tokens(prompt) == pieces.cached_tokens(prompt) == 6 and len(whole) == len(pieces) == 6
