"""The gateway against fake engines: validation, classification, routing, relay, aborts, failures."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from gateway import handlers
from gateway.app import create_app
from gateway.dispatcher import Dispatcher
from gateway.relay import settle_background
from gateway.state import GATEWAY
from laps.config import Config, load_config, parse_config
from laps.tokenizer import load_tokenizer
from tests.fake_engine import FakeEngine

MODEL = "Qwen2.5-7B-Instruct"
ADMIN_KEY = "admin-key-of-the-tests"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def with_gateway(config: Config, **gateway) -> Config:
    """``config`` with ``gateway`` keys replaced (validated as a file would be)."""
    data = config.model_dump(exclude_unset=True)
    return parse_config({**data, "gateway": {**data.get("gateway", {}), **gateway}})


@pytest.fixture
async def stack(request):
    """Two fake engines (short pool sp0, long pool lp0) behind a real gateway app on port 0 (admin key ``ADMIN_KEY``);
    indirect parametrization sets the engines' listed ``max_model_len``."""
    fakes = {"sp0": FakeEngine("sp0"), "lp0": FakeEngine("lp0")}
    for fake in fakes.values():
        fake.max_model_len = getattr(request, "param", None)
    servers = {name: TestServer(f.app) for name, f in fakes.items()}
    for s in servers.values():
        await s.start_server()
    urls = {name: str(s.make_url("")).rstrip("/") for name, s in servers.items()}
    gateway = TestServer(create_app(with_gateway(load_config(), admin_key=ADMIN_KEY), engine_urls=urls), handler_cancellation=True)
    await gateway.start_server()
    async with aiohttp.ClientSession(str(gateway.make_url(""))) as session:
        yield session, fakes, servers
    await gateway.close()
    for s in servers.values():
        await s.close()


