"""The simulated engine's HTTP shell (engines/sim/server.py), served in-process on port 0."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from engines.sim.replies import ReplyPlanner
from engines.sim.args import SimServerArgs
from engines.sim import server
from engines.sim.realtime import ENGINE
from engines.sim.server import create_app
from laps.tokenizer import load_tokenizer

TOK = load_tokenizer()
PLANNER = ReplyPlanner(TOK)
MESSAGES = [{"role": "user", "content": "Tell me about the harbour."}]


@pytest.fixture
async def client():
    args = SimServerArgs(enable_metrics=True, enable_cache_report=True, max_total_tokens=200_000,
                         served_model_name="sim-7b")
    async with TestClient(TestServer(create_app(args), handler_cancellation=True)) as c:
        yield c


def reply_text(rid: str, max_new: int, ignore_eos: bool = True) -> str:
    return TOK.decode([t for t in PLANNER.plan(rid, max_new, ignore_eos).token_ids if t not in TOK.eos_token_ids])


async def sse(resp) -> list:
    """The data payloads of an SSE response, JSON-decoded; ``[DONE]`` kept as a string."""
    out = []
    async for line in resp.content:
        line = line.strip()
        if line.startswith(b"data: "):
            payload = line[6:]
            out.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return out


async def metric(client, name: str) -> float:
    text = await (await client.get("/metrics")).text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


async def test_chat_non_streaming(client):
    body = {"model": "sim-7b", "messages": MESSAGES, "max_tokens": 6, "ignore_eos": True, "rid": "c1",
            "temperature": 0.7, "unknown_field": [1]}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200
    data = await resp.json()
    assert data["id"] == "c1" and data["object"] == "chat.completion" and data["model"] == "sim-7b"
    choice = data["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": reply_text("c1", 6), "reasoning_content": None}
    assert (choice["finish_reason"], choice["matched_stop"]) == ("length", None)
    prompt_tokens = len(TOK.encode_chat(MESSAGES))
    assert data["usage"] == {
        "prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + 6, "completion_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 0}, "reasoning_tokens": 0, "completion_tokens_details": None,
    }


async def test_chat_streaming_repeated_prompt_reports_cached_tokens(client):
    body = {"messages": MESSAGES, "max_tokens": 5, "ignore_eos": True, "rid": "same", "stream": True,
            "stream_options": {"include_usage": True}}
    first = await sse(await client.post("/v1/chat/completions", json=body))
    second = await sse(await client.post("/v1/chat/completions", json=body))
    for chunks in (first, second):
        assert chunks[-1] == "[DONE]"
        assert chunks[0]["choices"][0]["delta"] == {"reasoning_content": None, "role": "assistant", "content": ""}
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-2])
        assert text == reply_text("same", 5)
        assert chunks[-3]["choices"][0]["finish_reason"] == "length"
        assert all(c["object"] == "chat.completion.chunk" and c["id"] == "same" for c in chunks[:-1])
    prompt_tokens = len(TOK.encode_chat(MESSAGES))
    assert first[-2]["choices"] == [] and first[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": prompt_tokens - 1}
    assert second[-2]["usage"]["completion_tokens"] == 5


async def test_chat_content_parts_are_joined(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "more."}]}]
    data = await (await client.post("/v1/chat/completions", json={"messages": parts, "max_tokens": 1})).json()
    expected = TOK.encode_chat([{"role": "user", "content": "Tell me more."}])
    assert data["usage"]["prompt_tokens"] == len(expected)


async def test_stop_string_cuts_the_text(client):
    full = reply_text("st", 40)
    stop = full.split()[5]
    body = {"messages": MESSAGES, "max_tokens": 40, "ignore_eos": True, "rid": "st", "stop": stop}
    data = await (await client.post("/v1/chat/completions", json=body)).json()
    choice = data["choices"][0]
    assert choice["message"]["content"] == full[: full.find(stop)]
    assert (choice["finish_reason"], choice["matched_stop"]) == ("stop", stop)
    chunks = await sse(await client.post("/v1/chat/completions", json={**body, "rid": "st", "stream": True}))
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1])
    assert streamed == full[: full.find(stop)]


async def test_natural_reply_ends_with_eos(client):
    data = await (await client.post("/v1/chat/completions", json={"messages": MESSAGES, "rid": "nat"})).json()
    choice = data["choices"][0]
    assert (choice["finish_reason"], choice["matched_stop"]) == ("stop", 151645)
    assert data["usage"]["completion_tokens"] == PLANNER.natural_length("nat") + 1
    assert choice["message"]["content"] == reply_text("nat", 10_000, ignore_eos=False)


async def test_completions_streaming_and_not(client):
    body = {"prompt": "The harbour", "max_tokens": 4, "ignore_eos": True, "rid": "p1"}
    data = await (await client.post("/v1/completions", json=body)).json()
    assert data["object"] == "text_completion"
    assert data["choices"][0]["text"] == reply_text("p1", 4)
    assert data["usage"]["prompt_tokens"] == len(TOK.encode("The harbour"))
    chunks = await sse(await client.post("/v1/completions", json={
        **body, "stream": True, "stream_options": {"include_usage": True}}))
    assert chunks[-1] == "[DONE]"
    assert "".join(c["choices"][0]["text"] for c in chunks[:-2]) == reply_text("p1", 4)
    assert chunks[-3]["choices"][0]["finish_reason"] == "length"
    assert chunks[-2]["usage"]["completion_tokens"] == 4


async def test_generate_streams_cumulative_text(client):
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}, "rid": "g1",
            "stream": True}
    chunks = await sse(await client.post("/generate", json=body))
    assert chunks[-1] == "[DONE]"
    expected_ids = list(PLANNER.plan("g1", 3, True).token_ids)
    assert [c["output_ids"] for c in chunks[:-1]] == [expected_ids[:1], expected_ids[:2], expected_ids]
    assert chunks[-2]["text"] == reply_text("g1", 3)
    meta = chunks[-2]["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    assert (meta["id"], meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == ("g1", 3, 3, 0)
    assert meta["e2e_latency"] > 0
    assert "e2e_latency" not in chunks[0]["meta_info"]
    data = await (await client.post("/generate", json={**body, "stream": False, "rid": "g2",
                                                        "text": None})).json()
    assert data["meta_info"]["cached_tokens"] == 2
    assert data["text"] == reply_text("g2", 3)


async def test_v1_loads_shape(client):
    data = await (await client.get("/v1/loads")).json()
    assert set(data) == {"timestamp", "version", "accelerator", "num_accelerators", "loads"}
    (load,) = data["loads"]
    core_keys = {
        "timestamp", "dp_rank", "num_running_reqs", "num_waiting_reqs", "num_waiting_uncached_tokens",
        "num_used_tokens", "num_total_tokens", "num_active_tokens", "num_prealloc_ready_tokens",
        "max_total_num_tokens", "max_running_requests", "token_usage", "gen_throughput", "cache_hit_rate",
        "utilization", "total_prefill_uncached_tokens", "total_prefill_busy_us", "decode_moments",
    }
    assert set(load) == core_keys | {"memory", "disaggregation", "queues"}
    assert load["max_total_num_tokens"] == 200_000
    assert set(load["memory"]) == {"weight_gb", "kv_cache_gb", "graph_gb", "token_capacity"}
    core_only = await (await client.get("/v1/loads", params={"include": "core"})).json()
    assert set(core_only["loads"][0]) == core_keys
    assert (await client.get("/v1/loads", params={"include": "bogus"})).status == 400
    prom = await (await client.get("/v1/loads", params={"format": "prometheus"})).text()
    assert 'sglang_num_running_reqs{dp_rank="0"} 0' in prom


async def test_abort_request_ends_a_stream(client):
    body = {"messages": MESSAGES, "max_tokens": 5000, "ignore_eos": True, "rid": "long", "stream": True}
    async with client.post("/v1/chat/completions", json=body) as resp:
        first = await resp.content.readline()
        assert first.startswith(b"data: ")
        assert (await client.post("/abort_request", json={"rid": "long"})).status == 200
        chunks = await sse(resp)
    assert chunks[-1] == "[DONE]"
    assert chunks[-2]["choices"][0]["finish_reason"] == "abort"
    assert await metric(client, "sglang:num_aborted_requests_total") == 1


async def test_abort_all(client):
    body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 5000, "ignore_eos": True}}
    tasks = [asyncio.create_task(client.post("/generate", json={**body, "rid": f"a{i}"})) for i in range(3)]
    while (await (await client.get("/v1/loads")).json())["loads"][0]["num_running_reqs"] < 3:
        await asyncio.sleep(0.01)
    assert (await client.post("/abort_request", json={"abort_all": True})).status == 200
    for task in tasks:
        data = await (await task).json()
        assert data["meta_info"]["finish_reason"]["type"] == "abort"


async def test_client_disconnect_aborts_the_request(client):
    body = {"messages": MESSAGES, "max_tokens": 5000, "ignore_eos": True, "rid": "gone", "stream": True}
    resp = await client.post("/v1/chat/completions", json=body)
    await resp.content.readline()
    resp.close()
    for _ in range(500):  # the server notices on its next write (one token, a few ms)
        if await metric(client, "sglang:num_aborted_requests_total") == 1:
            break
        await asyncio.sleep(0.01)
    assert await metric(client, "sglang:num_aborted_requests_total") == 1
    load = (await (await client.get("/v1/loads")).json())["loads"][0]
    assert (load["num_running_reqs"], load["num_used_tokens"]) == (0, 0)


@pytest.mark.parametrize(
    ("path", "body", "message", "err_type"),
    [
        ("/v1/chat/completions", {"max_tokens": 3}, "messages: Field required", "Bad Request"),
        ("/v1/chat/completions", {"messages": []}, "Messages cannot be empty.", "BadRequestError"),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": "ten"}, "max_tokens", "Bad Request"),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": -1}, "max_new_tokens must be at least 0",
         "BadRequestError"),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 40_000}, "max_completion_tokens is too large",
         "BadRequestError"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 32_800}]},
         "longer than the model's context length", "BadRequestError"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens must be positive", "Bad Request"),
        ("/v1/completions", {"prompt": ""}, "Prompt cannot be empty", "BadRequestError"),
        # sampling values SGLang 0.5.23's SamplingParams.verify refuses, with its messages
        ("/v1/chat/completions", {"messages": MESSAGES, "top_k": -7}, "top_k must be -1 (disable) or at least 1, got -7.",
         "BadRequestError"),
        ("/v1/chat/completions", {"messages": MESSAGES, "top_k": 0}, "top_k must be -1", "BadRequestError"),
        ("/v1/chat/completions", {"messages": MESSAGES, "seed": "x"}, "seed: Input should be a valid int", "Bad Request"),
        ("/v1/chat/completions", {"messages": MESSAGES, "temperature": -0.5},
         "temperature must be a non-negative finite number, got -0.5.", "BadRequestError"),
        ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty must be in (0, 2]",
         "BadRequestError"),
        ("/v1/completions", {"prompt": "x", "min_tokens": -1}, "min_new_tokens must be at least 0, got -1.",
         "BadRequestError"),
        ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5.",
         "BadRequestError"),
        ("/v1/chat/completions", {"messages": MESSAGES, "min_tokens": 10, "max_tokens": 5},
         "min_new_tokens must be in [0, max_new_tokens(5)], got 10.", "BadRequestError"),
        # SGLang answers n choices; the simulated engine answers one and says so rather than answer fewer
        ("/v1/chat/completions", {"messages": MESSAGES, "n": 3}, "n must be 1 on the simulated engine (it answers one "
         "choice), got 3", "Bad Request"),
        ("/v1/completions", {"prompt": "x", "n": 2}, "n must be 1 on the simulated engine", "Bad Request"),
        ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs must be at least 0, got -1", "Bad Request"),
        ("/v1/completions", {"prompt": "x", "logprobs": 10**9}, "logprobs must be at most the vocabulary size",
         "Bad Request"),
        ("/v1/completions", {"prompt": "x", "echo": True}, "echo must be false on the simulated engine", "Bad Request"),
        ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21},
         "top_logprobs must be between 0 and 20, got 21", "Bad Request"),
        ("/v1/completions", {"prompt": "x", "min_tokens": 20}, "min_new_tokens must be in [0, max_new_tokens(16)], got 20.",
         "BadRequestError"),
        # an assistant turn's tool calls: typed as SGLang 0.5.23's ToolCall, arguments a JSON object
        ("/v1/chat/completions", {"messages": MESSAGES + [{"role": "assistant", "tool_calls": [{"function": {"name": 7}}]},
                                                          {"role": "user", "content": "?"}]}, "messages: tool_calls", "Bad Request"),
        ("/v1/chat/completions", {"messages": MESSAGES + [{"role": "assistant", "tool_calls": [{"function": {"arguments": "[1]"}}]},
                                                          {"role": "user", "content": "?"}]}, "must be a JSON object", "BadRequestError"),
    ],
)
async def test_openai_errors_are_400_with_sglang_error_bodies(client, path, body, message, err_type):
    resp = await client.post(path, json=body)
    assert resp.status == 400
    data = await resp.json()
    assert set(data) == {"object", "message", "type", "param", "code"}
    assert (data["object"], data["type"], data["param"], data["code"]) == ("error", err_type, None, 400)
    assert message in data["message"]


async def test_generate_errors(client):
    resp = await client.post("/generate", json={"sampling_params": {}})
    assert resp.status == 400
    assert await resp.json() == {"error": {"message": "Either text, input_ids or input_embeds should be provided."}}
    resp = await client.post("/generate", json={"text": "hi", "sampling_params": {"min_p": 1.5, "top_k": 5}})
    assert resp.status == 400
    assert await resp.json() == {"error": {"message": "min_p must be in [0, 1], got 1.5."}}
    resp = await client.post("/generate", json={"text": "hi", "sampling_params": {"top_k": -1, "sampling_seed": 7,
                                                                                   "max_new_tokens": 2}})
    assert resp.status == 200


async def test_a_busy_engine_answers_its_generation_probe_before_the_probes_own_token(monkeypatch):
    """SGLang's health_generate: any token put out since the probe began is a sign of life. With one request slot
    taken by a long generation the probe's own request waits, yet the probe answers 200 within a poll."""
    monkeypatch.setattr(server, "HEALTH_CHECK_POLL_S", 0.05)
    args = SimServerArgs(max_running_requests=1, served_model_name="sim-7b")
    async with TestClient(TestServer(create_app(args), handler_cancellation=True)) as c:
        body = {"model": "sim-7b", "messages": MESSAGES, "max_tokens": 20_000, "ignore_eos": True, "stream": True}
        async with c.post("/v1/chat/completions", json=body) as stream:
            await stream.content.readline()  # decoding
            engine = c.app[ENGINE]
            resp = await asyncio.wait_for(c.get("/health_generate"), timeout=5)
            assert resp.status == 200
            assert engine.core.has_work() and len(engine._tracks) == 1  # the probe's request never ran: released


