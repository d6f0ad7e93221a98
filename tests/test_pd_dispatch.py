"""PD dispatch against fake engines: one room on both sides, the decode stream relayed, both aborted, one error per failure."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestServer

from gateway import pd_dispatch
from gateway.app import create_app, end_requests
from gateway.dispatcher import Arrival, classify
from gateway.registry import EngineRegistry, EngineState
from gateway.relay import settle_background
from gateway.state import GATEWAY
from policies.exact_prefix import PrefixCaches
from policies.prefix_index import BlockChain, PrefixIndex
from policies.registry import make_classifier
from tests.fake_engine import FakeEngine
from tests.pd_stack import pd_config

MODEL = "Qwen2.5-7B-Instruct"
ENGINES = ("ps0", "pl0", "d0", "d1")
ADMIN_KEY = "pd-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture
async def pd_stack():
    """Fake prefill engines ps0 (short), pl0 (long) and decode engines d0, d1 behind a PD gateway."""
    fakes = {name: FakeEngine(name) for name in ENGINES}
    servers = {name: TestServer(f.app) for name, f in fakes.items()}
    for s in servers.values():
        await s.start_server()
    urls = {name: str(s.make_url("")).rstrip("/") for name, s in servers.items()}
    app = create_app(pd_config(gateway={"admin_key": ADMIN_KEY}), engine_urls=urls)
    gateway = TestServer(app, handler_cancellation=True)
    await gateway.start_server()
    async with aiohttp.ClientSession(str(gateway.make_url(""))) as session:
        yield session, fakes, servers, app
    await gateway.close()
    for s in servers.values():
        await s.close()


def chat(content: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def events(text: str) -> list[str]:
    return [e for e in text.split("\n\n") if e]


async def test_stream_goes_to_both_sides_with_one_room_and_the_decode_stream_is_relayed(pd_stack):
    session, fakes, _, _ = pd_stack
    async with session.post("/v1/chat/completions", json=chat("Hello!", stream=True)) as resp:
        assert resp.status == 200
        assert (resp.headers["x-laps-engine"], resp.headers["x-laps-decode-engine"]) == ("ps0", "d0")
        rid = resp.headers["x-request-id"]
        text = (await resp.read()).decode()
    assert "hi from d0" in text and "hi from ps0" not in text
    assert events(text)[-1] == "data: [DONE]" and '"usage":{' not in text  # usage asked of the engines, not relayed
    prefill, decode = fakes["ps0"].bodies[0], fakes["d0"].bodies[0]
    assert prefill == decode  # one body to both sides, as SGLang's PD router sends it
    assert prefill["rid"] == rid and prefill["bootstrap_host"] == "127.0.0.1" and prefill["bootstrap_port"] == 8998
    assert isinstance(prefill["bootstrap_room"], int) and 0 <= prefill["bootstrap_room"] < 2**63
    assert fakes["pl0"].bodies == fakes["d1"].bodies == []


async def test_each_request_gets_its_own_room_and_its_prefill_engines_bootstrap_port(pd_stack):
    session, fakes, _, _ = pd_stack
    for content in ("Hi", " word" * 300):  # short -> ps0 (engine 0), long -> pl0 (engine 1)
        async with session.post("/v1/chat/completions", json=chat(content)) as resp:
            assert resp.status == 200
            assert (await resp.json())["choices"][0]["message"]["content"] == "hi from d0"
    short, long = fakes["ps0"].bodies[0], fakes["pl0"].bodies[0]
    assert (short["bootstrap_port"], long["bootstrap_port"]) == (8998, 8999)
    assert [b["bootstrap_room"] for b in fakes["d0"].bodies] == [short["bootstrap_room"], long["bootstrap_room"]]
    assert short["bootstrap_room"] != long["bootstrap_room"]


async def test_decode_engines_are_placed_by_load_and_prefill_load_ends_with_the_prefill(pd_stack):
    session, fakes, _, app = pd_stack
    fakes["d0"].hold_streams = True
    first = await session.post("/v1/chat/completions", json=chat("Hi", stream=True))
    assert first.headers["x-laps-decode-engine"] == "d0"
    await first.content.readuntil(b"\n\n")
    await settle_background()
    registry = app[GATEWAY].registry
    assert [v.id for v in registry.views()] == ["ps0", "pl0"]  # the scheduler never sees decode engines
    assert [v.id for v in registry.decode_views()] == ["d0", "d1"]
    # Once ps0 has answered its prefill only the decode engine counts the request. The two sides run side by side, so
    # the decode side's first event can reach the client before the gateway has read ps0's answer (seen once in a
    # full suite on 2 busy cores): wait for it, a few seconds at most.
    for _ in range(500):
        if registry["ps0"].in_flight == 0:
            break
        await asyncio.sleep(0.01)
    assert {e.id: e.in_flight for e in registry} == {"ps0": 0, "pl0": 0, "d0": 1, "d1": 0}
    async with session.post("/v1/chat/completions", json=chat("Hi again")) as resp:
        assert resp.headers["x-laps-decode-engine"] == "d1"
    fakes["d0"].release.set()
    await first.read()
    first.close()
    for _ in range(200):  # the handler's last steps may run after the client has read the end of the stream
        if registry["d0"].in_flight == 0:
            break
        await asyncio.sleep(0.01)
    await settle_background()
    assert {e.id: e.in_flight for e in registry} == {"ps0": 0, "pl0": 0, "d0": 0, "d1": 0}


async def test_client_disconnect_aborts_both_sides(pd_stack):
    session, fakes, _, _ = pd_stack
    fakes["d0"].hold_streams = True
    resp = await session.post("/v1/chat/completions", json=chat("Hi", stream=True))
    rid = resp.headers["x-request-id"]
    assert b"hi from d0" in await resp.content.readuntil(b"\n\n")
    resp.close()  # the client goes away while the decode engine is still generating
    await asyncio.wait_for(fakes["d0"].abort_seen.wait(), timeout=5)
    await asyncio.wait_for(fakes["ps0"].abort_seen.wait(), timeout=5)
    assert fakes["d0"].aborted == fakes["ps0"].aborted == [rid]
    fakes["d0"].release.set()


async def test_a_prefill_error_before_the_stream_is_one_http_error_and_the_decode_side_is_aborted(pd_stack):
    session, fakes, _, _ = pd_stack
    fakes["d0"].hold_answers = True  # a decode engine waits for the KV of its room
    fakes["ps0"].error_reply = (400, orjson.dumps({"object": "error", "message": "prompt too long", "type": "BadRequestError", "param": None, "code": 400}))
    async with session.post("/v1/chat/completions", json=chat("Hi", stream=True)) as resp:
        assert resp.status == 400
        assert (resp.headers["x-laps-failed-engine"], resp.headers["x-laps-engine"]) == ("ps0", "ps0")
        rid = resp.headers["x-request-id"]
        error = (await resp.json())["error"]
    assert error == {"message": "prefill engine ps0: prompt too long", "type": "invalid_request_error", "param": None, "code": None}
    await asyncio.wait_for(fakes["d0"].abort_seen.wait(), timeout=5)
    assert fakes["d0"].aborted == [rid]
    fakes["d0"].answer.set()


async def test_a_prefill_error_after_the_stream_started_ends_it_with_one_in_stream_error(pd_stack):
    session, fakes, _, _ = pd_stack
    fakes["d0"].hold_streams = True
    fakes["ps0"].hold_answers = True
    fakes["ps0"].error_reply = (500, b"prefill worker crashed")
    async with session.post("/v1/chat/completions", json=chat("Hi", stream=True)) as resp:
        assert resp.status == 200
        rid = resp.headers["x-request-id"]
        assert b"hi from d0" in await resp.content.readuntil(b"\n\n")
        fakes["ps0"].answer.set()
        rest = events((await resp.read()).decode())
    error = orjson.loads(rest[0].removeprefix("data: "))["error"]
    assert error["message"] == "engine ps0 failed (HTTP 500); retry later" and error["type"] == "engine_error"  # the text: to the log
    assert rest[1:] == ["data: [DONE]"]
    await asyncio.wait_for(fakes["d0"].abort_seen.wait(), timeout=5)
    assert fakes["d0"].aborted == [rid]
    fakes["d0"].release.set()


async def test_a_decode_error_is_one_http_error_and_the_prefill_side_is_aborted(pd_stack):
    session, fakes, _, _ = pd_stack
    fakes["ps0"].hold_answers = True  # a prefill engine waits for the decode side of its room
    fakes["d0"].error_reply = (503, orjson.dumps({"object": "error", "message": "no KV slots", "type": "ServiceUnavailableError", "param": None, "code": 503}))
    async with session.post("/v1/chat/completions", json=chat("Hi")) as resp:
        assert resp.status == 503 and resp.headers["x-laps-failed-engine"] == "d0"
        rid = resp.headers["x-request-id"]
        assert (await resp.json())["error"]["message"] == "decode engine d0: no KV slots"
    await asyncio.wait_for(fakes["ps0"].abort_seen.wait(), timeout=5)
    assert fakes["ps0"].aborted == [rid]
    fakes["ps0"].answer.set()


async def test_an_unreachable_decode_engine_is_marked_down_and_the_pair_retried(pd_stack):
    session, fakes, servers, _ = pd_stack
    await servers["d0"].close()
    async with session.post("/v1/chat/completions", json=chat("Hi", stream=True)) as resp:
        assert resp.status == 200 and resp.headers["x-laps-decode-engine"] == "d1"
        assert "hi from d1" in (await resp.read()).decode()
    async with session.get("/health", headers=ADMIN) as resp:
        health = {e["id"]: (e["pool"], e["healthy"]) for e in (await resp.json())["engines"]}
    assert health == {"ps0": ("short", True), "pl0": ("long", True), "d0": ("decode", False), "d1": ("decode", True)}


async def test_with_every_decode_engine_down_the_client_gets_a_502_then_503s(pd_stack):
    session, _, servers, _ = pd_stack
    for name in ("d0", "d1"):
        await servers[name].close()
    async with session.post("/v1/chat/completions", json=chat("Hi")) as resp:
        # d0 refuses the connection and is marked down; the retry's d1 refuses too.
        assert resp.status == 502
        error = (await resp.json())["error"]
    assert error == {"message": "engine d1 failed to answer; retry later", "type": "engine_error", "param": None, "code": "engine_unavailable"}
    async with session.post("/v1/chat/completions", json=chat("Hi")) as resp:
        assert resp.status == 503 and (await resp.json())["error"]["message"] == "no healthy decode engine is available; retry later"


async def test_the_prefix_index_learns_the_prompt_on_the_prefill_engine_not_the_reply(pd_stack):
    session, fakes, _, _ = pd_stack
    fakes["ps0"].reported_cached_tokens = 0
    history = [{"role": "user", "content": "Tell me about the history of pens. " * 5}]
    async with session.post("/v1/chat/completions", json={"model": MODEL, "messages": history, "stream": True}) as resp:
        first_prompt = int(resp.headers["x-laps-prompt-tokens"])
        await resp.read()
    await settle_background()
    history += [{"role": "assistant", "content": "hi from d0"}, {"role": "user", "content": "More?"}]
    async with session.post("/v1/chat/completions", json={"model": MODEL, "messages": history}) as resp:
        assert resp.headers["x-laps-engine"] == "ps0"
        estimate = int(resp.headers["x-laps-cached-tokens-est"])
    # ps0 holds turn 1's prompt in whole 16-token blocks; the reply was decoded (and cached, if at all) on d0.
    assert estimate == first_prompt // 16 * 16


@pytest.mark.parametrize("stream", [False, True])
async def test_the_prefix_index_learns_the_prompt_when_the_prefill_engine_answers_not_after_the_reply(pd_stack, stream):
    session, fakes, _, app = pd_stack
    fakes["ps0"].reported_cached_tokens = 0
    fakes["d0"].hold_answers = True  # the decode side still runs: the client has nothing yet
    history = [{"role": "user", "content": "Tell me about the history of pens. " * 5}]

    async def turn_one() -> int:
        async with session.post("/v1/chat/completions", json={"model": MODEL, "messages": history, "stream": stream}) as resp:
            await resp.read()
            return int(resp.headers["x-laps-prompt-tokens"])

    first = asyncio.ensure_future(turn_one())
    try:
        await asyncio.wait_for(fakes["d0"].received.wait(), timeout=5)
        gw = app[GATEWAY]
        chain = gw.prompt_cache.prompt(history).prompt
        deadline = asyncio.get_running_loop().time() + 5
        while gw.prefix_index.cached_tokens("ps0", chain) == 0:  # ps0 answers at once; d0 holds its answer
            assert asyncio.get_running_loop().time() < deadline, "the prefix index did not learn the prompt from the prefill answer"
            await asyncio.sleep(0.01)
        assert not first.done()
        assert gw.prefix_index.cached_tokens("ps0", chain) == chain.tokens // 16 * 16
    finally:
        fakes["d0"].answer.set()
    assert await first == chain.tokens
    await settle_background()


@pytest.mark.parametrize("engine, role, pools", [("d0", "prefill-long", ("decode", "long")), ("pl0", "decode", ("long", "decode"))])
async def test_the_admin_api_refuses_moves_between_the_prefill_and_decode_sides(pd_stack, engine, role, pools):
    session, _, _, _ = pd_stack
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with session.post(f"/admin/engines/{engine}/role", json={"role": role}, headers=auth) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["param"] == "role"
    assert error["message"] == (f"role: engine {engine!r} serves the {pools[0]} pool and role {role!r} the {pools[1]} pool: engines move "
                                "between the short and long prefill pools only; the decode pool is sized in the config "
                                "(set pd.role_switch to flip engines between prefill and decode)")


async def test_an_unreachable_prefill_engine_aborts_the_waiting_decode_side_and_the_pair_is_retried(pd_stack):
    session, fakes, servers, _ = pd_stack
    await servers["ps0"].close()
    fakes["d0"].hold_answers = True  # the first decode side waits for KV that never comes
    request = asyncio.ensure_future(session.post("/v1/chat/completions", json=chat("Hi")))
    await asyncio.wait_for(fakes["d0"].abort_seen.wait(), timeout=5)
    rid = fakes["d0"].bodies[0]["rid"]
    assert fakes["d0"].aborted == [rid]
    fakes["d0"].answer.set()
    async with await request as resp:
        # ps0 is marked down; the retry prefills on pl0 with pl0's bootstrap port, under a fresh engine rid (the
        # abort of the first try's rid may still be on its way to an engine the retry uses).
        assert resp.status == 200 and resp.headers["x-laps-engine"] == "pl0" and resp.headers["x-request-id"] == f"{rid}-retry"
    assert fakes["pl0"].bodies[0]["bootstrap_port"] == 8999
    assert [b["rid"] for b in fakes["d0"].bodies] == [rid, f"{rid}-retry"] and fakes["pl0"].bodies[0]["rid"] == f"{rid}-retry"
    async with session.get("/metrics") as resp:
        counted = [line for line in (await resp.text()).splitlines() if line.startswith("laps_requests_total{")]
    assert counted == ['laps_requests_total{cls="short",outcome="ok"} 1.0']  # one client request, counted once
    await settle_background()
    assert fakes["d0"].aborted == [rid]  # once: the first try's failure is no guard cut-off to abort again


async def test_a_client_leaving_after_done_before_the_prefill_answers_is_ok_and_learnt_from(pd_stack):
    session, fakes, _, app = pd_stack
    fakes["ps0"].hold_answers = True  # the prefill engine answers only after the client has its whole answer
    fakes["ps0"].reported_cached_tokens = 0
    history = [{"role": "user", "content": "Tell me about the history of pens. " * 5}]
    async with aiohttp.ClientSession(str(session._base_url), connector=aiohttp.TCPConnector(force_close=True)) as closing:
        async with closing.post("/v1/chat/completions", json={"model": MODEL, "messages": history, "stream": True}) as resp:
            first_prompt = int(resp.headers["x-laps-prompt-tokens"])
            text = (await resp.read()).decode()
    assert "hi from d0" in text and events(text)[-1] == "data: [DONE]"
    await asyncio.sleep(0.1)  # the gateway sees the client go while it waits for the prefill engine's answer
    fakes["ps0"].answer.set()
    await settle_background()
    async with session.get("/metrics") as resp:
        metrics = await resp.text()
    assert 'laps_requests_total{cls="short",outcome="ok"} 1.0' in metrics and "client_gone" not in metrics
    assert 'laps_prefix_estimate_error_tokens_count{cls="short"} 1.0' in metrics  # ps0's report was read
    assert fakes["ps0"].aborted == fakes["d0"].aborted == []
    # The chat cache keeps the chat with the decode engine's real reply: the follow-up tokenizes only its new turn.
    history += [{"role": "assistant", "content": "hi from d0"}, {"role": "user", "content": "More?"}]
    assert len(app[GATEWAY].prompt_cache.lookup(history).turns) == 1
    async with session.post("/v1/chat/completions", json={"model": MODEL, "messages": history}) as resp:
        estimate = int(resp.headers["x-laps-cached-tokens-est"])
    assert estimate == first_prompt // 16 * 16  # the prefix index learnt the prompt on ps0, not the reply


@pytest.mark.parametrize("stream", [False, True])
async def test_a_decode_answer_is_not_held_back_by_a_prefill_engine_that_never_answers(pd_stack, monkeypatch, stream):
    session, fakes, _, _ = pd_stack
    fakes["ps0"].hold_answers = True  # e.g. its KV hand-off failed: it never answers

    async def ask() -> tuple[bytes, str]:
        async with session.post("/v1/chat/completions", json=chat("Hi", stream=stream)) as resp:
            return await resp.read(), resp.headers["x-request-id"]

    monkeypatch.setattr(pd_dispatch, "PREFILL_GRACE_S", 60.0)
    body, _ = await asyncio.wait_for(ask(), timeout=5)  # the whole answer while the prefill side still hangs
    assert b"hi from d0" in body and fakes["ps0"].aborted == []
    fakes["ps0"].answer.set()  # it answers within the grace period after all: nothing is aborted
    await settle_background()
    assert fakes["ps0"].aborted == fakes["d0"].aborted == []
    fakes["ps0"].answer.clear()
    monkeypatch.setattr(pd_dispatch, "PREFILL_GRACE_S", 0.05)
    body, rid = await asyncio.wait_for(ask(), timeout=5)
    assert b"hi from d0" in body
    await asyncio.wait_for(fakes["ps0"].abort_seen.wait(), timeout=5)  # past the grace period: aborted
    assert fakes["ps0"].aborted == [rid] and fakes["d0"].aborted == []
    await settle_background()
    async with session.get("/metrics") as resp:
        assert 'laps_requests_total{cls="short",outcome="ok"} 2.0' in await resp.text()
    fakes["ps0"].answer.set()


async def test_log_lines_name_the_decode_engine_of_the_pair(pd_stack, caplog):
    session, fakes, _, _ = pd_stack
    fakes["d0"].hold_streams = True
    caplog.set_level(logging.INFO, logger="laps.gateway")
    resp = await session.post("/v1/chat/completions", json=chat("Hi", stream=True))
    rid = resp.headers["x-request-id"]
    await resp.content.readuntil(b"\n\n")
    resp.close()
    await asyncio.wait_for(fakes["d0"].abort_seen.wait(), timeout=5)
    await settle_background()
    fakes["d0"].release.set()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(rid)]
    assert f"{rid}: client went away; aborting on ps0 and d0" in lines
    assert any("class=short engine=ps0 decode=d0 prompt_tokens=" in line and "outcome=client_gone" in line for line in lines)


async def test_a_stream_the_shutdown_ends_is_logged_as_cut_not_as_a_failed_pair(pd_stack, caplog):
    session, fakes, _, app = pd_stack
    fakes["d0"].hold_streams = True
    caplog.set_level(logging.INFO, logger="laps.gateway")
    resp = await session.post("/v1/chat/completions", json=chat("Hi", stream=True))
    rid = resp.headers["x-request-id"]
    assert b"hi from d0" in await resp.content.readuntil(b"\n\n")
    await asyncio.wait_for(end_requests(app[GATEWAY], grace_s=0.0), timeout=10)
    got = events((await resp.read()).decode())
    assert got[-1] == "data: [DONE]" and orjson.loads(got[-2].removeprefix("data: "))["error"]["code"] == "shutting_down"
    fakes["d0"].release.set()
    cut = [(r.levelno, r.getMessage()) for r in caplog.records if r.getMessage().startswith(rid) and ("mid-stream" in r.getMessage() or " cut: " in r.getMessage())]
    assert cut == [(logging.INFO, f"{rid}: stream to PD pair ps0/d0 cut: the gateway is shutting down; the stream ends with an error event")]


async def test_the_startup_log_says_pd_mode_policy_and_controller(caplog):
    caplog.set_level(logging.INFO, logger="laps.gateway")
    fakes = {name: FakeEngine(name) for name in ENGINES}
    servers = {name: TestServer(f.app) for name, f in fakes.items()}
    for s in servers.values():
        await s.start_server()
    gateway = TestServer(create_app(pd_config(), engine_urls={name: str(s.make_url("")).rstrip("/") for name, s in servers.items()}))
    await gateway.start_server()
    await gateway.close()
    for s in servers.values():
        await s.close()
    # one engine per prefill pool and no pd.role_switch: no pool can give one up, so the controller is off
    assert "scheduling policy laps (AWD windows off); PD on (decode placement least_load, KV transfer mooncake); controller off" in [r.getMessage() for r in caplog.records]


async def test_pd_stream_chunks_do_not_wait_for_the_prefill_answer_only_its_usage_event_does(pd_stack, monkeypatch):
    session, fakes, _, _ = pd_stack
    monkeypatch.setattr(pd_dispatch, "PREFILL_REPORT_WAIT_S", 30.0)
    fakes["ps0"].hold_answers = True  # the prefill engine's answer comes late
    fakes["ps0"].reported_cached_tokens = 71
    # Every chunk carries SGLang's "usage":null; none of them waits for the prefill engine (the response starts with
    # the first one).
    resp = await asyncio.wait_for(session.post("/v1/chat/completions", json=chat("Hi", stream=True, stream_options={"include_usage": True})), timeout=5)
    assert b"hi from d0" in await asyncio.wait_for(resp.content.readuntil(b"\n\n"), timeout=5)
    fakes["ps0"].answer.set()  # the usage event, held until now, reports the prefill engine's figure
    usage = [orjson.loads(e.removeprefix("data: "))["usage"] for e in events((await resp.read()).decode()) if '"usage":{' in e]
    assert [u["prompt_tokens_details"] for u in usage] == [{"cached_tokens": 71}]


async def test_pd_answers_report_the_prefill_engines_cached_tokens(pd_stack):
    session, fakes, _, _ = pd_stack
    fakes["ps0"].reported_cached_tokens = 71  # the decode engine reports 0: it computed no prompt
    async with session.post("/v1/chat/completions", json=chat("Hi")) as resp:
        assert (await resp.json())["usage"]["prompt_tokens_details"] == {"cached_tokens": 71}
    async with session.post("/v1/chat/completions", json=chat("Hi", stream=True, stream_options={"include_usage": True})) as resp:
        usage = [orjson.loads(e.removeprefix("data: "))["usage"] for e in events((await resp.read()).decode()) if '"usage":{' in e]
    assert [u["prompt_tokens_details"] for u in usage] == [{"cached_tokens": 71}]


def test_a_request_is_classified_by_the_prefill_engines_caches_not_by_the_decode_engines():
    config = pd_config()
    registry = EngineRegistry([EngineState(e.name, f"http://{e.name}", config.pool(e)) for e in config.engines])
    index = PrefixCaches(PrefixIndex(16, 4096))
    chain = BlockChain(16).extend(range(1000))
    index.insert("d0", chain.keys)  # a decode engine holds the whole prompt (an earlier turn's, with its reply)
    index.insert("ps0", chain.keys[:2])  # the prefill engines computed only its first 32 tokens
    classifier = make_classifier(config.scheduling)
    view = classify(Arrival("r", chain, 0.0, None), config, registry, index, classifier)
    assert (view.cached_by_engine, view.cached_tokens, view.request_class) == ({"ps0": 32, "pl0": 0}, 32, "long")
    registry["d0"].pool = "long"  # flipped to the prefill side (pd.role_switch): its cache counts from now
    view = classify(Arrival("r", chain, 0.0, None), config, registry, index, classifier)
    assert view.cached_by_engine == {"ps0": 32, "pl0": 0, "d0": 992} and view.request_class == "short"
