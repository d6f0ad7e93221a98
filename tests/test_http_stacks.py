"""The bench's relays relay (each server and each client at least once), and its CPU accounting counts worker processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp import web

from bench.http_stacks import relay_process, wait_answering
from bench.router_overhead import process_cpu_s
from tests.fake_engine import FakeEngine

# Each server and each client once, both loops.
STACKS = [("aiohttp-web", "aiohttp-gateway", "asyncio"), ("aiohttp-lowlevel", "aiohttp-tuned", "uvloop"),
          ("granian", "pyreqwest", "uvloop")]


@pytest.fixture
async def engine():
    fake = FakeEngine("e0")
    runner = web.AppRunner(fake.app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield fake, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    await runner.cleanup()


@pytest.mark.parametrize("server, client, loop", STACKS)
async def test_each_stack_relays_json_and_sse_and_reports_a_dead_engine(engine, server, client, loop, tmp_path):
    fake, url = engine
    dead = "http://127.0.0.1:9"  # discard port: nothing listens
    with relay_process(server, client, loop, [url, dead], tmp_path / "relay.log") as (relay_url, pid):
        await wait_answering(relay_url, 60)
        chat = relay_url + "/v1/chat/completions"
        async with aiohttp.ClientSession() as session:
            async def post(body: dict) -> tuple[int, bytes]:
                async with session.post(chat, data=orjson.dumps(body)) as resp:
                    return resp.status, await resp.read()

            # round robin: the live engine, then the dead one, twice over
            status, payload = await post({"rid": "r1", "messages": []})
            assert status == 200 and orjson.loads(payload)["choices"][0]["message"]["content"] == "hi from e0"
            status, payload = await post({"rid": "r2", "messages": []})
            assert status == 502 and orjson.loads(payload)["error"]["type"] == "engine_error"
            status, payload = await post({"rid": "r3", "messages": [], "stream": True})
            assert status == 200
            assert payload.startswith(b'data: {"id":"r3","choices":[{"index":0,"delta":{"content":"hi from e0"}')
            assert payload.endswith(b"data: [DONE]\n\n")
            status, payload = await post({"rid": "r4", "messages": [], "stream": True})
            assert status == 502
            async with session.post(chat, data=b"[1, 2]") as resp:
                assert resp.status == 400 and (await resp.json(content_type=None))["error"]["type"] == "invalid_request_error"
    assert [b["rid"] for b in fake.bodies] == ["r1", "r3"]


def test_process_cpu_counts_descendant_processes():
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\nprint('done', flush=True)\ntime.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys, time\n"
                               f"c = subprocess.Popen([sys.executable, '-c', {burn!r}], stdout=sys.stdout)\ntime.sleep(60)"],
                              stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert parent.stdout.readline() == b"done\n"  # the grandchild has burnt >= 0.3 s of CPU and idles
        own = Path(f"/proc/{parent.pid}/stat").read_text().rsplit(")", 1)[1].split()
        own_s = (int(own[11]) + int(own[12])) / os.sysconf("SC_CLK_TCK")
        assert process_cpu_s(parent.pid) - own_s >= 0.29
    finally:
        os.killpg(parent.pid, signal.SIGKILL)  # the grandchild too
        parent.wait()