def chat(content: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


async def test_short_chat_goes_to_short_pool_with_rid_and_class_header(stack):
    session, fakes, _ = stack
    async with session.post("/v1/chat/completions", json=chat("Hello!", max_tokens=5, ignore_eos=True)) as resp:
        assert resp.status == 200
        body = await resp.json()
        assert resp.headers["x-laps-class"] == "short"
        assert resp.headers["x-laps-engine"] == "sp0"
        rid = resp.headers["x-request-id"]
    assert body["choices"][0]["message"]["content"] == "hi from sp0"
    forwarded = fakes["sp0"].bodies[0]
    assert forwarded["rid"] == rid and forwarded["ignore_eos"] is True and forwarded["max_tokens"] == 5
    assert fakes["lp0"].bodies == []


async def test_sglangs_sampling_values_pass_through_as_sent(stack):
    """SGLang's ranges, not OpenAI's: a temperature of 3 is SGLang's to take."""
    session, fakes, _ = stack
    sampling = {"temperature": 3.0, "top_k": -1, "min_p": 0.1, "repetition_penalty": 1.2, "seed": 3, "min_tokens": 5}
    async with session.post("/v1/chat/completions", json=chat("Hello!", max_tokens=5, **sampling)) as resp:
        assert resp.status == 200
    [forwarded] = fakes["sp0"].bodies + fakes["lp0"].bodies
    assert {k: forwarded[k] for k in sampling} == sampling


async def test_optional_parameters_sent_as_null_take_their_defaults_and_are_not_relayed(stack):
    """OpenAI's API reads an optional null as absent; SGLang refuses ``"stream": null``, so the gateway drops it."""
    session, fakes, _ = stack
    nulls = {"stream": None, "n": None, "temperature": None, "stream_options": None, "max_tokens": None}
    async with session.post("/v1/chat/completions", json=chat("Hello!", **nulls)) as resp:
        assert resp.status == 200 and resp.content_type == "application/json"
        assert (await resp.json())["object"] == "chat.completion"
    [forwarded] = fakes["sp0"].bodies + fakes["lp0"].bodies
    assert set(nulls).isdisjoint(forwarded)
    async with session.post("/v1/chat/completions", json={"model": None, "messages": [{"role": "user", "content": "x"}]}) as resp:
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "model"
    async with session.post("/v1/completions", json={"model": MODEL, "prompt": None}) as resp:
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "prompt"
    # another endpoint's required key is optional here: a null one is dropped too
    async with session.post("/v1/chat/completions", json=chat("Hi", prompt=None)) as resp:
        assert resp.status == 200
    assert "prompt" not in (fakes["sp0"].bodies + fakes["lp0"].bodies)[-1]


async def test_long_prompt_goes_to_long_pool(stack):
    session, fakes, _ = stack
    # Each " word" is one Qwen2.5 token; with the template this is well past 256 tokens.
    async with session.post("/v1/chat/completions", json=chat(" word" * 300)) as resp:
        assert resp.status == 200
        assert resp.headers["x-laps-class"] == "long"
        assert resp.headers["x-laps-engine"] == "lp0"
    assert len(fakes["lp0"].bodies) == 1


async def test_completions_with_token_ids_classify_by_their_count(stack):
    session, fakes, _ = stack
    payload = {"model": MODEL, "prompt": list(range(1000, 1256))}
    async with session.post("/v1/completions", json=payload) as resp:
        assert resp.status == 200 and resp.headers["x-laps-class"] == "long"
    payload["prompt"] = list(range(1000, 1255))
    async with session.post("/v1/completions", json=payload) as resp:
        assert resp.status == 200 and resp.headers["x-laps-class"] == "short"


async def test_stream_is_relayed_to_done(stack):
    session, _, _ = stack
    async with session.post("/v1/chat/completions", json=chat("Hi", stream=True)) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        text = (await resp.read()).decode()
    events = [line for line in text.split("\n\n") if line]
    assert events[0].startswith("data: {") and "hi from sp0" in events[0]
    assert events[-1] == "data: [DONE]"


@pytest.mark.parametrize(
    "path, payload, status, param, fragment",
    [
        ("/v1/chat/completions", b"{not json", 400, None, "not valid JSON"),
        ("/v1/chat/completions", b'{"model": "\xff"}', 400, None, "not valid UTF-8: byte 0xff at offset 11"),
        ("/v1/chat/completions", b"[1, 2]", 400, None, "must be a JSON object, got an array"),
        ("/v1/chat/completions", b"null", 400, None, "must be a JSON object, got null"),
        ("/v1/chat/completions", {"model": MODEL}, 400, "messages", "Field required"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages", "at least 1 item"),
        ("/v1/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, 404, "model", "gpt-9"),
        ("/v1/chat/completions", chat("x", max_tokens=-3), 400, "max_tokens", "greater than or equal to 1"),
        ("/v1/chat/completions", chat("x", max_tokens=10**30), 400, "max_tokens", "an integer that fits in 64 bits"),
        ("/v1/chat/completions", chat("x", seed=2**80), 400, "seed", "an integer that fits in 64 bits"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role", "'user'"),
        ("/v1/completions", {"model": MODEL}, 400, "prompt", "Field required"),
        ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt", "one prompt per request"),
        # SGLang's sampling extensions, refused before they reach an engine (SGLang 0.5.23's ranges)
        ("/v1/chat/completions", chat("x", top_k=-7), 400, "top_k", "must be -1 (no limit) or at least 1"),
        ("/v1/chat/completions", chat("x", seed="x"), 400, "seed", "valid integer"),
        ("/v1/chat/completions", chat("x", repetition_penalty=0), 400, "repetition_penalty", "greater than 0"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "min_p": 1.5}, 400, "min_p", "less than or equal to 1"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty",
         "greater than or equal to -2"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "min_tokens": -1}, 400, "min_tokens",
         "greater than or equal to 0"),
        ("/v1/chat/completions", chat("x", min_tokens=10, max_tokens=5), 400, "min_tokens",
         "must be at most the reply's limit (max_completion_tokens or max_tokens: 5)"),
    ],
)
async def test_malformed_requests_get_openai_error_bodies(stack, path, payload, status, param, fragment):
    session, fakes, _ = stack
    kwargs = {"data": payload, "headers": {"Content-Type": "application/json"}} if isinstance(payload, bytes) else {"json": payload}
    async with session.post(path, **kwargs) as resp:
        assert resp.status == status
        error = (await resp.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert fragment in error["message"]
    assert fakes["sp0"].bodies == [] and fakes["lp0"].bodies == []


async def test_unknown_route_gets_openai_404(stack):
    session, _, _ = stack
    async with session.get("/v1/nothing") as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["type"] == "not_found_error"
    async with session.get("/v1/chat/completions") as resp:
        assert (resp.status, resp.headers["Allow"]) == (405, "POST")
        assert (await resp.json())["error"]["message"] == "GET /v1/chat/completions: Method Not Allowed"


async def test_client_disconnect_mid_stream_aborts_on_engine(stack):
    session, fakes, _ = stack
    fakes["sp0"].hold_streams = True
    resp = await session.post("/v1/chat/completions", json=chat("Hi", stream=True))
    rid = resp.headers["x-request-id"]
    first = await resp.content.readuntil(b"\n\n")
    assert b"hi from sp0" in first
    resp.close()  # the client goes away while the engine is still generating
    await asyncio.wait_for(fakes["sp0"].abort_seen.wait(), timeout=5)
    assert fakes["sp0"].aborted == [rid]
    fakes["sp0"].release.set()


@pytest.mark.parametrize("stage", ["placement", "tokenizing"])
async def test_a_client_that_leaves_before_its_request_is_placed_is_counted(stack, monkeypatch, caplog, stage):
    session, fakes, _ = stack
    caplog.set_level("INFO", logger="laps.gateway")
    waiting = asyncio.Event()

    async def held(*args):  # a request the scheduler holds (an AWD window, a queue of long prefills ...), a long prompt
        waiting.set()
        await asyncio.Event().wait()

    if stage == "placement":
        monkeypatch.setattr(Dispatcher, "place", held)
    else:
        monkeypatch.setattr(handlers, "_prompt_chain", held)
    request = asyncio.ensure_future(session.post("/v1/chat/completions", json=chat("Hi")))
    await asyncio.wait_for(waiting.wait(), timeout=5)
    request.cancel()  # the client goes away before any byte of an answer
    for _ in range(100):
        async with session.get("/metrics") as resp:
            text = await resp.text()
        if 'laps_requests_total{cls="unplaced",outcome="client_gone"} 1.0' in text:
            break
        await asyncio.sleep(0.02)
    assert 'laps_requests_total{cls="unplaced",outcome="client_gone"} 1.0' in text  # was neither counted nor logged
    assert 'laps_client_disconnects_total{cls="unplaced"} 1.0' in text
    assert ("outcome=client_gone (left while waiting to be placed)" if stage == "placement" else
            "outcome=client_gone (left before its request was checked and counted)") in caplog.text
    assert fakes["sp0"].bodies == fakes["lp0"].bodies == []


async def test_request_on_a_dead_engine_is_retried_on_another_once(stack):
    session, fakes, servers = stack
    await servers["sp0"].close()
    async with session.post("/v1/chat/completions", json=chat("Hi")) as resp:
        # sp0 refused the connection before anything was sent: sp0 is marked down, lp0 answers.
        assert resp.status == 200 and resp.headers["x-laps-engine"] == "lp0"
    async with session.get("/health", headers=ADMIN) as resp:
        health = await resp.json()
    assert resp.status == 200 and (health["status"], health["engines_serving"]) == ("degraded", 1)
    assert {e["id"]: e["healthy"] for e in health["engines"]} == {"sp0": False, "lp0": True}
    await servers["lp0"].close()
    async with session.post("/v1/chat/completions", json=chat(" word" * 300)) as resp:
        # lp0 fails too and is marked down: nothing healthy is left to retry on.
        assert resp.status == 503 and (await resp.json())["error"]["code"] == "no_engine"
    async with session.get("/metrics") as resp:  # the retry that no engine took counts, as unplaced
        text = await resp.text()
    assert 'laps_requests_total{cls="unplaced",outcome="no_engine"} 1.0' in text
    assert 'laps_requests_total{cls="long",outcome="retried"}' not in text  # a retried try is not counted (the retry is)


async def test_when_the_retry_fails_too_the_client_gets_a_502_naming_the_engine(stack):
    session, _, servers = stack
    for server in servers.values():
        await server.close()
    async with session.post("/v1/chat/completions", json=chat("Hi")) as resp:
        assert resp.status == 502
        error = (await resp.json())["error"]
        assert (resp.headers["x-laps-engine"], resp.headers["x-laps-class"]) == ("lp0", "short")
    # The engine's name only: its URL and the connection error go to the log.
    assert error == {"message": "engine lp0 failed to answer; retry later", "type": "engine_error", "param": None, "code": "engine_unavailable"}


async def test_engine_dropping_mid_stream_ends_with_in_stream_error(stack):
    session, fakes, _ = stack
    fakes["sp0"].break_streams = True
    async with session.post("/v1/chat/completions", json=chat("Hi", stream=True)) as resp:
        assert resp.status == 200
        text = (await resp.read()).decode()
    events = [e for e in text.split("\n\n") if e]
    assert "hi from sp0" in events[0]
    assert events[-2].startswith('data: {"error":') and "engine_error" in events[-2]
    assert events[-1] == "data: [DONE]"


async def test_models_health_and_metrics(stack):
    session, fakes, servers = stack
    for name, server in servers.items():
        fakes[name].url = str(server.make_url("")).rstrip("/")
    async with session.get("/v1/models") as resp:
        assert (await resp.json())["data"] == [{"id": MODEL, "object": "model", "created": 0, "owned_by": "laps"}]  # no max_model_len known
    async with session.get(f"/v1/models/{MODEL}") as resp:  # OpenAI's "retrieve model"
        assert resp.status == 200 and await resp.json() == {"id": MODEL, "object": "model", "created": 0, "owned_by": "laps"}
    async with session.get("/v1/models/org/other-model") as resp:
        error = (await resp.json())["error"]
        assert resp.status == 404 and (error["code"], error["param"]) == ("model_not_found", "model")
        assert error["message"] == f"The model `org/other-model` does not exist; this gateway serves `{MODEL}`."
    async with session.get("/health") as resp:
        assert resp.status == 200 and await resp.json() == {"status": "ok", "engines_serving": 2, "engines_total": 2}  # no URLs
    async with session.get("/health", headers={"Authorization": f"bearer {ADMIN_KEY}"}) as resp:
        assert [(e["id"], e["url"]) for e in (await resp.json())["engines"]] == [("sp0", fakes["sp0"].url), ("lp0", fakes["lp0"].url)]
    async with session.post("/v1/chat/completions", json=chat("Hi", stream=True)) as resp:
        await resp.read()
    async with session.post("/v1/chat/completions", json=chat("Hi")) as resp:
        await resp.read()
    async with session.get("/metrics") as resp:
        text = await resp.text()
    assert 'laps_requests_total{cls="short",outcome="ok"} 2.0' in text
    # TTFT: the stream's only (the JSON answer came whole, its first token's time unknown); end-to-end: both
    assert 'laps_time_to_first_token_seconds_count{cls="short"} 1.0' in text and 'laps_e2e_request_latency_seconds_count{cls="short"} 2.0' in text
    assert "laps_scheduler_awd_depth_tokens " in text and "laps_scheduler_queued_long_requests 0.0" in text
    assert "# TYPE laps_scheduler_short_batches_total counter" in text and "laps_scheduler_short_batches_total 2.0" in text


async def test_requests_the_gateway_refuses_itself_are_counted_and_logged(stack, caplog):
    session, fakes, _ = stack
    caplog.set_level("INFO", logger="laps.gateway")
    async with session.post("/v1/chat/completions", data=b"{not json", headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 400
    async with session.post("/v1/chat/completions", json=chat("Hi", temperature=-1)) as resp:
        assert resp.status == 400
    async with session.post("/v1/completions", json={"model": "no-such-model\nINFO forged", "prompt": "x"}) as resp:
        assert resp.status == 404
    async with session.post("/v1/chat/completions", json=chat("Hi"), headers={"x-laps-slo-ttft-s": "soon"}) as resp:
        assert resp.status == 400  # a header checked once the prompt is counted, still before any engine
    async with session.get("/metrics") as resp:
        text = await resp.text()
    assert 'laps_requests_total{cls="unplaced",outcome="http_400"} 3.0' in text
    assert 'laps_requests_total{cls="unplaced",outcome="model_not_found"} 1.0' in text
    assert "POST /v1/chat/completions from 127.0.0.1 refused: class=unplaced outcome=http_400 param='temperature'" in caplog.text
    assert "param='x-laps-slo-ttft-s'" in caplog.text
    assert "\nINFO forged" not in caplog.text and "\\nINFO forged" in caplog.text  # the client's text quoted: no line of its own
    assert all(fake.bodies == [] for fake in fakes.values())


async def test_an_answer_the_engine_ended_with_abort_is_relayed_but_not_counted_ok(stack, caplog):
    session, fakes, _ = stack
    fakes["sp0"].finish_reason = "abort"  # SGLang 0.5.23's end of a request aborted without an error status
    for stream in (True, False):
        async with session.post("/v1/chat/completions", json=chat("Hi", stream=stream)) as resp:
            assert resp.status == 200
            assert b'"finish_reason":"abort"' in (await resp.read()).replace(b" ", b"")  # as the engine sent it
    async with session.get("/metrics") as resp:
        text = await resp.text()
    assert 'laps_requests_total{cls="short",outcome="engine_abort"} 2.0' in text and 'outcome="ok"' not in text
    assert "engine sp0 ended the request with finish_reason abort" in caplog.text


@pytest.mark.parametrize("stack", [1000], indirect=True)
async def test_a_prompt_past_the_context_length_is_refused_at_once_and_the_length_listed(stack):
    session, fakes, _ = stack
    async with session.get("/v1/models") as resp:
        assert (await resp.json())["data"][0]["max_model_len"] == 1000
    for body in (chat("ab " * 1500, stream=True), chat("Hi", max_tokens=999)):
        async with session.post("/v1/chat/completions", json=body) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
            assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "messages", "context_length_exceeded")
            assert error["message"].startswith("This model's maximum context length is 1000 tokens. However, you requested ")
    async with session.post("/v1/completions", json={"model": MODEL, "prompt": list(range(990)), "max_tokens": 11}) as resp:
        error = (await resp.json())["error"]
        assert resp.status == 400 and error["param"] == "prompt"
        assert "you requested 1001 tokens (990 in the prompt, 11 in the completion)" in error["message"]
    # Text that cannot fit whatever it tokenizes to is refused before tokenizing: Qwen2.5's longest token is 128 bytes
    # and NFC merges at most 4 code points into one, so 512,000 characters are at least 1,000 tokens.
    for path, body, param in (("/v1/chat/completions", chat("a" * 512_000), "messages"),
                              ("/v1/completions", {"model": MODEL, "prompt": "a" * 512_000}, "prompt")):
        async with session.post(path, json=body) as resp:
            error = (await resp.json())["error"]
            assert (resp.status, error["param"], error["code"]) == (400, param, "context_length_exceeded")
            assert f"However, the text of the {param} alone (512000 characters) is at least 1000 tokens, and " in error["message"]
            # a chat without max_tokens: the engine still generates one token
            assert param == "prompt" or "1000 tokens, and at least 1 is asked for the completion" in error["message"]
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": "' + "a" * 511_988 + '"}'}}]
    messages = [{"role": "assistant", "tool_calls": calls}, {"role": "user", "content": "go"}]
    async with session.post("/v1/chat/completions", json={"model": MODEL, "messages": messages}) as resp:
        error = (await resp.json())["error"]  # a tool call's name and arguments count as text: 1 + 511,997 + 2 characters
        assert "However, the text of the messages alone (512000 characters) is at least 1000 tokens" in error["message"]
    async with session.post("/v1/chat/completions", json=chat("a" * 511_999)) as resp:
        assert "you requested " in (await resp.json())["error"]["message"]  # at least 999: tokenized, then counted exactly
    async with session.post("/v1/completions", json={"model": MODEL, "prompt": "a" * 511_999}) as resp:
        # at least 999 + the 16 tokens a completion's reply may have by default (SGLang's and OpenAI's max_tokens)
        assert "is at least 999 tokens, and 16 are asked for the completion" in (await resp.json())["error"]["message"]
    assert fakes["sp0"].bodies == [] and fakes["lp0"].bodies == []
    async with session.post("/v1/completions", json={"model": MODEL, "prompt": list(range(990))}) as resp:
        assert "you requested 1006 tokens (990 in the prompt, 16 in the completion)" in (await resp.json())["error"]["message"]
    async with session.post("/v1/chat/completions", json=chat("Hi", input_ids=list(range(1000)))) as resp:
        error = (await resp.json())["error"]
        assert error["param"] == "input_ids" and "you requested 1001 tokens (1000 in the input_ids, at least 1 in the completion)" in error["message"]
    async with session.post("/v1/completions", json={"model": MODEL, "prompt": list(range(990)), "max_tokens": 10}) as resp:
        assert resp.status == 200  # 1000 tokens: fits


async def test_follow_up_turn_on_long_cached_history_is_short(stack):
    session, fakes, _ = stack
    history = [{"role": "user", "content": " word" * 400}]
    async with session.post("/v1/chat/completions", json={"model": MODEL, "messages": history}) as resp:
        assert resp.headers["x-laps-class"] == "long"
    await settle_background()
    history += [{"role": "assistant", "content": "hi from lp0"}, {"role": "user", "content": "And now?"}]
    async with session.post("/v1/chat/completions", json={"model": MODEL, "messages": history}) as resp:
        # ~420 prompt tokens, but all but the last block or two are cached on lp0: L < 256.
        assert resp.headers["x-laps-class"] == "short"
    async with session.get("/metrics") as resp:
        assert 'laps_reprefills_total{cls="short"} 1.0' in await resp.text()


@pytest.mark.parametrize(
    "payload, expected",
    [
        (b'{"object": "error", "message": "bad prompt", "type": "BadRequestError", "param": null, "code": 400}', {"message": "bad prompt", "type": "invalid_request_error", "param": None, "code": None}),
        (b'{"object": "error", "message": "bad n", "type": "BadRequestError", "param": "n", "code": "bad_n"}', {"message": "bad n", "type": "invalid_request_error", "param": "n", "code": "bad_n"}),
        (b'{"error": {"message": "nested", "type": "x", "param": "p", "code": "c"}}', {"message": "nested", "type": "x", "param": "p", "code": "c"}),
        (b"Bad Request", {"message": "Bad Request", "type": "invalid_request_error", "param": None, "code": None}),
    ],
)
async def test_engine_error_answers_reach_the_client_in_openai_shape(stack, payload, expected):
    session, fakes, _ = stack
    fakes["sp0"].error_reply = (400, payload)
    for stream in (False, True):
        async with session.post("/v1/chat/completions", json=chat("Hi", stream=stream)) as resp:
            assert resp.status == 400
            assert (await resp.json()) == {"error": expected}


async def test_stream_usage_is_requested_from_the_engine_but_only_relayed_when_asked(stack):
    session, fakes, _ = stack
    async with session.post("/v1/chat/completions", json=chat("Hi", stream=True)) as resp:
        text = (await resp.read()).decode()
    assert fakes["sp0"].bodies[-1]["stream_options"] == {"include_usage": True}
    assert '"usage":{' not in text and text.endswith("data: [DONE]\n\n")
    async with session.post("/v1/chat/completions", json=chat("Hi", stream=True, stream_options={"include_usage": True})) as resp:
        text = (await resp.read()).decode()
    assert '"usage":{' in text and text.endswith("data: [DONE]\n\n")


async def test_reported_cached_tokens_feed_the_estimate_error_metric(stack):
    session, fakes, _ = stack
    fakes["sp0"].reported_cached_tokens = 40
    async with session.post("/v1/chat/completions", json=chat("Hi", stream=True)) as resp:
        await resp.read()
    await settle_background()
    async with session.get("/metrics") as resp:
        text = await resp.text()
    assert 'laps_prefix_estimate_error_tokens_sum{cls="short"} 40.0' in text
    assert 'laps_prefix_cached_tokens_reported_total{cls="short"} 40.0' in text
    assert 'laps_prefix_cached_tokens_estimated_total{cls="short"} 0.0' in text  # a first request: nothing cached yet


async def test_follow_up_estimate_covers_the_previous_reply(stack):
    session, _, _ = stack
    history = [{"role": "user", "content": "Tell me about the history of pens. " * 20}]
    async with session.post("/v1/chat/completions", json={"model": MODEL, "messages": history}) as resp:
        first_prompt = int(resp.headers["x-laps-prompt-tokens"])
        reply = (await resp.json())["choices"][0]["message"]["content"]
    await settle_background()  # the gateway records the finished turn after answering
    history += [{"role": "assistant", "content": reply}, {"role": "user", "content": "More?"}]
    async with session.post("/v1/chat/completions", json={"model": MODEL, "messages": history}) as resp:
        estimate = int(resp.headers["x-laps-cached-tokens-est"])
        assert int(resp.headers["x-laps-new-tokens"]) == int(resp.headers["x-laps-prompt-tokens"]) - estimate  # one engine
    # Cached: turn 1's prompt (ending "<|im_start|>assistant\n") and the reply's turn as the next request renders it
    # (reply, "<|im_end|>", "\n"), in whole 16-token blocks.
    reply_tokens = len(load_tokenizer().encode(reply + "<|im_end|>\n"))
    assert estimate == (first_prompt + reply_tokens) // 16 * 16 > first_prompt // 16 * 16
    async with session.get("/metrics") as resp:
        text = await resp.text()
    assert f'laps_prefix_cached_tokens_estimated_total{{cls="short"}} {float(estimate)}' in text


@pytest.mark.parametrize("value, status", [("0.05", 200), ("none", 200), ("2", 200), (".5", 200), ("5e-2", 200), ("-1", 400),
                                           ("soon", 400), ("inf", 400), ("1_0", 400), ("\u0663", 400), ("+1", 400), ("nan", 400)])
async def test_slo_header_sets_or_removes_the_deadline(stack, value, status):
    session, _, _ = stack
    async with session.post("/v1/chat/completions", json=chat("Hi"), headers={"x-laps-slo-ttft-s": value}) as resp:
        assert resp.status == status
        if status == 400:
            assert (await resp.json())["error"]["param"] == "x-laps-slo-ttft-s"


async def test_a_stream_read_to_the_end_then_closed_is_ok_and_not_aborted(stack):
    session, fakes, _ = stack
    url = str(session._base_url)
    for _ in range(5):
        async with aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(force_close=True)) as closing:
            async with closing.post("/v1/chat/completions", json=chat("Hi " * 300, stream=True)) as resp:
                assert (await resp.read()).endswith(b"data: [DONE]\n\n")
    await asyncio.sleep(0.05)
    await settle_background()
    async with session.get("/metrics") as resp:
        text = await resp.text()
    # The first goes long; the repeats are re-prefills of a cached prompt, so short.
    assert 'laps_requests_total{cls="long",outcome="ok"} 1.0' in text and 'laps_requests_total{cls="short",outcome="ok"} 4.0' in text
    assert "client_gone" not in text and fakes["lp0"].aborted == fakes["sp0"].aborted == []


@pytest.mark.parametrize(
    "path, payload, param, fragment",
    [
        ("/v1/chat/completions", chat("x", max_tokens="10"), "max_tokens", "valid integer"),
        ("/v1/chat/completions", chat("x", stream="yes"), "stream", "valid boolean"),
        ("/v1/chat/completions", chat("x", stop=5), "stop", "stop: Input should be a valid string or Input should be a valid list"),  # no union tag
        ("/v1/chat/completions", chat("x", stop=["end", 5]), "stop.1", "stop.1: Input should be a valid string"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "x"}]}, "messages.0.role", "Field required"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "messages.0.content", "text only"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages.0.content", "text parts"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": []}]}, "messages.0.content", "empty list"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x", "name": 5}]}, "messages.0.name", "valid string"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "20 C", "tool_call_id": 1}]},
         "messages.1.tool_call_id", "valid string"),
        ("/v1/completions", {"model": MODEL, "prompt": [5, -1]}, "prompt", "token id -1 is outside the vocabulary"),
        ("/v1/completions", {"model": MODEL, "prompt": [999999999]}, "prompt", "outside the vocabulary"),
        # Qwen2.5's last added token, <|file_sep|> (151664), is inside; <tool_call> (151657) too.
        ("/v1/completions", {"model": MODEL, "prompt": [151657, 151665]}, "prompt", "token id 151665 is outside the vocabulary (0 .. 151664)"),
        ("/v1/completions", {"model": MODEL, "prompt": [[1, 2]]}, "prompt", "a list of token ids"),
        ("/v1/chat/completions", chat("x", logit_bias={"abc": 1}), "logit_bias",
         "logit_bias: keys must be token ids (non-negative integers as strings), got 'abc'"),
        ("/v1/chat/completions", chat("x", logit_bias={"-5": 1}), "logit_bias", "got '-5'"),
        ("/v1/chat/completions", chat("x", logit_bias={"5": "up"}), "logit_bias.5", "valid number"),
        ("/v1/chat/completions", chat("x", logit_bias={"5": 1000}), "logit_bias.5", "less than or equal to 100"),
        ("/v1/chat/completions", chat("x", logit_bias={"5": -100.5}), "logit_bias.5", "greater than or equal to -100"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"151665": -100}}, "logit_bias",
         "logit_bias: token id 151665 is outside the vocabulary (0 .. 151664)"),
        ("/v1/completions", {"model": MODEL, "prompt": ""}, "prompt", "prompt is empty"),
        ("/v1/chat/completions", chat("x", tools=[{"type": "function", "function": {"name": "get_weather"}}],
                                      tool_choice={"type": "function", "function": {"name": "get_time"}}),
         "tool_choice", "tool_choice: names function 'get_time', which is not in tools (get_weather)"),
        ("/v1/chat/completions", chat("x", tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice", "not in tools (none given)"),
        ("/v1/chat/completions", chat("x", top_logprobs=3), "top_logprobs", "top_logprobs: needs logprobs: true"),
        ("/v1/chat/completions", chat("x", logprobs=False, top_logprobs=3), "top_logprobs", "needs logprobs: true"),
        ("/v1/chat/completions", chat("x", logprobs=True, top_logprobs=21), "top_logprobs", "less than or equal to 20"),
        # content is required (OpenAI), but for an assistant turn that called tools
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}, "messages.0.content",
         "messages.0.content: a user message needs content (a string or a list of text parts)"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": None}]}, "messages.0.content", "a user message needs content"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "system", "content": None}, {"role": "user", "content": "x"}]},
         "messages.0.content", "a system message needs content"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None},
                                                                {"role": "user", "content": "y"}]},
         "messages.1.content", "messages.1.content: an assistant message needs content unless it has tool_calls"),
        # stream_options only with "stream": true (OpenAI)
        ("/v1/chat/completions", chat("x", stream_options={"include_usage": True}), "stream_options", "stream_options: only allowed when stream is true"),
        ("/v1/chat/completions", chat("x", stream=False, stream_options={"include_usage": True}), "stream_options", "only allowed when stream is true"),
        ("/v1/chat/completions", chat("x", stream=True, stream_options=True), "stream_options", "valid dictionary"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream is true"),
        # fields the engine reads, typed as SGLang 0.5.23's protocol types them
        ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": -1}, "logprobs", "greater than or equal to 0"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "response_format": {"type": "xml"}}, "response_format.type",
         "'text', 'json_object', 'json_schema' or 'structural_tag'"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "echo": "x"}, "echo", "valid boolean"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "best_of": 0}, "best_of", "greater than or equal to 1"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "suffix": 5}, "suffix", "valid string"),
        ("/v1/chat/completions", chat("x", response_format={"type": "xml"}), "response_format.type",
         "'text', 'json_object', 'json_schema' or 'structural_tag'"),
        ("/v1/chat/completions", chat("x", user=5), "user", "valid string"),
    ],
)
async def test_wrong_types_are_refused_by_the_gateway_naming_the_field(stack, path, payload, param, fragment):
    session, fakes, _ = stack
    async with session.post(path, json=payload) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error")
    assert fragment in error["message"] and "Value error" not in error["message"]
    assert fakes["sp0"].bodies == [] and fakes["lp0"].bodies == []


