"""``POST /pd_role_switch`` on the simulated engine: SGLang 0.5.23's body, answers and refusals, and a flipped engine at work."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace

import aiohttp
from aiohttp.test_utils import TestServer

from engines.manager import free_port
from engines.sim.latency import GPUS
from engines.sim.realtime import ENGINE
from engines.sim.server import create_app
from tests.test_sim_pd import MODEL, body, sim_args


@contextlib.asynccontextmanager
async def engines(*args_list):
    servers = [TestServer(create_app(a), handler_cancellation=True) for a in args_list]
    for s in servers:
        await s.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            yield session, servers
    finally:
        for s in servers:
            await s.close()


def flip_capable(mode: str, bootstrap_port: int = 8998, **extra):
    return replace(sim_args(mode, bootstrap_port), enable_pd_role_switch=True, **extra)


async def switch(session: aiohttp.ClientSession, server: TestServer, **payload) -> tuple[int, dict]:
    async with session.post(str(server.make_url("/pd_role_switch")), json=payload) as resp:
        return resp.status, await resp.json()


def answer(success: bool, message: str, old: str, new: str, safe: bool) -> dict:
    return {"rid": None, "http_worker_ipc": None, "success": success, "message": message, "old_role": old, "new_role": new,
            "safe_to_restore": safe}


async def test_refusals_before_the_idle_check_are_sglangs():
    null_with_flag = replace(sim_args("null"), enable_pd_role_switch=True)
    nixl = flip_capable("prefill", free_port(), disaggregation_transfer_backend="nixl")
    async with engines(sim_args("prefill", free_port()), flip_capable("prefill", free_port()), null_with_flag, nixl) as (session, s):
        plain, capable, null, nixl_engine = s
        assert await switch(session, plain, new_role="decode") == (
            400, answer(False, "--enable-pd-role-switch is not set on this server", "prefill", "decode", True))
        assert await switch(session, capable) == (400, answer(False, "invalid new_role=''", "prefill", "", True))
        assert await switch(session, null, new_role="decode") == (
            400, answer(False, "instance is not running in PD disaggregation mode", "null", "decode", True))
        assert await switch(session, nixl_engine, new_role="decode") == (
            400, answer(False, "transfer backend 'nixl' does not support runtime role switch", "prefill", "decode", True))
        status, detail = await switch(session, capable, new_role="both")
        assert status == 422 and detail["detail"][0]["loc"] == ["body", "new_role"]
        status, detail = await switch(session, capable, new_role="decode", decode_cuda_graph_memory_gb="2")
        assert status == 422 and detail["detail"][0]["loc"] == ["body", "decode_cuda_graph_memory_gb"]


async def test_a_first_flip_to_decode_needs_the_decode_graph_memory_and_then_flushes_the_cache():
    async with engines(flip_capable("prefill", free_port())) as (session, (prefill,)):
        engine = prefill.app[ENGINE]
        request = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the harbour. " * 40}], "max_tokens": 1}
        async with session.post(str(prefill.make_url("/v1/chat/completions")), json=request) as resp:
            assert resp.status == 200
        assert engine.core.tree.total_size > 0
        assert await switch(session, prefill, new_role="decode") == (
            400, answer(False, "decode_cuda_graph_memory_gb is required before capturing decode graphs", "prefill", "decode", True))
        assert await switch(session, prefill, new_role="decode", decode_cuda_graph_memory_gb=-1) == (
            400, answer(False, "decode_cuda_graph_memory_gb must be non-negative", "prefill", "decode", True))
        free_gb = GPUS["h200"].memory_bytes * (1 - engine.sim.mem_fraction_static) / 2**30
        assert await switch(session, prefill, new_role="decode", decode_cuda_graph_memory_gb=500) == (
            400, answer(False, f"insufficient decode CUDA graph headroom: required=500.000 GB, available={free_gb:.3f} GB",
                        "prefill", "decode", True))
        assert await switch(session, prefill, new_role="decode", decode_cuda_graph_memory_gb=2, prepare_only=True) == (
            200, answer(True, "ready", "prefill", "decode", True))
        assert engine.core.config.disaggregation_mode == "prefill" and engine.core.tree.total_size > 0  # prepare changes nothing
        assert await switch(session, prefill, new_role="decode", decode_cuda_graph_memory_gb=2) == (
            200, answer(True, "ok", "prefill", "decode", False))
        assert engine.core.tree.total_size == 0 and engine.pd.mode == "decode"
        async with session.get(str(prefill.make_url("/model_info"))) as resp:
            assert (await resp.json())["disaggregation_mode"] == "decode"
        async with session.get(str(prefill.make_url("/v1/loads?include=disagg"))) as resp:
            assert (await resp.json())["loads"][0]["disaggregation"]["mode"] == "decode"
        async with session.post(str(prefill.make_url("/v1/chat/completions")), json=request) as resp:
            assert resp.status == 400  # a decode engine takes requests only with their KV
        assert await switch(session, prefill, new_role="decode") == (200, answer(True, "already in target role", "decode", "decode", False))
        assert await switch(session, prefill, new_role="prefill") == (200, answer(True, "ok", "decode", "prefill", False))
        # The decode graphs were captured on the first flip: a second flip to decode needs no memory figure.
        assert await switch(session, prefill, new_role="decode") == (200, answer(True, "ok", "prefill", "decode", False))


async def test_a_busy_engine_is_refused_but_the_same_role_is_not():
    # Forward passes 400× as slow: the request's prefill takes ~2 s, so the engine is still busy when the switch
    # arrives however loaded the machine (at full speed it ends in milliseconds, and the switch could find it idle).
    async with engines(flip_capable("prefill", free_port(), sim_fault="slow:400")) as (session, (prefill,)):
        running = asyncio.ensure_future(session.post(str(prefill.make_url("/generate")),
                                                     json={"text": "Hi", "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}))
        while prefill.app[ENGINE].core.fully_idle():
            await asyncio.sleep(0.001)
        assert await switch(session, prefill, new_role="decode", decode_cuda_graph_memory_gb=1) == (
            400, answer(False, "instance is not idle; drain all requests before switching", "prefill", "decode", True))
        assert await switch(session, prefill, new_role="prefill") == (200, answer(True, "already in target role", "prefill", "prefill", False))
        (await running).close()


async def test_an_engine_launched_as_decode_flips_to_prefill_and_serves_a_pd_hand_off():
    """With the flag a decode engine runs its bootstrap server too, so once flipped it hands KV to a decode engine."""
    port = free_port()
    async with engines(flip_capable("decode", port), sim_args("decode")) as (session, (flipped, decode)):
        assert await switch(session, flipped, new_role="prefill") == (200, answer(True, "ok", "decode", "prefill", False))
        request = body(11, port)
        prefill_resp, decode_resp = await asyncio.gather(
            session.post(str(flipped.make_url("/v1/chat/completions")), json=request),
            session.post(str(decode.make_url("/v1/chat/completions")), json=request))
        prefilled, decoded = await prefill_resp.json(), await decode_resp.json()
        assert prefill_resp.status == decode_resp.status == 200
        assert prefilled["usage"]["completion_tokens"] == 1 and decoded["usage"]["completion_tokens"] == 8
