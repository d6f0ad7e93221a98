"""The pressure controller on a live gateway with simulated engine processes: scripted signals lead to a real role switch."""

from __future__ import annotations

import time

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from engines.manager import free_port
from gateway.controller_loop import CONTROLLER
from laps.config import DEFAULT_CONFIG_PATH, parse_config
from policies.controller import Move
from tests.live_gateway import LiveGateway

KEY = "s3cret-admin-key"
# ψ = 4·(late share of first tokens): the scripted late first tokens alone set the pressures.
CONTROLLER_KEYS = dict(enabled=True, interval_s=3600, queue_weight=0.0, sla_weight=4.0, utilisation_weight=0.0,
                       hysteresis=0.5, cooldown_s=0.0, drain_timeout_s=5.0)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    data = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    data["gateway"].update(port=free_port(), admin_key=KEY)
    data["engines"].insert(1, {"name": "sp1", "kind": "sim", "role": "short-prefill", "gpus": [2]})
    data["controller"] = CONTROLLER_KEYS
    data["log_dir"] = str(tmp_path_factory.mktemp("controller") / "logs")
    with LiveGateway(parse_config(data)) as gateway:
        yield gateway


def engines(live) -> dict[str, dict]:
    resp = httpx.get(live.url + "/admin/engines", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    return {e["id"]: e for e in resp.json()["engines"]}


def controller_metrics(live) -> dict[tuple, float]:
    text = httpx.get(live.url + "/metrics", timeout=10).text
    return {(s.name, *sorted(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith(("laps_pool_", "laps_controller_moves_total"))}


async def late_first_tokens(live, engine_id: str, n: int) -> None:
    """Script ``n`` first tokens of ``engine_id`` that missed their deadline by a second."""
    dispatcher = live.gateway.dispatcher
    for _ in range(n):
        now = dispatcher.clock()
        dispatcher.first_tokens.record(engine_id, now, now - 1.0)


def test_signals_come_from_the_serving_engines(live):
    signals = live.run(live.app[CONTROLLER].signals())
    assert [(s.engine_id, s.pool, s.movable, s.gateway_queued_tokens, s.ttft_slo_violation_share) for s in signals] == [
        ("sp0", "short", True, 0.0, 0.0), ("sp1", "short", True, 0.0, 0.0), ("lp0", "long", True, 0.0, 0.0)]
    assert all(0.0 <= s.kv_token_usage < 0.01 and s.running_requests == 0 for s in signals)


def test_scripted_pressure_moves_an_engine_and_the_metrics_follow(live):
    loop = live.app[CONTROLLER]
    assert live.run(loop.step()) is None  # calm: nothing moves
    assert controller_metrics(live) == {
        ("laps_pool_engines", ("pool", "short")): 2.0, ("laps_pool_engines", ("pool", "long")): 1.0,
        ("laps_pool_pressure", ("pool", "short")): 0.0, ("laps_pool_pressure", ("pool", "long")): 0.0,
    }
    live.run(late_first_tokens(live, "lp0", 10))  # controller.min_first_tokens of them: a share of 1
    # Ψ_long = 4·1 = 4 > Ψ_short + τ = 0.5: the least loaded short engine (idle tie: smallest id) moves.
    assert live.run(loop.step()) == Move("sp0", "short", "long")
    assert engines(live)["sp0"]["state"] == "switching"
    manual = httpx.post(live.url + "/admin/engines/sp0/role", headers={"Authorization": f"Bearer {KEY}"},
                        json={"role": "mixed"}, timeout=10)
    assert manual.status_code == 409
    assert live.run(loop.step()) is None  # one move at a time (and sp0 sits out while switching)
    deadline = time.monotonic() + 60
    while engines(live)["sp0"]["state"] == "switching" and time.monotonic() < deadline:
        time.sleep(0.2)
    sp0 = engines(live)["sp0"]
    assert (sp0["role"], sp0["pool"], sp0["state"]) == ("long-prefill", "long", "healthy")
    assert loop.controller.moves == 1 and loop.controller.in_progress is None
    # The short pool is down to min_pool_size: no further move. Ψ_long = P90 of [sp0 0, lp0 4] = 0 + 0.9·4.
    assert live.run(loop.step()) is None
    metrics = controller_metrics(live)
    assert metrics[("laps_pool_engines", ("pool", "short"))] == 1.0 and metrics[("laps_pool_engines", ("pool", "long"))] == 2.0
    assert metrics[("laps_pool_pressure", ("pool", "long"))] == pytest.approx(3.6)
    assert metrics[("laps_controller_moves_total", ("from_pool", "short"), ("outcome", "ok"), ("to_pool", "long"))] == 1.0
