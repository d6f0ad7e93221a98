"""The scheduler channel: framing, calls matched to replies in any order, notes, errors, a lost connection."""

from __future__ import annotations

import asyncio
import logging

import pytest

from gateway.sched_channel import (CALL, MAX_FRAME_BYTES, NOTE, RECONNECT_S, REPLY, ChannelClient, ChannelClosed, ChannelError,
                                   ChannelServer, FrameDecoder, _FrameWriter, encode_frame)


@pytest.fixture
def sock_path(tmp_path):
    return tmp_path / "sched.sock"


async def _serving(path, handler):
    server = ChannelServer(path, handler)
    await server.start()
    return server, await ChannelClient.connect(path)


def test_frames_split_anywhere_decode_the_same():
    frames = [(CALL, 1, {"rid": "a", "keys": [1, 2, 3]}), (NOTE, 0, ["done", "a"]), (REPLY, 7, None)]
    data = b"".join(encode_frame(*f) for f in frames)
    decoder = FrameDecoder()
    got = []
    for i in range(len(data)):  # one byte at a time: every split point
        got += decoder.feed(data[i:i + 1])
    assert got == [list(f) for f in frames]
    assert FrameDecoder().feed(data) == [list(f) for f in frames]


def test_oversized_or_malformed_frames_are_refused():
    with pytest.raises(ValueError, match="exceeds the channel's limit of 10"):
        FrameDecoder(max_frame_bytes=10).feed(encode_frame(CALL, 1, "x" * 20))
    not_a_triple = b"\x00\x00\x00\x01\x01"  # msgpack 1
    with pytest.raises(ValueError, match="3-element array"):
        FrameDecoder().feed(not_a_triple)
    with pytest.raises(ValueError, match="exceeds"):
        encode_frame(CALL, 1, b"x" * MAX_FRAME_BYTES)


async def test_call_returns_the_handlers_result(sock_path):
    server, client = await _serving(sock_path, lambda m, peer: {"engine": f"e{m['n'] % 3}", "echo": m})
    try:
        message = {"n": 4, "rid": "r1", "keys": [2**62, -5, 0], "stream": True, "priority": None, "blob": b"\x00\xff"}
        assert await client.call(message) == {"engine": "e1", "echo": message}
    finally:
        await client.close()
        await server.close()


async def test_concurrent_calls_get_their_own_replies_out_of_order(sock_path):
    gates = {n: asyncio.Event() for n in range(50)}

    async def held(n, peer):
        await gates[n].wait()
        return n * 10

    server, client = await _serving(sock_path, held)
    try:
        calls = [asyncio.ensure_future(client.call(n)) for n in range(50)]
        await asyncio.sleep(0)
        for n in reversed(range(50)):  # answered last-first
            gates[n].set()
        assert await asyncio.gather(*calls) == [n * 10 for n in range(50)]
    finally:
        await client.close()
        await server.close()


async def test_notes_reach_the_handler_without_an_answer(sock_path):
    seen = []
    server, client = await _serving(sock_path, lambda m, peer: seen.append(m) or "ignored")
    try:
        client.note(["first_token", "r1"])
        client.note(["complete", "r1"])
        assert await client.call("sync") == "ignored"  # the channel is ordered: both notes were handled before it
        assert seen == [["first_token", "r1"], ["complete", "r1"], "sync"]
    finally:
        await client.close()
        await server.close()


async def test_a_handler_error_fails_that_call_only(sock_path, caplog):
    def handler(m, peer):
        if m == "bad":
            raise KeyError("no such engine")
        return m

    server, client = await _serving(sock_path, handler)
    try:
        with pytest.raises(ChannelError, match="KeyError: 'no such engine'"):
            await client.call("bad")
        with caplog.at_level(logging.ERROR, logger="laps.sched_channel"):
            client.note("bad")
            assert await client.call("good") == "good"
        assert "a note's handler failed" in caplog.text
    finally:
        await client.close()
        await server.close()


async def test_an_unsendable_result_fails_the_call(sock_path):
    server, client = await _serving(sock_path, lambda m, peer: object())
    try:
        with pytest.raises(ChannelError, match="unsendable result"):
            await client.call(1)
    finally:
        await client.close()
        await server.close()


