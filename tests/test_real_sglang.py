"""The gateway in front of real SGLang 0.5.23 on CPU, and the same tests against the simulated engine.

The deployment: engine ``e0`` is the engine under test, of the parametrised
kind (``sglang``: real SGLang with random weights on a tiny Qwen2 model that
has the real Qwen2.5 vocabulary and ChatML template; ``sim``: the simulated
engine on the same model directory), launched by the gateway's engine manager
as ``laps serve`` would; a simulated ``standby`` engine takes the traffic
while ``e0`` restarts in the role-switch test. The short-request threshold is
raised so that every request is short: ``e0`` serves all of them unless it is
draining. Clients are the official ``openai`` package (and ``httpx`` where a
stream must be cut). The role switch runs last: it changes ``e0``.

Every engine runs with a KV pool of :data:`KV_POOL_TOKENS` (so that a few
conversations fill ``e0``'s radix cache and it evicts) and publishes its KV cache
events (``--kv-events-config``, the command line laps builds), which the exact
prefix test follows. One deployment serves every test: real SGLang takes ~2
minutes to start on a 2-core machine.
"""

from __future__ import annotations

import gzip
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engines.manager import free_port
from gateway.engine_load import EngineLoad, fetch_engine_load
from gateway.role_switch import switch_role
from laps.config import load_config, parse_config
from loadgen.workloads import DATA_DIR, load_arena, load_mtbench, load_sharegpt
from policies.prefix_index import BlockChain
from tests import sglang_env
from tests.live_gateway import LiveGateway

MODEL = "tiny-qwen2.5"
KV_POOL_TOKENS = 3000  # the exact prefix test's four conversations of four turns overflow it: the radix cache evicts
T = TypeVar("T")


@dataclass
class Deployment:
    """A running gateway with engine ``e0`` of ``kind`` and a simulated standby, and an openai client for it."""

    kind: str
    live: LiveGateway
    client: openai.OpenAI
    engine_url: str  # e0's

    def load(self) -> EngineLoad:
        """e0's own load report, read and parsed by the gateway's load tracking."""
        return self.live.run(fetch_engine_load(self.live.gateway.client, self.engine_url))


@pytest.fixture(scope="module", params=[pytest.param("sglang", marks=pytest.mark.sglang), "sim"])
def deployment(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path):
    kind = request.param
    roles = {name: role.model_dump() for name, role in load_config().roles.items()}
    for role in roles.values():
        role["flags"]["max-total-tokens"] = KV_POOL_TOKENS
    # e0 runs shortest-prefill-first with laps' SGLang plugin, its deadline order, short passes and decode turns, as
    # the engines of laps' 8xH200 examples do (checked by test_laps_plugin_runs_in_the_engine; the other tests run on
    # it too, so every prefill pass of real SGLang is built by the plugin's PrefillAdder subclass, and after each one
    # the decode pass SGLang's interval owes goes through the plugin's decode turn hook)
    roles["short-prefill"].update(late_requests_last=True, deadline_order=True, short_pass=True, decode_turns=True,
                                  flags={**roles["short-prefill"]["flags"], "schedule-policy": "shortest-prefill-first",
                                         "prefill-decode-interval": 1})
    data = {
        "model": {"name": MODEL, "path": str(tiny_model_dir)},
        "gateway": {"port": free_port()},
        "scheduling": {"short_threshold_tokens": 1_000_000},
        "roles": roles,
        "engines": [{"name": "e0", "kind": kind, "role": "short-prefill"}, {"name": "standby", "kind": "sim", "role": "long-prefill"}],
        "log_dir": str(tmp_path_factory.mktemp(f"{kind}-logs")),
    }
    if kind == "sglang":
        python = request.getfixturevalue("sglang_python")
        data["sglang"] = {"python": str(python), "extra_args": [*sglang_env.CPU_SERVER_ARGS, "--max-total-tokens", str(KV_POOL_TOKENS)],
                          "env": {"PYTHONPATH": str(sglang_env.CPU_SHIMS_DIR)}}
    with LiveGateway(parse_config(data)) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=120)
        yield Deployment(kind, live, client, live.gateway.registry["e0"].url)
        client.close()


