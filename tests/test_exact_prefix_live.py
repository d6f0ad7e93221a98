"""Exact prefix hits on a live gateway: simulated engine processes publish their KV cache events, the gateway follows them."""

from __future__ import annotations

import time

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from engines.manager import free_port
from laps.config import DEFAULT_CONFIG_PATH, parse_config
from tests.live_gateway import LiveGateway

MODEL = "Qwen2.5-7B-Instruct"
KV_POOL_TOKENS = 2500  # a few conversations fill it: the radix caches evict


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    data = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    data["gateway"]["port"] = free_port()
    data["scheduling"]["policy"] = "round_robin"  # conversations move between engines: hits of every size
    for role in data["roles"].values():
        role["flags"]["max-total-tokens"] = KV_POOL_TOKENS
    data["log_dir"] = str(tmp_path_factory.mktemp("exact-prefix") / "logs")
    with LiveGateway(parse_config(data)) as gateway:
        yield gateway


def chat(client: httpx.Client, history: list[dict]) -> tuple[int, int, int, str]:
    """(H the gateway used, cached tokens the engine reported, prompt tokens, reply) of one turn."""
    resp = client.post("/v1/chat/completions", json={"model": MODEL, "messages": history, "max_tokens": 24, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    usage = body["usage"]
    return (int(resp.headers["x-laps-cached-tokens-est"]), usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"],
            body["choices"][0]["message"]["content"])


def metric(live, name: str) -> dict[str, float]:
    text = httpx.get(live.url + "/metrics", timeout=10).text
    return {s.labels["engine"]: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name}


def test_h_equals_the_engines_cached_tokens_on_every_turn_under_eviction_and_after_a_flush(live):
    deadline = time.monotonic() + 30
    while not all(live.gateway.prefix_index.is_exact(e) for e in ("sp0", "lp0")):  # the followers join once the gateway is up
        assert time.monotonic() < deadline, "the gateway does not follow both engines' KV events"
        time.sleep(0.05)
    conversations = [[] for _ in range(4)]
    seen, shrunk = [], 0
    with httpx.Client(base_url=live.url, timeout=60) as client:
        for turn in range(4):
            if turn == 2:  # empty both caches between turns: the next hits are 0, and known to be
                for url in (e.url for e in live.gateway.registry):
                    assert httpx.post(url + "/flush_cache", timeout=10).status_code == 200
            for c, history in enumerate(conversations):
                history.append({"role": "user", "content": f"Conversation {c}, question {turn}: " + "tell me more about the sea " * 20})
                h, cached, prompt_tokens, reply = chat(client, history)
                history.append({"role": "assistant", "content": reply})
                seen.append((c, turn, h, cached))
                if turn and cached < prompt_tokens // 2:
                    shrunk += 1
    assert [(c, t, h) for c, t, h, _ in seen] == [(c, t, cached) for c, t, _, cached in seen]
    assert next(cached for c, t, _, cached in seen if t == 2) == 0  # the first request after the flush finds nothing
    assert shrunk > 0  # some follow-ups found their history evicted (or on the other engine)
    assert sum(metric(live, "laps_kv_event_batches_total").values()) > 0
    assert metric(live, "laps_kv_events_exact") == {"sp0": 1.0, "lp0": 1.0}