async def test_a_client_leaving_right_after_done_while_the_engine_stream_is_still_open_is_ok_and_learnt_from(stack):
    session, fakes, _ = stack
    fakes["sp0"].hold_eof = True  # the engine ends its stream only after the client has left
    history = [{"role": "user", "content": "Tell me about the history of pens. " * 5}]
    async with aiohttp.ClientSession(str(session._base_url), connector=aiohttp.TCPConnector(force_close=True)) as closing:
        async with closing.post("/v1/chat/completions", json={"model": MODEL, "messages": history, "stream": True}) as resp:
            first_prompt = int(resp.headers["x-laps-prompt-tokens"])
            assert (await resp.content.readuntil(b"data: [DONE]\n\n")).endswith(b"data: [DONE]\n\n")
    await asyncio.sleep(0.1)  # the gateway sees the client go while it waits for the end of the engine's stream
    fakes["sp0"].release.set()
    await settle_background()
    async with session.get("/metrics") as resp:
        text = await resp.text()
    assert 'laps_requests_total{cls="short",outcome="ok"} 1.0' in text and "client_gone" not in text
    assert fakes["sp0"].aborted == []
    history += [{"role": "assistant", "content": "hi from sp0"}, {"role": "user", "content": "More?"}]
    async with session.post("/v1/chat/completions", json={"model": MODEL, "messages": history}) as resp:
        estimate = int(resp.headers["x-laps-cached-tokens-est"])
    reply_tokens = len(load_tokenizer().encode("hi from sp0<|im_end|>\n"))
    assert estimate == (first_prompt + reply_tokens) // 16 * 16  # the prompt and the reply were learnt on sp0


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather at a place",
                                                 "parameters": {"type": "object", "properties": {"place": {"type": "string"}}}}}