async def test_calls_in_flight_fail_when_the_scheduler_goes(sock_path):
    never = asyncio.Event()

    async def stuck(m, peer):
        await never.wait()

    server, client = await _serving(sock_path, stuck)
    call = asyncio.ensure_future(client.call("x"))
    await asyncio.sleep(0.05)
    await server.close()
    with pytest.raises(ChannelClosed):
        await asyncio.wait_for(call, 10)
    with pytest.raises(ChannelClosed):
        await client.call("y")
    with pytest.raises(ChannelClosed):
        client.note("z")
    assert not sock_path.exists()


async def test_a_worker_that_sends_garbage_is_dropped_and_others_go_on(sock_path):
    server, good = await _serving(sock_path, lambda m, peer: m)
    try:
        reader, writer = await asyncio.open_unix_connection(str(sock_path))
        writer.write((MAX_FRAME_BYTES + 1).to_bytes(4, "big"))
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 10) == b""  # the scheduler closed this connection
        writer.close()
        assert await good.call("still here") == "still here"
    finally:
        await good.close()
        await server.close()


async def test_connecting_to_nothing_raises(sock_path):
    with pytest.raises(OSError):
        await ChannelClient.connect(sock_path)


async def test_a_first_connect_tries_again_until_the_scheduler_listens_for_a_bounded_time(sock_path):
    """A worker started just before its scheduler died connects to the one started again, or gives up."""
    with pytest.raises(FileNotFoundError):
        await ChannelClient.connect(sock_path, within_s=3 * RECONNECT_S)
    connecting = asyncio.ensure_future(ChannelClient.connect(sock_path, within_s=60))
    await asyncio.sleep(3 * RECONNECT_S)  # tries that find nothing listening
    assert not connecting.done()
    server = ChannelServer(sock_path, lambda message, peer: message)
    await server.start()
    client = await asyncio.wait_for(connecting, 60)
    try:
        assert await client.call("here") == "here"
    finally:
        await client.close()
        await server.close()


async def test_each_worker_is_its_own_peer_and_its_disconnect_is_reported_once(sock_path):
    lost = []

    def remember(message, peer):
        peer.state.setdefault("seen", []).append(message)
        return peer.id

    server = ChannelServer(sock_path, remember, on_disconnect=lambda peer: lost.append((peer.id, peer.state["seen"])))
    await server.start()
    first, second = await ChannelClient.connect(sock_path), await ChannelClient.connect(sock_path)
    try:
        first_id = await first.call("a")
        second_id = await second.call("b")
        assert first_id != second_id and await first.call("c") == first_id
        await first.close()
        while not lost:
            await asyncio.sleep(0.01)
        assert lost == [(first_id, ["a", "c"])]
        assert await second.call("d") == second_id  # the other worker goes on
    finally:
        await second.close()
        await server.close()
    assert lost == [(first_id, ["a", "c"]), (second_id, ["b", "d"])]


class _Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closing


async def test_frames_sent_in_one_loop_turn_go_out_in_one_write_in_order():
    transport = _Transport()
    writer = _FrameWriter(transport)
    frames = [encode_frame(CALL, n, {"n": n}) for n in range(3)]
    for frame in frames:
        writer.send(frame)
    assert transport.writes == []  # not before the end of the turn
    await asyncio.sleep(0)
    assert transport.writes == [b"".join(frames)]
    writer.send(frames[0])
    transport.closing = True
    await asyncio.sleep(0)
    assert transport.writes == [b"".join(frames)]  # nothing to a closing transport


async def test_a_future_result_is_answered_once_set_and_a_cancelled_one_never(sock_path):
    futures = {}

    def later(m, peer):
        if m == "sync":
            return "sync"
        futures[m] = asyncio.get_running_loop().create_future()
        return futures[m]

    server, client = await _serving(sock_path, later)
    try:
        kept, dropped = asyncio.ensure_future(client.call("kept")), asyncio.ensure_future(client.call("dropped"))
        assert await client.call("sync") == "sync"
        futures["dropped"].cancel()
        futures["kept"].set_result({"engine": "e0"})
        assert await kept == {"engine": "e0"}
        assert await client.call("sync") == "sync"  # replies go out in order: one for "dropped" would have come first
        assert not dropped.done()
        dropped.cancel()
    finally:
        await client.close()
        await server.close()


