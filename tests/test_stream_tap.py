"""The SSE relay tap: bytes pass through unchanged however the engine's stream is cut, the reply is read, and
the usage-only event is dropped when only the gateway asked for it."""

from __future__ import annotations

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.relay import Reply, StreamTap

PIECES = ["Hel", "lo", ", ", "wörld", "!\n", "日本"]


def stream(pieces: list[str], usage: bool) -> bytes:
    events = [b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {"content": p}}]}) + b"\n\n" for p in pieces]
    if usage:
        events.append(b"data: " + orjson.dumps({"choices": [], "usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 7}}}) + b"\n\n")
    return b"".join(events) + b"data: [DONE]\n\n"


def relay(data: bytes, cuts: list[int], drop_usage: bool) -> tuple[bytes, Reply, int]:
    reply = Reply()
    tap = StreamTap(reply, drop_usage)
    out, passed_whole = [], 0
    bounds = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    for a, b in zip(bounds, bounds[1:]):
        piece = data[a:b]
        forwarded = tap.feed(piece)
        passed_whole += forwarded is piece
        out.append(forwarded)
    out.append(tap.flush())
    return b"".join(out), reply, passed_whole


@settings(max_examples=200, deadline=None)
@given(pieces=st.lists(st.sampled_from(PIECES), max_size=6), cuts=st.lists(st.integers(0, 10_000), max_size=8))
def test_any_cut_of_the_stream_is_relayed_byte_for_byte_and_read(pieces, cuts):
    data = stream(pieces, usage=True)
    out, reply, _ = relay(data, cuts, drop_usage=False)
    assert out == data
    assert "".join(reply.text) == "".join(pieces) and reply.cached_tokens == 7


@settings(max_examples=200, deadline=None)
@given(pieces=st.lists(st.sampled_from(PIECES), max_size=6), cuts=st.lists(st.integers(0, 10_000), max_size=8))
def test_usage_event_is_dropped_when_only_the_gateway_asked(pieces, cuts):
    out, reply, _ = relay(stream(pieces, usage=True), cuts, drop_usage=True)
    assert out == stream(pieces, usage=False)
    assert reply.cached_tokens == 7


def test_chunks_of_whole_events_are_forwarded_without_copying():
    data = stream(PIECES, usage=False)
    cuts = [i + 2 for i in range(len(data)) if data[i:i + 2] == b"\n\n"]  # cut at every event end
    out, _, passed_whole = relay(data, cuts, drop_usage=True)
    assert out == data and passed_whole == len(PIECES) + 1