async def test_an_assistant_turn_with_tool_calls_and_null_content_is_valid(stack):
    session, fakes, _ = stack
    called = {"role": "assistant", "content": None,
              "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"place": "Oslo"}'}}]}
    messages = [{"role": "user", "content": "Weather in Oslo?"}, called, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    async with session.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "tools": [WEATHER_TOOL]}) as resp:
        assert resp.status == 200
    assert fakes["sp0"].bodies[-1]["messages"] == messages  # passed on as sent


async def test_tool_calls_and_tool_answers_are_counted_as_the_template_prints_them(stack):
    session, fakes, _ = stack
    arguments = '{"place": "Oslo", "days": [1, 2, 3], "note": "' + "very long " * 300 + '"}'
    called = {"role": "assistant", "content": None,
              "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]}
    messages = [{"role": "user", "content": "Weather in Oslo?"}, called, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    async with session.post("/v1/chat/completions", json={"model": MODEL, "messages": messages}) as resp:
        assert resp.status == 200
        counted = int(resp.headers["x-laps-prompt-tokens"])
    # Qwen2.5-Instruct's template: the call as a <tool_call> block, its arguments parsed (as SGLang hands them on) and
    # printed as JSON, the tool's answer in a user turn
    rendered = ('<|im_start|>user\nWeather in Oslo?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", '
                f'"arguments": {arguments}}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n')
    tok = load_tokenizer()
    assert counted == len(tok.encode(tok.render_chat([]).removesuffix("<|im_start|>assistant\n") + rendered + "<|im_start|>assistant\n"))
    assert counted > 600  # the 300 repeats count; the call alone was once counted as an empty assistant turn
    assert [b["messages"] for fake in fakes.values() for b in fake.bodies] == [messages]  # passed on as sent


async def test_a_chat_that_ends_with_the_assistants_tool_call_is_counted_as_sglang_renders_it(stack):
    session, _, _ = stack
    called = {"role": "assistant", "content": "Checking.",
              "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    async with session.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}, called]}) as resp:
        assert resp.status == 200
        counted = int(resp.headers["x-laps-prompt-tokens"])
    # SGLang 0.5.23 makes a last assistant message a user one of its text: the call is not in the prompt
    assert counted == len(load_tokenizer().encode_chat([{"role": "user", "content": "Weather?"}, {"role": "user", "content": "Checking."}]))


@pytest.mark.parametrize("arguments, fragment", [
    ("{'place': 'Oslo'}", "must be valid JSON"),
    ('{"x": NaN}', "must be valid JSON"),
    ('["Oslo"]', "must be a JSON object"),
    (7, "valid string"),
    ('{"a": ' * 300 + "1" + "}" * 300, "nest deeper than 254 levels"),
])
async def test_tool_call_arguments_that_are_not_a_json_object_are_refused_naming_them(stack, arguments, fragment):
    session, fakes, _ = stack
    called = {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}]}
    messages = [{"role": "user", "content": "Hi"}, called, {"role": "tool", "tool_call_id": "c", "content": "ok"}]
    async with session.post("/v1/chat/completions", json={"model": MODEL, "messages": messages}) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["param"].startswith("messages.1.tool_calls.0.function.arguments") and fragment in error["message"]
    assert fakes["sp0"].bodies == []


async def test_continue_final_message_counts_the_assistants_text_after_the_generation_prompt(stack):
    session, fakes, _ = stack
    messages = [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "One, two,"}]
    async with session.post("/v1/chat/completions", json=chat("", messages=messages, continue_final_message=True)) as resp:
        assert resp.status == 200
        counted = int(resp.headers["x-laps-prompt-tokens"])
    tok = load_tokenizer()  # SGLang 0.5.23: the chat without its last message, then that message's text encoded alone
    assert counted == len(tok.encode_chat(messages[:1])) + len(tok.encode("One, two,")) == len(tok.encode_chat(messages[:1])) + 4
    assert [b["continue_final_message"] for fake in fakes.values() for b in fake.bodies] == [True]
    async with session.post("/v1/chat/completions", json=chat("", messages=messages, continue_final_message="yes")) as resp:
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "continue_final_message"


