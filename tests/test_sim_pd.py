"""The simulated engines' PD hand-off over HTTP, and the gateway serving a PD deployment of simulated engines end to end."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestServer

from engines.manager import free_port
from engines.sim.args import SimServerArgs
from engines.sim.realtime import ENGINE
from engines.sim.replies import ReplyPlanner
from engines.sim.server import create_app
from gateway.app import create_app as create_gateway
from laps.tokenizer import load_tokenizer
from tests.pd_stack import pd_config

TOK = load_tokenizer()
MODEL = "Qwen2.5-7B-Instruct"
LINK_GB_S = 0.5  # slow enough that the hand-off time is measurable: 57,344 B/token -> ~0.115 ms per prompt token


def sim_args(mode: str, bootstrap_port: int = 8998) -> SimServerArgs:
    return SimServerArgs(served_model_name=MODEL, enable_cache_report=True, max_total_tokens=200_000, disaggregation_mode=mode,
                         disaggregation_bootstrap_port=bootstrap_port, sim_kv_link_gb_s=LINK_GB_S)


@pytest.fixture
async def pair():
    """A prefill sim engine (with its bootstrap server) and a decode sim engine, on loopback ports."""
    bootstrap_port = free_port()
    prefill = TestServer(create_app(sim_args("prefill", bootstrap_port)), handler_cancellation=True)
    decode = TestServer(create_app(sim_args("decode")), handler_cancellation=True)
    await prefill.start_server()
    await decode.start_server()
    async with aiohttp.ClientSession() as session:
        yield session, prefill, decode, bootstrap_port
    await decode.close()
    await prefill.close()


def body(room: int, bootstrap_port: int, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the harbour. " * 40}], "max_tokens": 8,
            "ignore_eos": True, "rid": "r1", "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port, "bootstrap_room": room, **extra}


async def test_decode_answers_after_the_prefill_and_the_modelled_transfer(pair):
    session, prefill, decode, port = pair
    request = body(7, port)
    prompt_tokens = len(TOK.encode_chat(request["messages"]))
    transfer_s = prompt_tokens * 57_344 / (LINK_GB_S * 1e9)
    started = time.monotonic()
    prefill_resp, decode_resp = await asyncio.gather(
        session.post(str(prefill.make_url("/v1/chat/completions")), json=request),
        session.post(str(decode.make_url("/v1/chat/completions")), json=request))
    prefilled, decoded = await prefill_resp.json(), await decode_resp.json()
    elapsed_s = time.monotonic() - started
    assert prefill_resp.status == decode_resp.status == 200
    # The prefill engine computed the prompt and the first token, and ends once the transfer is done.
    assert prefilled["usage"]["completion_tokens"] == 1 and prefilled["choices"][0]["finish_reason"] == "length"
    # The decode engine continues from that token to the full reply, with no prefill of its own.
    plan = ReplyPlanner(TOK).plan("r1", 8, True).token_ids
    assert decoded["usage"] == {**decoded["usage"], "prompt_tokens": prompt_tokens, "completion_tokens": 8}
    assert decoded["choices"][0]["message"]["content"] == TOK.decode(list(plan))
    assert prefilled["choices"][0]["message"]["content"] == TOK.decode(list(plan[:1]))
    assert elapsed_s > transfer_s
    engine = decode.app[ENGINE]
    assert engine.core.stats().total_prefill_uncached_tokens == 0  # the decode engine prefilled nothing


async def test_a_decode_request_that_reaches_its_engine_first_waits_for_the_room(pair):
    """The router sends both sides at once: the decode side may ask the bootstrap server before the prefill engine has
    opened the room (404 there), and waits for it rather than ending with abort; a room that has closed is a 410."""
    session, prefill, decode, port = pair
    request = body(11, port)
    decode_task = asyncio.ensure_future(session.post(str(decode.make_url("/v1/chat/completions")), json=request))
    await asyncio.sleep(0.05)  # the decode side has asked and been told the room is unknown
    prefill_resp = await asyncio.wait_for(session.post(str(prefill.make_url("/v1/chat/completions")), json=request), 10)
    assert prefill_resp.status == 200  # it ends when the decode side has taken the KV (a decode side gone never does)
    prefill_resp.close()
    decode_resp = await asyncio.wait_for(decode_task, 10)
    decoded = await decode_resp.json()
    assert decode_resp.status == 200 and decoded["choices"][0]["finish_reason"] == "length"
    assert decoded["usage"]["completion_tokens"] == 8
    async with session.get(f"http://127.0.0.1:{port}/sim/kv/11") as resp:
        assert resp.status == 410
    async with session.get(f"http://127.0.0.1:{port}/sim/kv/12") as resp:
        assert resp.status == 404


async def test_a_decode_request_whose_prefill_is_aborted_ends_with_abort(pair):
    session, prefill, decode, port = pair
    request = body(9, port, stream=True, max_tokens=4000)
    prefill_task = asyncio.ensure_future(session.post(str(prefill.make_url("/v1/chat/completions")), json={**request, "max_tokens": 4000}))
    decode_resp = await session.post(str(decode.make_url("/v1/chat/completions")), json=request)
    await asyncio.sleep(0)
    # Abort on the prefill engine before its KV is ready (no forward pass has ended yet) or while it is held.
    async with session.post(str(prefill.make_url("/abort_request")), json={"rid": "r1"}) as resp:
        assert resp.status == 200
    text = (await decode_resp.read()).decode()
    (await prefill_task).close()
    finish = [orjson.loads(e[6:])["choices"][0]["finish_reason"] for e in text.split("\n\n") if e.startswith("data: {")]
    assert finish[-1] == "abort"


async def test_a_decode_engine_refuses_a_request_without_bootstrap_fields(pair):
    session, _, decode, _ = pair
    request = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    async with session.post(str(decode.make_url("/v1/chat/completions")), json=request) as resp:
        assert resp.status == 400
        assert "needs bootstrap_host (str), bootstrap_port (int) and bootstrap_room (int)" in (await resp.json())["message"]
    async with session.get(str(decode.make_url("/health"))) as resp:
        assert resp.status == 200


async def test_a_prefill_engine_without_a_decode_side_still_answers_health_checks(pair):
    session, prefill, _, _ = pair
    async with session.get(str(prefill.make_url("/health"))) as resp:
        assert resp.status == 200


async def test_the_gateway_serves_a_pd_deployment_of_sim_engines_end_to_end():
    config = pd_config()
    ports = {e.name: free_port() for e in config.engines if config.pool(e) != "decode"}
    data_engines = [dict(e.model_dump(exclude_none=True), bootstrap_port=ports[e.name]) if e.name in ports else e.model_dump(exclude_none=True) for e in config.engines]
    config = pd_config(engines=data_engines)
    servers = {}
    for e in config.engines:
        mode = "decode" if config.pool(e) == "decode" else "prefill"
        servers[e.name] = TestServer(create_app(sim_args(mode, ports.get(e.name, 8998))), handler_cancellation=True)
        await servers[e.name].start_server()
    urls = {name: str(s.make_url("")).rstrip("/") for name, s in servers.items()}
    gateway = TestServer(create_gateway(config, engine_urls=urls), handler_cancellation=True)
    await gateway.start_server()
    try:
        async with aiohttp.ClientSession(str(gateway.make_url(""))) as session:
            for content, prefill in (("Hi there", "ps0"), (" word" * 400, "pl0")):
                payload = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 6, "ignore_eos": True, "stream": True}
                async with session.post("/v1/chat/completions", json=payload) as resp:
                    assert resp.status == 200 and resp.headers["x-laps-engine"] == prefill
                    assert resp.headers["x-laps-decode-engine"] in ("d0", "d1")
                    text = (await resp.read()).decode()
                chunks = [orjson.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]
                assert chunks[-1]["choices"][0]["finish_reason"] == "length"
                assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) != ""
    finally:
        await gateway.close()
        for s in servers.values():
            await s.close()
