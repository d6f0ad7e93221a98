"""Exact prefix hits on a live gateway: the engine publishes its KV cache events, the gateway follows them.

Engine ``e0`` of the parametrised kind (``sglang``: real SGLang 0.5.23 on CPU, random
weights on the tiny Qwen2 model of ``tests/conftest.py``; ``sim``: the simulated
engine on the same model directory) runs with ``--kv-events-config`` (the
command line laps builds) and a KV pool of ``KV_POOL_TOKENS``, so that a few
conversations fill its radix cache and it evicts. The simulated engine is
started by the gateway; real SGLang by the test (it may take minutes on a
loaded machine) and given to the gateway as an ``external`` engine with its
KV event endpoints. Multi-turn chats
then check that the H the gateway routed by (``x-laps-cached-tokens-est``) is
the engine's reported ``cached_tokens`` on every turn: follow-ups, after
``/flush_cache``, and after evictions.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engines.kv_events import loopback_publisher
from engines.manager import configured_ports, engine_command, engine_env, free_port, free_ports
from laps.config import load_config, parse_config
from policies.prefix_index import BlockChain
from tests import sglang_env
from tests.live_gateway import LiveGateway

MODEL = "tiny-qwen2.5"
KV_POOL_TOKENS = 3000  # four conversations of four turns overflow it: the radix cache evicts
SGLANG_START_S = 900  # ~80 s on an idle 2-core machine, several minutes under other jobs' load


@pytest.fixture(scope="module", params=[pytest.param("sglang", marks=pytest.mark.sglang), "sim"])
def live(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path):
    kind = request.param
    roles = {name: role.model_dump() for name, role in load_config().roles.items()}
    for role in roles.values():
        role["flags"]["max-total-tokens"] = KV_POOL_TOKENS
    logs = tmp_path_factory.mktemp(f"exact-prefix-{kind}") / "logs"
    data = {
        "model": {"name": MODEL, "path": str(tiny_model_dir)},
        "gateway": {"port": free_port()},
        "scheduling": {"short_threshold_tokens": 1_000_000},
        "roles": roles,
        "engines": [{"name": "e0", "kind": kind, "role": "short-prefill"}],
        "log_dir": str(logs),
    }
    if kind == "sim":
        with LiveGateway(parse_config(data)) as gateway:
            yield gateway
        return
    with real_sglang(data, request.getfixturevalue("sglang_python"), logs) as engine:
        data["engines"] = [engine]
        with LiveGateway(parse_config(data)) as gateway:
            yield gateway


@contextlib.contextmanager
def real_sglang(data: dict, python: Path, logs: Path) -> Iterator[dict]:
    """Real SGLang started with the command line laps would give it (``--kv-events-config`` included), outside the
    gateway so that a loaded machine may take its time (up to ``SGLANG_START_S``); yields it as an ``external`` engine
    with its KV event endpoints."""
    data = {**data, "sglang": {"python": str(python), "extra_args": [*sglang_env.CPU_SERVER_ARGS, "--max-total-tokens", str(KV_POOL_TOKENS)],
                               "env": {"PYTHONPATH": str(sglang_env.CPU_SHIMS_DIR)}}}
    config = parse_config(data)
    port, pub, replay = free_ports(3, configured_ports(config))
    kv_events = loopback_publisher(pub, replay)
    command = engine_command(config, config.engines[0], port, kv_events=kv_events)
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / "engine-e0.log", "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **engine_env(config, config.engines[0])},
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SGLANG_START_S
        while True:
            assert proc.poll() is None, (logs / "engine-e0.log").read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, f"SGLang not ready in {SGLANG_START_S} s"
            time.sleep(0.5)
        yield {"name": "e0", "kind": "external", "role": "short-prefill", "url": url,
               "kv_events_endpoint": kv_events.endpoint, "kv_events_replay_endpoint": kv_events.replay_endpoint}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def eventually(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} not within {timeout_s:.0f} s"
        time.sleep(0.05)


def chat(client: httpx.Client, history: list[dict]) -> tuple[int, int, int, str]:
    """(H the gateway routed by, cached tokens the engine reported, prompt tokens, reply) of one turn."""
    resp = client.post("/v1/chat/completions", json={"model": MODEL, "messages": history, "max_tokens": 16, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    usage = body["usage"]
    return (int(resp.headers["x-laps-cached-tokens-est"]), usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"],
            body["choices"][0]["message"]["content"])


def metric(live: LiveGateway, name: str) -> float:
    text = httpx.get(live.url + "/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name and s.labels.get("engine") == "e0")


def test_h_equals_the_engines_cached_tokens_on_every_turn_after_a_flush_and_under_eviction(live):
    gw = live.gateway
    eventually(lambda: gw.prefix_index.is_exact("e0"), "following e0's KV events")
    conversations: list[list[dict]] = [[] for _ in range(4)]
    seen, last_prompt = [], {}
    with httpx.Client(base_url=live.url, timeout=120) as client:
        for turn in range(4):
            if turn == 2:  # empty the cache; once its AllBlocksCleared is in, the gateway knows it is empty
                assert httpx.post(gw.registry["e0"].url + "/flush_cache", timeout=30).status_code == 200
                probe = BlockChain(gw.prefix_index.block_tokens).extend(gw.tokenizer.encode_chat(conversations[0]))
                eventually(lambda: gw.prefix_index.cached_tokens("e0", probe) == 0, "the flush reaching the gateway")
            for c, history in enumerate(conversations):
                history.append({"role": "user", "content": f"Conversation {c}, question {turn}: " + f"tell me about the sea, part {c}. " * 25})
                h, cached, prompt_tokens, reply = chat(client, history)
                prompt = BlockChain(gw.prefix_index.block_tokens).extend(gw.tokenizer.encode_chat(history))
                eventually(lambda: gw.prefix_index.cached_tokens("e0", prompt) == prompt.tokens - 1,
                           "the turn's cache insertion reaching the gateway (a client's think time)")
                history.append({"role": "assistant", "content": reply})
                seen.append((c, turn, h, cached, last_prompt.get(c)))
                last_prompt[c] = prompt_tokens
    assert [(c, t, h) for c, t, h, _, _ in seen] == [(c, t, cached) for c, t, _, cached, _ in seen]
    after_flush = [cached for c, t, _, cached, _ in seen if t == 2]
    assert after_flush[0] == 0  # the first turn after the flush finds nothing
    evicted = [(c, t) for c, t, _, cached, before in seen if t in (1, 3) and cached < before - 1]
    assert evicted, seen  # some follow-ups found part of their own history evicted
    assert metric(live, "laps_kv_event_batches_total") > 0 and metric(live, "laps_kv_events_exact") == 1
    assert metric(live, "laps_kv_event_bad_frames_total") == 0