def eventually(probe: Callable[[], T], done: Callable[[T], bool], timeout_s: float = 20.0) -> T:
    """Call ``probe`` until ``done`` holds for its value (returned); fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if done(value):
            return value
        assert time.monotonic() < deadline, f"still {value!r} after {timeout_s} s"
        time.sleep(0.1)


def real_chats() -> list[tuple[str, list[dict]]]:
    """15 real chats from loadgen's data sets: multi-turn hh-rlhf histories with their real replies,
    MT-Bench under a system prompt, and Arena-hard and ShareGPT prompts (the first two and the two
    longest of each: code, markdown, non-Latin text, up to ~2,100 tokens)."""
    def clean(messages: list[dict]) -> bool:  # a special-token string in a text would be a control token
        return not any("<|" in m["content"] for m in messages)

    chats: list[tuple[str, list[dict]]] = []
    with gzip.open(DATA_DIR / "hh_rlhf_harmless_base_test_conversations.jsonl.gz", "rt") as f:
        for line in f:
            row = json.loads(line)
            last_user = max(i for i, m in enumerate(row["messages"]) if m["role"] == "user")
            history = row["messages"][: last_user + 1]
            if sum(m["role"] == "user" for m in history) >= 3 and clean(history):
                chats.append((f"hh-rlhf {row['conversation_id']}", history))
            if len(chats) == 5:
                break
    for c in load_mtbench()[:2]:
        chats.append((c.id, [{"role": "system", "content": "You are a careful judge."}, {"role": "user", "content": c.turns[0].content}]))
    for conversations in (load_arena(), load_sharegpt()):
        prompts = [c for c in conversations if clean([{"content": c.turns[0].content}])]
        longest = sorted(prompts, key=lambda c: len(c.turns[0].content))[-2:]
        chats += [(c.id, [{"role": "user", "content": c.turns[0].content}]) for c in prompts[:2] + longest]
    return chats


def test_laps_plugin_runs_in_the_engine(deployment: Deployment):
    """e0's role sets ``late_requests_last``: real SGLang loads laps' plugin in its scheduler process (its log says
    so, with the objective from ``slo``), and the simulated engine models it from its command line. Before the role
    switch test, which restarts e0 with another role."""
    engine = deployment.live.gateway.manager.engines["e0"]
    if deployment.kind == "sglang":
        lines = [line for line in engine.log_path.read_text().splitlines() if "INFO laps plugin (pid " in line]
        # once in each process that loads plugins: the server's, its scheduler's (where the queue is ordered) and its
        # detokenizer's, each with the deadline order's line, the short passes' and the decode turns' (threshold
        # 1,000,000 here)
        said = [line.split("): ", 1)[1] for line in lines]
        assert len(lines) == 12 and len({line.split("(pid ")[1].split(")")[0] for line in lines}) == 3
        assert said.count("shortest-prefill-first now puts requests that have waited longer than 0.4 s + 0 s "
                          "per 1,000 new tokens behind all others") == 3
        assert sum(line.startswith("requests in time of more than 999999 new tokens go by deadline") for line in said) == 3
        assert said.count("a prefill pass that carries requests in time of at most 999999 new tokens holds at most "
                          "1000000 tokens, or what they need where more (short passes)") == 3
        assert said.count("a decode pass that --prefill-decode-interval owes is kept only while no chunked prefill is "
                          "in progress and every waiting request has at most 999999 new tokens (decode turns)") == 3
    else:
        assert engine.command[-10:] == ["--sim-late-last-ttft-s", "0.4", "--sim-late-last-per-1k-s", "0",
                                        "--sim-late-last-deadline-order-above", "999999", "--sim-short-pass-tokens",
                                        "1000000", "--sim-decode-turn-short-tokens", "999999"]


def test_chat_streaming_and_not(deployment: Deployment):
    client = deployment.client
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=8, extra_body={"ignore_eos": True}
    )
    done = raw.parse()
    assert raw.headers["x-laps-engine"] == "e0"
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 8
    assert done.choices[0].message.role == "assistant" and done.choices[0].message.content
    # 21 default-system tokens + <|im_start|>user\n + 7 text tokens + <|im_end|>\n + <|im_start|>assistant\n
    assert done.usage.prompt_tokens == int(raw.headers["x-laps-prompt-tokens"]) == 36
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=6, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 6


def test_completions_streaming_and_not(deployment: Deployment):
    client = deployment.client
    done = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=5, extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 5 and done.usage.prompt_tokens == 4 and done.choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "length"
    # OpenAI reads an optional null as absent; SGLang refuses these nulls, so the gateway drops them
    nulls = {"stream": None, "n": None, "echo": None, "temperature": None, "top_p": None, "frequency_penalty": None}
    done = client.completions.create(model=MODEL, prompt="One two", max_tokens=3, extra_body={"ignore_eos": True, **nulls})
    assert done.usage.completion_tokens == 3 and len(done.choices) == 1


def test_logprobs_and_tools_pass_through_with_openai_shapes(deployment: Deployment):
    client = deployment.client
    messages = [{"role": "user", "content": "Name a colour."}]
    done = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = done.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, logprobs=True, top_logprobs=1,
                                                 stream=True, extra_body={"ignore_eos": True}))
    # Each content chunk carries the logprobs of the tokens it brings. Real SGLang 0.5.23 sends a step's tokens as one
    # chunk (two when its output lags the stream) and drops a step's logprobs when its text is empty (a token that ends
    # mid-character, which random weights draw now and then: serving_chat.py, "an empty-delta step has no chunk"), so
    # up to 3 entries in all there; the simulated engine sends one per token.
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    entries = [len(c.choices[0].logprobs.content) for c in content_chunks]
    assert all(n >= 1 for n in entries) and 1 <= sum(entries) <= 3
    assert deployment.kind == "sglang" or entries == [1, 1, 1]
    assert all(c in content_chunks for c in chunks if c.choices and c.choices[0].logprobs)
    text = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=2, logprobs=2, extra_body={"ignore_eos": True})
    assert len(text.choices[0].logprobs.tokens) == len(text.choices[0].logprobs.token_logprobs) == 2
    tools = [{"type": "function", "function": {"name": "get_colour", "parameters": {"type": "object", "properties": {}}}}]
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=1, tools=tools)
    assert raw.parse().usage.prompt_tokens == int(raw.headers["x-laps-prompt-tokens"])  # the gateway counts the tools as the engine does
    # and a tool-calling conversation: the calls' names and arguments, and the tools' answers, as the template prints them
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_colour", "arguments": '{"shade": "dark", "n": [1, 2]}'}},
             {"id": "c2", "type": "function", "function": {"name": "get_colour", "arguments": "{}"}}]
    called = messages + [{"role": "assistant", "content": None, "tool_calls": calls},
                         {"role": "tool", "tool_call_id": "c1", "content": "navy"}, {"role": "tool", "tool_call_id": "c2", "content": "red"}]
    # (SGLang makes a last assistant message a user one of its text, dropping its calls)
    for chat, tools_sent in ((called, tools), (called, None), (called[:-2], None)):
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=chat, max_tokens=1, tools=tools_sent)
        assert raw.parse().usage.prompt_tokens == int(raw.headers["x-laps-prompt-tokens"])
    # a developer message, handed to the template as it is (Qwen2.5-Instruct's prints no such role)
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=[{"role": "developer", "content": "Be terse."}] + messages,
                                                           max_tokens=1)
    assert raw.parse().usage.prompt_tokens == int(raw.headers["x-laps-prompt-tokens"])
    # continue_final_message: the last (assistant) message's text follows the generation prompt
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages + [{"role": "assistant", "content": "Navy or"}],
                                                           max_tokens=1, extra_body={"continue_final_message": True})
    assert raw.parse().usage.prompt_tokens == int(raw.headers["x-laps-prompt-tokens"])
    # SGLang's input_ids: prefilled instead of the rendered messages, and counted so
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=1, extra_body={"input_ids": list(range(100, 140))})
    assert raw.parse().usage.prompt_tokens == int(raw.headers["x-laps-prompt-tokens"]) == 40


def test_gateway_prompt_tokens_equal_engine_usage_on_real_chats(deployment: Deployment):
    chats = real_chats()
    assert len(chats) == 15 and any(sum(m["role"] == "assistant" for m in messages) >= 2 for _, messages in chats)
    counts = {}
    for name, messages in chats:
        raw = deployment.client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=1)
        counts[name] = (int(raw.headers["x-laps-prompt-tokens"]), raw.parse().usage.prompt_tokens)
    assert {name: gw for name, (gw, _) in counts.items()} == {name: engine for name, (_, engine) in counts.items()}
    assert max(engine for _, engine in counts.values()) > 2048  # one prompt takes two prefill chunks on short-prefill


def test_second_turn_hit_reported_by_engine_matches_gateway_estimate(deployment: Deployment):
    """Turn 1 asks for one token, so the engine then holds exactly turn 1's prompt in its cache,
    which is all the gateway's prefix index learns (it indexes prompts, not generated tokens). Turn 2 waits for
    that insertion's KV event to reach the gateway (a client's think time; README: exact prefix hits)."""
    gw = deployment.live.gateway
    block = deployment.live.config.scheduling.prefix_block_tokens
    history = [{"role": "user", "content": "Write a haiku about the sea, then explain each line of it in detail."}]
    turns = []
    for follow_up in ("Now one about mountains.", None):
        raw = deployment.client.chat.completions.with_raw_response.create(model=MODEL, messages=history, max_tokens=1)
        done = raw.parse()
        turns.append((done.usage.prompt_tokens, done.usage.prompt_tokens_details.cached_tokens, int(raw.headers["x-laps-cached-tokens-est"])))
        if follow_up:
            prompt = BlockChain(gw.prefix_index.block_tokens).extend(gw.tokenizer.encode_chat(history))
            eventually(lambda: gw.prefix_index.cached_tokens(raw.headers["x-laps-engine"], prompt), lambda cached: cached >= prompt.tokens - 1)
            history += [{"role": "assistant", "content": done.choices[0].message.content}, {"role": "user", "content": follow_up}]
    (prompt_1, _, _), (_, reported, estimate) = turns
    assert reported >= prompt_1 - 1, turns  # turn 1's prompt (the engine may recompute its last token)
    assert all(abs(r - e) < block for _, r, e in turns), turns


def test_client_disconnect_mid_stream_aborts_on_the_engine(deployment: Deployment):
    before = deployment.load()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{deployment.live.url}/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.headers["x-laps-engine"] == "e0"
        lines = resp.iter_lines()  # held: dropping a half-read iterator closes the connection
        next(lines)
        running = eventually(deployment.load, lambda load: load.running_requests == 1)
        assert running.used_tokens > 0
    after = eventually(deployment.load, lambda load: load.aborted_requests_total > before.aborted_requests_total and load.running_requests == 0)
    assert after.aborted_requests_total == before.aborted_requests_total + 1


def test_load_tracking_counts_a_request_as_the_engine_reports_it(deployment: Deployment):
    # Nothing of an earlier test still in flight (an aborted stream is released a moment after its client left), and the
    # standby held out of new work as a drain would: the test is about e0's own report, and with both engines idle
    # the prefix estimates earlier tests left can make the standby the cheaper engine (it took it twice in CI).
    registry = deployment.live.gateway.registry
    eventually(lambda: [registry[e].in_flight for e in ("e0", "standby")], lambda counts: counts == [0, 0])
    registry["standby"].draining = True
    try:
        _check_load_tracking(deployment)
    finally:
        registry["standby"].draining = False


def _check_load_tracking(deployment: Deployment) -> None:
    before = deployment.load()
    raw = deployment.client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Name three rivers."}], max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert raw.headers["x-laps-engine"] == "e0"
    done = raw.parse()
    after = eventually(deployment.load, lambda load: load.requests_total == before.requests_total + 1)
    assert after.prompt_tokens_total - before.prompt_tokens_total == done.usage.prompt_tokens
    assert after.cached_tokens_total - before.cached_tokens_total == done.usage.prompt_tokens_details.cached_tokens
    assert after.generation_tokens_total - before.generation_tokens_total == 5
    assert (after.running_requests, after.waiting_requests, after.waiting_uncached_tokens) == (0, 0, 0)
    # The same chat again hits the engine's prefix cache (on its own: the test does not rely on earlier tests' prompts).
    again = deployment.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name three rivers."}], max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    after = eventually(deployment.load, lambda load: load.requests_total == before.requests_total + 2)
    assert 0 < after.cache_hit_rate <= 1 and after.max_total_tokens > 0
    assert after.max_total_tokens == KV_POOL_TOKENS


def test_h_equals_the_engines_cached_tokens_on_every_turn_after_a_flush_and_under_eviction(deployment: Deployment):
    """Multi-turn chats: the H the gateway routed by (``x-laps-cached-tokens-est``, from e0's KV events) is the
    engine's reported ``cached_tokens`` on every turn: follow-ups, after ``/flush_cache``, and after evictions."""
    gw = deployment.live.gateway
    eventually(lambda: gw.prefix_index.is_exact("e0"), bool)  # following e0's KV events
    eventually(lambda: [gw.registry[e].in_flight for e in ("e0", "standby")], lambda counts: counts == [0, 0])
    gw.registry["standby"].draining = True  # the test is about e0's events: every turn goes there
    try:
        _check_exact_hits(deployment)
    finally:
        gw.registry["standby"].draining = False


def _chat_turn(client: httpx.Client, history: list[dict]) -> tuple[int, int, int, str]:
    """(H the gateway routed by, cached tokens the engine reported, prompt tokens, reply) of one turn."""
    resp = client.post("/v1/chat/completions", json={"model": MODEL, "messages": history, "max_tokens": 16, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-laps-engine"] == "e0"
    body = resp.json()
    usage = body["usage"]
    return (int(resp.headers["x-laps-cached-tokens-est"]), usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"],
            body["choices"][0]["message"]["content"])


def _e0_metric(live: LiveGateway, name: str) -> float:
    text = httpx.get(live.url + "/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name and s.labels.get("engine") == "e0")


def _check_exact_hits(deployment: Deployment) -> None:
    gw = deployment.live.gateway
    conversations: list[list[dict]] = [[] for _ in range(4)]
    seen, last_prompt = [], {}
    with httpx.Client(base_url=deployment.live.url, timeout=120) as client:
        for turn in range(4):
            if turn == 2:  # empty the cache; once its AllBlocksCleared is in, the gateway knows it is empty
                assert httpx.post(deployment.engine_url + "/flush_cache", timeout=30).status_code == 200
                probe = BlockChain(gw.prefix_index.block_tokens).extend(gw.tokenizer.encode_chat(conversations[0]))
                eventually(lambda: gw.prefix_index.cached_tokens("e0", probe), lambda cached: cached == 0)  # the flush reached the gateway
            for c, history in enumerate(conversations):
                history.append({"role": "user", "content": f"Conversation {c}, question {turn}: " + f"tell me about the sea, part {c}. " * 25})
                h, cached, prompt_tokens, reply = _chat_turn(client, history)
                prompt = BlockChain(gw.prefix_index.block_tokens).extend(gw.tokenizer.encode_chat(history))
                # the turn's cache insertion reaching the gateway (a client's think time)
                eventually(lambda: gw.prefix_index.cached_tokens("e0", prompt), lambda cached: cached == prompt.tokens - 1)
                history.append({"role": "assistant", "content": reply})
                seen.append((c, turn, h, cached, last_prompt.get(c)))
                last_prompt[c] = prompt_tokens
    assert [(c, t, h) for c, t, h, _, _ in seen] == [(c, t, cached) for c, t, _, cached, _ in seen]
    after_flush = [cached for c, t, _, cached, _ in seen if t == 2]
    assert after_flush[0] == 0  # the first turn after the flush finds nothing
    evicted = [(c, t) for c, t, _, cached, before in seen if t in (1, 3) and cached < before - 1]
    assert evicted, seen  # some follow-ups found part of their own history evicted
    assert _e0_metric(deployment.live, "laps_kv_event_batches_total") > 0 and _e0_metric(deployment.live, "laps_kv_events_exact") == 1
    assert _e0_metric(deployment.live, "laps_kv_event_bad_frames_total") == 0


def test_role_switch_under_load_loses_no_request(deployment: Deployment):
    """e0 moves from short-prefill to long-prefill while two clients keep sending: a request running
    on e0 when the switch starts finishes there, the standby serves meanwhile, e0 serves again after."""
    client, gw = deployment.client, deployment.live.gateway
    served: list[str] = []  # engine of each answered request, in order
    errors: list[BaseException] = []
    sent = 0
    stop = threading.Event()
    lock = threading.Lock()

    def keep_sending() -> None:
        nonlocal sent
        while not stop.is_set():
            with lock:
                sent += 1
            try:
                raw = client.chat.completions.with_raw_response.create(
                    model=MODEL, messages=[{"role": "user", "content": "Say something."}], max_tokens=4, extra_body={"ignore_eos": True}
                )
                assert raw.parse().usage.completion_tokens == 4
                with lock:
                    served.append(raw.headers["x-laps-engine"])
            except BaseException as err:  # every failure is a lost request
                errors.append(err)
            time.sleep(0.2)

    long_request: dict = {}
    streaming = threading.Event()

    def long_stream() -> None:
        try:
            chunks = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Write an essay."}], max_tokens=200, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )
            with chunks:
                long_request["engine"] = chunks.response.headers["x-laps-engine"]
                streaming.set()
                long_request["chunks"] = list(chunks)
        except BaseException as err:
            errors.append(err)

    long_thread = threading.Thread(target=long_stream, daemon=True)
    long_thread.start()
    assert streaming.wait(60), errors
    senders = [threading.Thread(target=keep_sending, daemon=True) for _ in range(2)]
    for t in senders:
        t.start()
    try:
        deployment.live.run(switch_role(gw, "e0", "long-prefill", drain_timeout_s=120), timeout_s=360)
        with lock:
            switched_at = len(served)
        # Both engines now serve the long pool, and the standby holds the chats' shared system-prompt block in its
        # prefix cache (e0 restarted empty), so idle-time ties go to the standby: take it out of routing so that the
        # next requests show e0 serving again.
        gw.registry["standby"].draining = True
        eventually(lambda: served[switched_at:].count("e0"), lambda n: n >= 3, timeout_s=30)
    finally:
        stop.set()
        for t in (*senders, long_thread):
            t.join(60)

    assert errors == [] and len(served) == sent
    assert long_request["engine"] == "e0" and long_request["chunks"][-1].usage.completion_tokens == 200
    assert "standby" in served[:switched_at]
    assert gw.registry["e0"].pool == "long" and not gw.registry["e0"].draining
    info = httpx.get(f"{deployment.engine_url}/server_info", timeout=10).json()
    assert info["chunked_prefill_size"] == load_config().roles["long-prefill"].flags["chunked-prefill-size"]