async def test_a_hung_engine_fails_its_generation_probe_after_the_health_check_timeout(monkeypatch):
    monkeypatch.setattr(server, "HEALTH_CHECK_TIMEOUT_S", 0.1)
    async with TestClient(TestServer(create_app(SimServerArgs(sim_fault="hang")), handler_cancellation=True)) as c:
        assert (await c.get("/ready")).status == 200
        assert (await c.get("/health_generate")).status == 503 and (await c.get("/health")).status == 503


async def test_info_endpoints(client):
    assert (await client.get("/ready")).status == 200
    assert (await client.get("/health")).status == 200
    models = await (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == "sim-7b" and models["data"][0]["max_model_len"] == 32768
    assert await (await client.get("/v1/models/sim-7b")).json() == models["data"][0]
    missing = await client.get("/v1/models/org/other")
    assert missing.status == 404 and (await missing.json())["error"]["message"] == "The model 'org/other' does not exist"
    info = await (await client.get("/model_info")).json()
    assert (info["served_model_name"], info["is_generation"]) == ("sim-7b", True)
    server = await (await client.get("/server_info")).json()
    assert (server["max_total_tokens"], server["chunked_prefill_size"], server["schedule_policy"]) == (
        200_000, 8192, "fcfs")
    assert server["version"] == "0.5.23"


async def test_flush_cache_and_metrics(client):
    await client.post("/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 2}})
    assert (await client.post("/flush_cache")).status == 200
    assert await metric(client, "sglang:num_requests_total") == 1
    assert await metric(client, "sglang:time_to_first_token_seconds_count") == 1
    assert await metric(client, "sglang:prompt_tokens_total") == len(TOK.encode("hello"))
    text = await (await client.get("/metrics")).text()
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:cache_hit_rate",
                 "sglang:generation_tokens_total"):
        assert name + "{" in text


async def test_priority_is_an_integer_request_field(client):
    body = {"messages": MESSAGES, "max_tokens": 2, "ignore_eos": True, "priority": 5}
    assert (await client.post("/v1/chat/completions", json=body)).status == 200
    resp = await client.post("/v1/chat/completions", json={**body, "priority": "high"})
    assert resp.status == 400 and "priority" in (await resp.json())["message"]
    data = await (await client.post("/generate", json={"input_ids": [1, 2], "priority": 3,
                                                        "sampling_params": {"max_new_tokens": 1}})).json()
    assert data["meta_info"]["completion_tokens"] == 1


async def test_a_crashed_engine_loop_ends_open_requests_and_turns_unready():
    from engines.sim.realtime import SimEngine
    from engines.sim.server import SimServerArgs, resolve_args
    from laps.tokenizer import load_tokenizer

    engine = SimEngine(resolve_args(SimServerArgs()), load_tokenizer())

    def broken_step(now):
        raise RuntimeError("model bug")

    engine.core.step = broken_step
    await engine.start()
    track = engine.submit("r1", [1, 2, 3], 5, False, [])
    events = [ev async for ev in track.events()]
    assert [ev.finish_reason for ev in events] == ["abort"]
    assert engine.ready is False
    await engine.stop()


async def test_logprobs_have_openai_shapes_streamed_or_not(client):
    chat_body = {"model": "sim-7b", "messages": MESSAGES, "max_tokens": 4, "ignore_eos": True, "logprobs": True, "top_logprobs": 2,
                 "n": 1}  # one choice, as asked
    body = await (await client.post("/v1/chat/completions", json={**chat_body, "rid": "lp1"})).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert "".join(t["token"] for t in content) == body["choices"][0]["message"]["content"] == reply_text("lp1", 4)
    assert len(content) == 4 and all(len(t["top_logprobs"]) == 2 and t["top_logprobs"][0]["token"] == t["token"] for t in content)
    assert content[0]["logprob"] == content[0]["top_logprobs"][0]["logprob"] == -0.25 and content[0]["top_logprobs"][1]["logprob"] == -2.0
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    chunks = await sse(await client.post("/v1/chat/completions", json={**chat_body, "rid": "lp2", "stream": True}))
    streamed = [t for c in chunks[:-1] if c["choices"] and c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["content"]]
    assert "".join(t["token"] for t in streamed) == reply_text("lp2", 4) and len(streamed) == 4
    plain = {"model": "sim-7b", "prompt": "The harbour", "max_tokens": 3, "ignore_eos": True, "logprobs": 1, "rid": "lp3"}
    choice = (await (await client.post("/v1/completions", json=plain)).json())["choices"][0]
    logprobs = choice["logprobs"]
    assert "".join(logprobs["tokens"]) == choice["text"] and logprobs["token_logprobs"] == [-0.25] * 3
    assert logprobs["top_logprobs"] == [{t: -0.25} for t in logprobs["tokens"]]
    assert logprobs["text_offset"] == [0, len(logprobs["tokens"][0]), len(logprobs["tokens"][0]) + len(logprobs["tokens"][1])]
    no_logprobs = await (await client.post("/v1/completions", json={**plain, "logprobs": None})).json()
    assert no_logprobs["choices"][0]["logprobs"] is None


async def test_tools_are_rendered_into_the_prompt_as_the_template_does(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}]
    base = {"model": "sim-7b", "messages": MESSAGES, "max_tokens": 1}
    with_tools = await (await client.post("/v1/chat/completions", json={**base, "tools": tools})).json()
    none = await (await client.post("/v1/chat/completions", json={**base, "tools": tools, "tool_choice": "none"})).json()
    expected = len(TOK.encode_chat(MESSAGES, [{"type": "function", "function": {**tools[0]["function"], "description": None}, "defer_loading": None}]))
    assert with_tools["usage"]["prompt_tokens"] == expected > none["usage"]["prompt_tokens"] == len(TOK.encode_chat(MESSAGES))
