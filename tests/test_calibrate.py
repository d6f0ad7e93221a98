"""`laps calibrate` against the simulated engine: the fitted boundary matches the engine model's roofline crossover."""

import random

import pytest
import yaml
from aiohttp.test_utils import TestServer

from engines.client import EngineClient
from engines.sim.latency import make_latency_model
from engines.sim.server import SimServerArgs, create_app
from laps.calibrate import collect_samples, http_measure, write_fit
from laps.config import parse_config, load_config
from policies.cost_fit import fit_cost_model


def roofline_crossover(cached: int) -> int:
    """The smallest L whose single prefill the engine model calls compute-bound."""
    model = make_latency_model("qwen2.5-7b", "h200")
    return next(n for n in range(1, 20000) if model.breakdown([(n, cached)]).compute_bound)


async def test_calibration_recovers_the_sim_engines_boundary(tmp_path):
    server = TestServer(create_app(SimServerArgs(max_total_tokens=200_000)), handler_cancellation=True)
    await server.start_server()
    client = EngineClient()
    await client.start()
    try:
        url = str(server.make_url("")).rstrip("/")
        grid_l, grid_h = (16, 64, 128, 256, 512, 1024, 2048, 4096), (0, 4096)
        samples = await collect_samples(http_measure(client, url), grid_l, grid_h, repeats=3, rng=random.Random(0))
    finally:
        await client.close()
        await server.close()
    assert [(n, h) for n, h, _ in samples] == [(n, h) for h in grid_h for n in grid_l]
    fit = fit_cost_model(samples)
    # Wall-clock HTTP timings on a shared 2-core machine: the median of 3 and a loose bound.
    assert fit.model.boundary_tokens(0) == pytest.approx(roofline_crossover(0), rel=0.4)

    out = tmp_path / "cost.yaml"
    write_fit(fit, samples, url, out)
    block = yaml.safe_load(out.read_text())
    data = yaml.safe_load(load_config().model_dump_json())
    data["scheduling"]["cost_model"] = block["scheduling"]["cost_model"]
    assert parse_config(data).scheduling.cost_model.memory_floor_s == pytest.approx(fit.model.memory_floor_s)
