"""The whole path on loopback: `laps serve` starts real simulated-engine processes; the official openai client drives it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
import yaml

from engines.manager import free_port
from laps.config import DEFAULT_CONFIG_PATH

MODEL = "Qwen2.5-7B-Instruct"


ADMIN_KEY = "end-to-end-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}  # /health lists the engines with it


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """The default config on a free gateway port, served by a `laps serve` child process."""
    tmp = tmp_path_factory.mktemp("deploy")
    data = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    data["gateway"]["port"] = free_port()
    data["gateway"]["admin_key"] = ADMIN_KEY
    data["log_dir"] = str(tmp / "logs")
    config_path = tmp / "config.yaml"
    config_path.write_text(yaml.safe_dump(data))
    proc = subprocess.Popen([sys.executable, "-m", "laps.cli", "serve", "--config", str(config_path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{data['gateway']['port']}"
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, proc.stderr.read().decode()
        try:
            health = httpx.get(f"{url}/health", timeout=1, headers=ADMIN)
            if health.status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "gateway not healthy in 90 s"
        time.sleep(0.2)
    engines = {e["id"]: e["url"] for e in health.json()["engines"]}
    yield url, engines, proc
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0
    for engine_url in engines.values():  # the engines went down with the gateway
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{engine_url}/ready", timeout=1)


@pytest.fixture
def client(deployment):
    return openai.OpenAI(base_url=deployment[0] + "/v1", api_key="none", max_retries=0)


def test_chat_non_streaming_with_usage(client):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=8, extra_body={"ignore_eos": True}
    )
    completion = raw.parse()
    assert raw.headers["x-laps-class"] == "short"
    assert completion.usage.completion_tokens == 8
    assert completion.choices[0].finish_reason == "length"
    assert completion.choices[0].message.content
    # 21 system-turn tokens + <|im_start|>user\n + 7 text tokens + <|im_end|>\n + <|im_start|>assistant\n
    assert completion.usage.prompt_tokens == 21 + 3 + 7 + 2 + 3


def test_chat_streaming_multi_turn(client):
    history = [{"role": "user", "content": "Tell me a joke about pens."}]
    first = client.chat.completions.create(model=MODEL, messages=history, max_tokens=16)
    history += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "Another one?"}]
    stream = client.chat.completions.create(model=MODEL, messages=history, max_tokens=12, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # turn 1's prompt is a prefix of turn 2's


def test_completions_streaming_and_not(client):
    done = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=5, extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 5 and done.choices[0].text
    pieces = [c.choices[0].text for c in client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, stream=True, extra_body={"ignore_eos": True}) if c.choices]
    assert "".join(pieces)


def test_long_prompt_is_served_by_long_pool(client):
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=[{"role": "user", "content": " word" * 2000}], max_tokens=2)
    assert (raw.headers["x-laps-class"], raw.headers["x-laps-engine"]) == ("long", "lp0")


def test_bad_requests_get_openai_errors(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=-1)
    assert info.value.body["param"] == "max_tokens"


def aborted_total(engine_url: str) -> float:
    for line in httpx.get(f"{engine_url}/metrics").text.splitlines():
        if line.startswith("sglang:num_aborted_requests_total"):
            return float(line.split()[-1])
    raise AssertionError("sglang:num_aborted_requests_total not exported")


def test_client_disconnect_mid_stream_aborts_on_the_engine(deployment):
    url, engines, _ = deployment
    before = aborted_total(engines["sp0"])
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=10) as resp:
        assert resp.headers["x-laps-engine"] == "sp0"
        next(resp.iter_lines())
    deadline = time.monotonic() + 10
    while aborted_total(engines["sp0"]) == before:
        assert time.monotonic() < deadline, "the engine never saw the abort"
        time.sleep(0.05)
    assert aborted_total(engines["sp0"]) == before + 1


def test_a_killed_engine_is_restarted_and_serves_again(deployment, client):
    url, engines, _ = deployment
    port = engines["lp0"].rsplit(":", 1)[1]
    pids = subprocess.run(["pgrep", "-f", f"engines.sim .*--port {port}"], capture_output=True, text=True).stdout.split()
    assert len(pids) == 1
    os.kill(int(pids[0]), signal.SIGKILL)
    deadline = time.monotonic() + 30
    states = []
    while time.monotonic() < deadline:
        lp0 = next(e for e in httpx.get(f"{url}/health", timeout=2, headers=ADMIN).json()["engines"] if e["id"] == "lp0")
        states.append(lp0["healthy"])
        if states[-1] and False in states:
            break
        time.sleep(0.2)
    assert False in states and states[-1], "lp0 was not seen down and then back"
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=[{"role": "user", "content": " word" * 2000}], max_tokens=2)
    assert raw.headers["x-laps-engine"] == "lp0"
