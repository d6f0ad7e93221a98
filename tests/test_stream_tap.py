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


def test_with_n_choices_the_reply_is_the_first_choice():
    reply = Reply()
    reply.take({"choices": [{"index": 1, "delta": {"content": "B"}}, {"index": 0, "delta": {"content": "A"}}]})
    reply.take({"choices": [{"index": 0, "message": {"content": "a"}}, {"index": 2, "text": "c"}]})
    assert reply.text == ["A", "a"]


def test_a_stream_event_that_is_not_json_marks_the_stream_malformed():
    tap = StreamTap(Reply(), drop_usage=False)
    assert tap.feed(b'data: {"choices": []}\n\n') == b'data: {"choices": []}\n\n' and tap.malformed is None
    assert tap.feed(b"data: {broken\n\ndata: [DONE]\n\n") == b"" and tap.malformed == b"data: {broken"
    assert not tap.reply.done


def test_a_pd_usage_event_reports_the_given_cached_tokens():
    tap = StreamTap(Reply(), drop_usage=False, cached_tokens=lambda: 71)
    out = tap.feed(b'data: {"choices": [], "usage": {"prompt_tokens": 90, "prompt_tokens_details": {"cached_tokens": 0}}}\n\n')
    assert orjson.loads(out[6:]) == {"choices": [], "usage": {"prompt_tokens": 90, "prompt_tokens_details": {"cached_tokens": 71}}}