async def test_a_chats_input_ids_are_its_prompt_counted_and_checked_against_the_vocabulary(stack):
    session, fakes, _ = stack
    body = chat("Hi", input_ids=list(range(100, 600)))  # SGLang prefills these instead of the rendered messages
    async with session.post("/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        assert (resp.headers["x-laps-prompt-tokens"], resp.headers["x-laps-class"]) == ("500", "long")  # not "Hi"'s 30
    assert [b["input_ids"] for fake in fakes.values() for b in fake.bodies] == [list(range(100, 600))]
    for ids, fragment in (([151665], "input_ids: token id 151665 is outside the vocabulary (0 .. 151664)"),
                          ([-1], "token id -1 is outside"), ([], "at least 1 item"), (["1"], "valid integer")):
        async with session.post("/v1/chat/completions", json=chat("Hi", input_ids=ids)) as resp:
            error = (await resp.json())["error"]  # an id past the vocabulary crashes a real SGLang engine
            assert resp.status == 400 and error["param"].startswith("input_ids") and fragment in error["message"], error
    assert sum(len(fake.bodies) for fake in fakes.values()) == 1


@pytest.mark.parametrize("depth", [254, 255])
async def test_a_body_nested_deeper_than_the_gateway_can_pass_on_is_refused(stack, depth):
    session, fakes, _ = stack
    nested = 1
    for _ in range(depth - 1):  # the body itself is the first level
        nested = {"a": nested}
    async with session.post("/v1/chat/completions", json=chat("Hi", metadata=nested)) as resp:
        if depth == 254:
            assert resp.status == 200  # passed on, as deep as sent
            return
        assert resp.status == 400  # was a 500: read, then not writable for the engine
        assert "nests arrays and objects deeper than 254 levels" in (await resp.json())["error"]["message"]
    assert fakes["sp0"].bodies == []


@pytest.mark.parametrize("tools, param, fragment", [
    ([{"type": "function"}], "tools.0.function", "Field required"),
    ([{"type": "retrieval", "function": {"name": "f"}}], "tools.0.type", "'function'"),
    ([{"type": "function", "function": {"name": "has space"}}], "tools.0.function.name", "should match pattern"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "tools.0.function.parameters", "valid dictionary"),
    ({"type": "function"}, "tools", "valid list"),
])
async def test_malformed_tools_are_refused_naming_the_field(stack, tools, param, fragment):
    session, fakes, _ = stack
    async with session.post("/v1/chat/completions", json=chat("Hi", tools=tools)) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["param"] == param and fragment in error["message"]
    assert fakes["sp0"].bodies == []


async def test_a_tool_choice_among_the_tools_and_top_logprobs_with_logprobs_pass(stack):
    session, fakes, _ = stack
    body = chat("Hi", tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}}, logprobs=True, top_logprobs=20)
    async with session.post("/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
    assert fakes["sp0"].bodies[0]["top_logprobs"] == 20 and fakes["sp0"].bodies[0]["tool_choice"]["function"]["name"] == "get_weather"


@pytest.mark.parametrize(("path", "extra"), [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}}}}),
    ("/v1/chat/completions", {"response_format": {"format": {"type": "const_string", "value": "x"}}}),  # structural tag
    ("/v1/chat/completions", {"user": "u1", "response_format": {"type": "text"}}),
    ("/v1/completions", {"echo": True, "best_of": 2, "suffix": "!", "logprobs": 0, "user": "u1"}),
    ("/v1/completions", {"logprobs": 50, "response_format": {"type": "json_object"}}),  # SGLang sets no upper bound
])
async def test_fields_typed_as_sglang_types_them_pass_on_unchanged(stack, path, extra):
    session, fakes, _ = stack
    base = chat("Hi") if path == "/v1/chat/completions" else {"model": MODEL, "prompt": "Hi"}
    async with session.post(path, json=base | extra) as resp:
        assert resp.status == 200
    sent = next(body for fake in fakes.values() for body in fake.bodies)
    assert {k: sent[k] for k in extra} == extra


