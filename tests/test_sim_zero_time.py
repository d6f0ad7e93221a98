"""--sim-zero-time: the simulated engine schedules as usual but its forward passes take no time."""

from __future__ import annotations

import asyncio

import pytest

from engines.sim import realtime
from engines.sim.args import SimServerArgs, parse_server_args, resolve_args
from laps.tokenizer import load_tokenizer


async def run_one_request(sim_args: SimServerArgs, monkeypatch: pytest.MonkeyPatch) -> tuple[list[float], int]:
    """Serve one 200-token prompt with 8 output tokens; the engine loop's sleep lengths and the tokens produced."""
    real_sleep = asyncio.sleep
    delays: list[float] = []

    async def recording_sleep(delay: float, *args):
        delays.append(delay)
        await real_sleep(0)

    monkeypatch.setattr(realtime.asyncio, "sleep", recording_sleep)
    engine = realtime.SimEngine(resolve_args(sim_args), load_tokenizer())
    await engine.start()
    track = engine.submit("r1", list(range(1000, 1200)), 8, True, [])
    tokens = 0
    while True:
        event = await asyncio.wait_for(track.queue.get(), 10)
        tokens += len(event.new_token_ids)
        if event.finished:
            break
    await engine.stop()
    return delays, tokens


async def test_zero_time_engine_never_waits_for_a_forward_pass(monkeypatch):
    args = parse_server_args(["--sim-zero-time"])
    assert args.sim_zero_time is True
    delays, tokens = await run_one_request(args, monkeypatch)
    assert tokens == 8
    assert len(delays) >= 8 and set(delays) == {0.0}  # a prefill pass and a decode pass per token, none timed


async def test_default_engine_waits_for_its_modelled_passes(monkeypatch):
    assert SimServerArgs().sim_zero_time is False
    delays, tokens = await run_one_request(SimServerArgs(), monkeypatch)
    assert tokens == 8
    assert sum(d > 0 for d in delays) >= 8
