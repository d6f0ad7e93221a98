"""Short versions of bench/faults.py: every request ends with its answer or an explicit error, none twice.

The flag faults run against in-process simulated engines (``--sim-fault``, no signals); kill -9 and the
gateway's SIGTERM run ``bench.faults.run_fault`` itself with a small load (engine and gateway processes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from bench import faults
from engines.sim.args import SimServerArgs, parse_server_args
from engines.sim.faults import Fault, parse_fault
from engines.sim.server import create_app as create_sim_app
from gateway.app import create_app
from gateway.state import GATEWAY
from laps.config import load_config
from tests.test_gateway import with_gateway

REQUESTS = 16


@contextlib.asynccontextmanager
async def faulty_gateway(fault: str | None, policy: str = "least_load") -> AsyncIterator[tuple[str, web.Application]]:
    """A gateway (``policy``; stall timeout 1 s, first-byte timeout 5 s) over simulated engines sp0, which runs with
    ``--sim-fault fault``, and lp0; its URL and app. Everything is closed after."""
    sims = {"sp0": SimServerArgs(sim_fault=fault, enable_cache_report=True), "lp0": SimServerArgs(enable_cache_report=True)}
    servers = {name: TestServer(create_sim_app(args), handler_cancellation=True) for name, args in sims.items()}
    for s in servers.values():
        await s.start_server()
    config = with_gateway(load_config(), stall_timeout_s=1.0, first_byte_timeout_s=5.0)
    config = config.model_copy(update={"scheduling": config.scheduling.model_copy(update={"policy": policy})})
    app = create_app(config, engine_urls={n: str(s.make_url("")).rstrip("/") for n, s in servers.items()})
    gateway = TestServer(app, handler_cancellation=True)
    await gateway.start_server()
    try:
        yield str(gateway.make_url("")).rstrip("/"), app
    finally:
        await gateway.close()
        for s in servers.values():
            await s.close()


async def run_load(fault: str | None, requests: int = REQUESTS, max_tokens: int = 24, settle_s: float = 0.0) -> tuple[faults.Tally, list[str]]:
    """``requests`` chats (every fourth not streamed) through a :func:`faulty_gateway`, then, ``settle_s`` seconds
    later, one more not streamed; the tally of the first and the outcome of the last."""
    tally = faults.Tally()
    async with faulty_gateway(fault) as (url, _), aiohttp.ClientSession() as session:
        outcomes = await asyncio.gather(*(faults.one_request(session, url, i, i % 4 != 3, max_tokens, timeout_s=30) for i in range(requests)))
        for outcome, code in outcomes:
            tally.sent += 1
            tally.add(outcome, code)
        await asyncio.sleep(settle_s)
        served = await faults.one_request(session, url, -1, False, 4, timeout_s=30)
    return tally, served


@pytest.mark.parametrize("fault, codes", [
    (None, set()),
    ("error-mid-stream:2", {"500", "engine_failed"}),  # the engine's own error event; a 500 answer named as the engine's failure
    ("malformed:2", {"engine_unavailable"}),
    ("truncated:2", {"engine_unavailable"}),
    ("hang:2", {"engine_timeout"}),
    ("slow:3", set()),
])
async def test_a_faulty_engine_never_leaves_a_request_hung_silent_or_answered_twice(fault, codes):
    # the last request comes after the health monitor's rounds (1 s apart) have probed a stalled sp0 at least once:
    # a stuck engine must not be brought back by its probe (a 1-token generation its scheduler cannot run either)
    tally, served = await run_load(fault, settle_s=2.5 if fault and fault.startswith("hang") else 0.0)
    assert tally.sent == REQUESTS and tally.hung == tally.silent == tally.duplicated == 0
    assert tally.ok + tally.errors == REQUESTS
    assert set(tally.error_codes) <= codes
    if fault is None or fault.startswith("slow"):
        assert tally.ok == REQUESTS
    else:
        assert tally.errors > 0  # some requests were on sp0 mid-stream when it failed
    assert served[0] in ("ok", "errors")  # the gateway still answers


async def test_an_engine_that_stalls_every_stream_after_its_first_events_leaves_service_under_steady_traffic():
    # hang:2 under round_robin: each new stream on sp0 brings two events (so sp0 never looks silent) and then nothing.
    # The streams' stall timeouts (1 s) have sp0 probed; the probe fails (its scheduler is stuck), so sp0 leaves
    # service while requests keep coming, and later requests go to lp0 only.
    async def later(i: int) -> tuple[str, str | None]:
        await asyncio.sleep(0.1 * i)
        return await faults.one_request(session, url, i, True, 64, timeout_s=30)

    async with faulty_gateway("hang:2", policy="round_robin") as (url, app), aiohttp.ClientSession() as session:
        outcomes = await asyncio.gather(*(later(i) for i in range(60)))  # one every 0.1 s for 6 s
        assert all(outcome in ("ok", "errors") for outcome, _ in outcomes)  # none hung or silent
        assert app[GATEWAY].registry["sp0"].stalled
        assert outcomes[-10:] == [("ok", None)] * 10  # the last second's streams: all on lp0


@pytest.mark.parametrize("spec, expected", [
    ("hang", Fault("hang", 2)), ("slow", Fault("slow", 10)), ("malformed:0", Fault("malformed", 0)), ("slow:3", Fault("slow", 3)),
])
def test_fault_specs_parse(spec, expected):
    assert parse_fault(spec) == expected and parse_server_args(["--sim-fault", spec]).sim_fault == spec


@pytest.mark.parametrize("spec, fragment", [("explode", "unknown kind"), ("hang:x", "whole number"), ("slow:0", "at least 1")])
def test_bad_fault_specs_are_refused(spec, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_fault(spec)


def small(**overrides) -> argparse.Namespace:
    args = faults.build_parser().parse_args(["--out", "unused.json"])
    for key, value in {"requests": 12, "concurrency": 6, "max_tokens": 128, "long_tokens": 2000, "hang_s": 30.0, **overrides}.items():
        setattr(args, key, value)
    return args


@pytest.mark.parametrize("fault", ["kill9", "sigterm"])
def test_engine_kill_and_gateway_sigterm_end_every_request_explicitly(fault):
    result = asyncio.run(faults.run_fault(fault, small()))
    assert result["sent"] == 12 and result["hung"] == result["silent"] == result["duplicated"] == 0
    assert result["ok"] + result["errors"] == 12 and faults.passed(result)
    if fault == "sigterm":  # long streams, 1 s of grace: each ends with the shutdown's error event and [DONE]
        assert result["error_codes"] == {"shutting_down": 12} and result["gateway_exit_code"] == 0


def test_classify_tells_explicit_errors_from_silence_and_duplicates():
    first = b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n'
    end = b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}\n\n'
    error = b'data: {"error": {"message": "m", "type": "engine_error", "param": null, "code": "engine_timeout"}}\n\n'
    assert faults.classify_stream(200, first + end + b"data: [DONE]\n\n") == ("ok", None)
    assert faults.classify_stream(200, first + error + b"data: [DONE]\n\n") == ("errors", "engine_timeout")
    assert faults.classify_stream(200, first) == ("silent", None)
    assert faults.classify_stream(200, first + first + end + b"data: [DONE]\n\n") == ("duplicated", None)
    assert faults.classify_json(503, b'{"error": {"message": "m", "code": "shutting_down"}}') == ("errors", "shutting_down")
    assert faults.classify_json(200, b'{"choices": [{}, {}]}') == ("duplicated", None)
    assert dataclasses.asdict(faults.Tally())["hung"] == 0


def test_a_second_signal_stops_the_gateway_at_once(tmp_path):
    async def scenario() -> tuple[int, list[str]]:
        port = faults.free_port()
        gateway = faults.Gateway(faults.deployment(tmp_path, port, "none", small(grace_s=600.0)), port)
        await gateway.start()
        engines = [gateway.engine_pid(name) for name in ("sp0", "lp0")]
        async with aiohttp.ClientSession() as session:
            stream = asyncio.ensure_future(faults.one_request(session, gateway.url, 0, True, 30_000, timeout_s=60))
            await asyncio.sleep(1.0)
            gateway.process.send_signal(faults.signal.SIGTERM)  # the grace period (600 s) starts
            await asyncio.sleep(0.5)
            assert gateway.process.returncode is None
            gateway.process.send_signal(faults.signal.SIGINT)  # Ctrl-C again: out now
            code = await asyncio.wait_for(gateway.process.wait(), timeout=10)
            await stream
        await asyncio.sleep(1.0)  # the engines get their parent-death signal
        alive = [str(pid) for pid in engines if faults.os.path.exists(f"/proc/{pid}") and "zombie" not in open(f"/proc/{pid}/status").read()]
        return code, alive

    code, alive = asyncio.run(scenario())
    assert code == 130 and alive == []
