"""The gateway encodes a conversation incrementally: a follow-up request tokenizes only its new message."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from gateway.app import create_app
from gateway.relay import settle_background
from gateway.state import GATEWAY
from laps.config import load_config
from laps.tokenizer import load_tokenizer
from tests.fake_engine import FakeEngine

MODEL = "Qwen2.5-7B-Instruct"


@pytest.fixture
async def gateway():
    fakes = [FakeEngine("sp0"), FakeEngine("lp0")]
    servers = [TestServer(f.app) for f in fakes]
    for s in servers:
        await s.start_server()
    app = create_app(load_config(), engine_urls={f.name: str(s.make_url("")).rstrip("/") for f, s in zip(fakes, servers)})
    server = TestServer(app)
    await server.start_server()
    async with aiohttp.ClientSession(str(server.make_url(""))) as session:
        yield session, app
    await server.close()
    for s in servers:
        await s.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_follow_up_tokenizes_only_the_new_message_and_counts_exactly(gateway, stream):
    session, app = gateway
    tokenizer = load_tokenizer()
    history = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a prime number. " * 10}]
    for turn in range(3):
        async with session.post("/v1/chat/completions", json={"model": MODEL, "messages": history, "stream": stream}) as resp:
            assert resp.status == 200
            assert int(resp.headers["x-laps-prompt-tokens"]) == len(tokenizer.encode_chat(history))
            body = await resp.read()
        await settle_background()  # the reply is recorded after the answer
        reply = "hi from sp0"  # what the fake engine answers, streamed or not
        assert reply.encode() in body
        history += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"And another one, number {turn}?"}]
        lookup = app[GATEWAY].prompt_cache.lookup(history)
        assert lookup.turns == (f"<|im_start|>user\nAnd another one, number {turn}?<|im_end|>\n",)


async def test_a_huge_prompt_is_tokenized_in_the_worker_processes_and_counted_exactly(gateway):
    session, app = gateway
    tokenizer = load_tokenizer()
    history = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 1500}]  # 67 KB
    assert len(history[0]["content"]) >= app[GATEWAY].config.gateway.tokenizer_process_min_chars
    async with session.post("/v1/chat/completions", json={"model": MODEL, "messages": history}) as resp:
        assert resp.status == 200
        assert int(resp.headers["x-laps-prompt-tokens"]) == len(tokenizer.encode_chat(history))
        reply = f"hi from {resp.headers['x-laps-engine']}"  # what the fake engine answers
        assert reply.encode() in await resp.read()
    assert app[GATEWAY].encoder._pool._processes  # it went to a worker process (started on this first large text)
    await settle_background()
    history += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Shorter?"}]
    assert len(app[GATEWAY].prompt_cache.lookup(history).turns) == 1  # the pooled chain went into the chat cache