async def _reconnecting_pair(sock_path):
    """A server answering ``("first", message)`` and a reconnecting client of it that logs "lost" and "restored"."""
    events = []
    server = ChannelServer(sock_path, lambda message, peer: ("first", message))
    await server.start()
    client = await ChannelClient.connect(sock_path, reconnect=True)
    client.on_lost = lambda why: events.append("lost")
    client.on_restored = lambda: events.append("restored")
    return server, client, events


async def test_a_reconnecting_channel_comes_back_when_a_new_scheduler_listens(sock_path):
    """A lost channel (the scheduler died) fails its calls and notes meanwhile, then connects to the scheduler started
    again on the same path by itself; one closed by its worker stays closed."""
    server, client, events = await _reconnecting_pair(sock_path)
    second = ChannelServer(sock_path, lambda message, peer: ("second", message))
    try:
        assert await client.call("a") == ["first", "a"]
        await server.close()
        while "lost" not in events:
            await asyncio.sleep(0.01)
        with pytest.raises(ChannelClosed):
            await client.call("b")
        with pytest.raises(ChannelClosed):
            client.note("c")
        await asyncio.sleep(0.3)  # several reconnect attempts find nothing listening
        assert events == ["lost"]
        await second.start()
        while "restored" not in events:
            await asyncio.sleep(0.01)
        assert await client.call("d") == ["second", "d"]
        assert events == ["lost", "restored"]
        await client.close()
        await second.close()
        await asyncio.sleep(0.3)
        assert events == ["lost", "restored", "lost"]  # closed by its worker: reported, and nothing connects again
        with pytest.raises(ChannelClosed):
            await client.call("e")
    finally:
        await client.close()
        await second.close()


def _lost_before_returning(loop, attempts: int):
    """A stand-in for ``loop.create_unix_connection`` whose first ``attempts`` connections are lost before it returns
    (uvloop may report a connection made and lost before the coroutine that made it resumes); later ones are real."""
    real = loop.create_unix_connection
    left = [attempts]

    async def connect(factory, path):
        if not left[0]:
            return await real(factory, path)
        lost = asyncio.Event()

        def protocol():
            made = factory()
            connection_lost = made.connection_lost
            made.connection_lost = lambda exc: (connection_lost(exc), lost.set())
            return made

        transport, made = await real(protocol, path)
        left[0] -= 1
        transport.close()
        await lost.wait()
        return transport, made

    return connect


async def test_a_connection_lost_before_connect_returns_leaves_the_channel_closed(sock_path, monkeypatch):
    server = ChannelServer(sock_path, lambda message, peer: message)
    await server.start()
    loop = asyncio.get_running_loop()
    monkeypatch.setattr(loop, "create_unix_connection", _lost_before_returning(loop, 1))
    client = await ChannelClient.connect(sock_path)
    try:
        with pytest.raises(ChannelClosed):
            client.note("to nobody")
    finally:
        await client.close()
        await server.close()


async def test_a_reconnection_lost_at_once_is_tried_again(sock_path, monkeypatch):
    server, client, events = await _reconnecting_pair(sock_path)
    loop = asyncio.get_running_loop()
    monkeypatch.setattr(loop, "create_unix_connection", _lost_before_returning(loop, 1))
    second = ChannelServer(sock_path, lambda message, peer: ("second", message))
    try:
        assert await client.call("a") == ["first", "a"]  # the scheduler has taken the connection
        await server.close()
        await second.start()
        while "restored" not in events:
            await asyncio.sleep(0.01)
        assert await asyncio.wait_for(client.call("b"), 10) == ["second", "b"]  # not a call on a dead connection, unanswered
        assert events == ["lost", "lost", "restored"]  # the first connection again was lost at once: a second one serves
    finally:
        await client.close()
        await second.close()
