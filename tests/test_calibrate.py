"""`laps calibrate` against the simulated engine: the fitted boundary matches the engine model's roofline crossover."""

import random

import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestServer

from engines.client import EngineClient
from engines.sim.latency import make_latency_model
from engines.sim.server import SimServerArgs, create_app
from laps.calibrate import CalibrationError, collect_samples, http_measure, write_fit
from laps.config import parse_config, load_config
from policies.cost_fit import fit_cost_model

MODEL = make_latency_model("qwen2.5-7b", "h200")
GRID_L, GRID_H = (16, 64, 128, 256, 512, 1024, 2048, 4096), (0, 4096)


def roofline_crossover(cached: int) -> int:
    """The smallest L whose single prefill the engine model calls compute-bound."""
    return next(n for n in range(1, 20000) if MODEL.breakdown([(n, cached)]).compute_bound)


def model_measure():
    """A :data:`~laps.calibrate.Measure` that answers the engine model's extend time for the prompt, its cached
    part being the longest prefix shared with an earlier prompt (as the simulated engine's radix cache has it)."""
    seen: list[list[int]] = []

    async def measure(input_ids: list[int]) -> float:
        cached = max((next((i for i, (a, b) in enumerate(zip(p, input_ids)) if a != b), min(len(p), len(input_ids))) for p in seen), default=0)
        seen.append(input_ids)
        return MODEL.prefill_s([(len(input_ids) - cached, cached)])

    return measure


async def test_the_fit_of_the_engine_models_own_timings_recovers_its_boundary():
    samples = await collect_samples(model_measure(), GRID_L, GRID_H, repeats=1, rng=random.Random(0))
    fit = fit_cost_model(samples)
    assert fit.rms_relative_error < 1e-9  # the fitted form is the engine model's on this grid
    # 208 vs the roofline's 193: the fit's boundary is where its two regimes' costs cross, the roofline's where
    # the compute time first exceeds the memory time of the same pass.
    assert fit.model.boundary_tokens(0) == pytest.approx(207.627, abs=1e-3)
    assert fit.model.boundary_tokens(0) == pytest.approx(roofline_crossover(0), rel=0.1)
    assert fit.model.boundary_tokens(4096) == pytest.approx(roofline_crossover(4096), rel=0.1)


async def test_calibration_over_http_times_every_grid_point_and_writes_a_config_block(tmp_path):
    server = TestServer(create_app(SimServerArgs(max_total_tokens=200_000)), handler_cancellation=True)
    await server.start_server()
    client = EngineClient()
    await client.start()
    try:
        url = str(server.make_url("")).rstrip("/")
        samples = await collect_samples(http_measure(client, url), GRID_L, GRID_H, repeats=1, rng=random.Random(0))
    finally:
        await client.close()
        await server.close()
    assert [(n, h) for n, h, _ in samples] == [(n, h) for h in GRID_H for n in GRID_L]
    # Wall-clock: the simulated engine sleeps the modelled pass, so no timing is below it (HTTP adds the rest).
    assert all(seconds >= MODEL.prefill_s([(n, h)]) for n, h, seconds in samples)

    fit = fit_cost_model(samples)
    out = tmp_path / "cost.yaml"
    write_fit(fit, samples, url, out)
    block = yaml.safe_load(out.read_text())
    data = yaml.safe_load(load_config().model_dump_json())
    data["scheduling"]["cost_model"] = block["scheduling"]["cost_model"]
    assert parse_config(data).scheduling.cost_model.memory_floor_s == pytest.approx(fit.model.memory_floor_s)


async def test_calibrating_against_an_openai_server_says_to_pass_an_engine_url():
    async def not_found(request: web.Request) -> web.Response:  # as the laps gateway answers an unknown path
        return web.json_response({"error": {"message": "not found", "type": "invalid_request_error", "param": None,
                                            "code": "not_found"}}, status=404)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", not_found)
    server = TestServer(app)
    await server.start_server()
    client = EngineClient()
    await client.start()
    try:
        with pytest.raises(CalibrationError, match="answered HTTP 404.*not an SGLang engine: pass an engine's URL"):
            await http_measure(client, str(server.make_url("")).rstrip("/"))([1, 2, 3])
    finally:
        await client.close()
        await server.close()