async def test_tools_are_counted_with_the_template_and_passed_on(stack):
    session, fakes, _ = stack
    async with session.post("/v1/chat/completions", json=chat("Hi", tools=[WEATHER_TOOL])) as resp:
        assert resp.status == 200
        counted = int(resp.headers["x-laps-prompt-tokens"])
    as_sglang = [{"type": "function", "function": WEATHER_TOOL["function"], "defer_loading": None}]
    assert counted == len(load_tokenizer().encode_chat([{"role": "user", "content": "Hi"}], as_sglang)) > 150
    assert fakes["sp0"].bodies[0]["tools"] == [WEATHER_TOOL]
    async with session.post("/v1/chat/completions", json=chat("Hi", tools=[WEATHER_TOOL], tool_choice="none")) as resp:
        assert int(resp.headers["x-laps-prompt-tokens"]) == len(load_tokenizer().encode_chat([{"role": "user", "content": "Hi"}]))


async def test_n_above_one_is_passed_on_with_its_prefill_counted_once(stack):
    session, fakes, _ = stack
    async with session.post("/v1/chat/completions", json=chat("Hi", n=3)) as resp:
        assert resp.status == 200
        prompt_tokens = int(resp.headers["x-laps-prompt-tokens"])
    assert fakes["sp0"].bodies[0]["n"] == 3
    async with session.get("/metrics") as resp:
        assert f'laps_prompt_tokens_total{{cls="short"}} {float(prompt_tokens)}' in await resp.text()


async def test_both_cache_budgets_are_config_keys_shown_in_metrics():
    data = load_config().model_dump(exclude_unset=True)
    data["scheduling"] = {**data.get("scheduling", {}), "chat_cache_bytes": 3 * 2**20, "prefix_index_bytes": 5 * 2**20}
    fake = FakeEngine("sp0")
    servers = [TestServer(fake.app), TestServer(FakeEngine("lp0").app)]
    for s in servers:
        await s.start_server()
    app = create_app(parse_config(data), engine_urls={name: str(s.make_url("")).rstrip("/") for name, s in zip(("sp0", "lp0"), servers)})
    async with TestServer(app) as gateway, aiohttp.ClientSession(str(gateway.make_url(""))) as session:
        async with session.get("/metrics") as resp:
            text = await resp.text()
        assert app[GATEWAY].prompt_cache.max_bytes == 3 * 2**20
    budgets = {s.labels["cache"]: s.value for f in text_string_to_metric_families(text) if f.name == "laps_memory_budget_bytes" for s in f.samples}
    assert budgets == {"chat_cache": 3 * 2**20, "prefix_index": 5 * 2**20}
    for s in servers:
        await s.close()
