"""The PD controller on a live gateway with simulated engines: decode engines in the signals, a move across sides flipped in place."""

from __future__ import annotations

import time

import httpx
import pytest

from engines.manager import free_port
from gateway.controller_loop import CONTROLLER
from laps.config import parse_config
from policies.controller import Move
from policies.pd_controller import PDPressureController
from tests.live_gateway import LiveGateway
from tests.pd_stack import free_bootstrap_base
from tests.test_controller_loop import KEY, controller_metrics, engines, late_first_tokens
from tests.test_pd_role_switch import flip_data

# ψ = 4·(late share of first tokens), φ = 4·(late share) + decode load: the scripted late first tokens set the pressures.
CONTROLLER_KEYS = dict(enabled=True, short_role="prefill-short", long_role="prefill-long", decode_role="decode", interval_s=3600,
                       queue_weight=0.0, sla_weight=4.0, utilisation_weight=0.0, hysteresis=0.5, cooldown_s=0.0, drain_timeout_s=5.0)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    data = flip_data(controller=CONTROLLER_KEYS, log_dir=str(tmp_path_factory.mktemp("pd-controller") / "logs"))
    data["pd"]["bootstrap_port"] = free_bootstrap_base()
    data["gateway"].update(port=free_port(), admin_key=KEY)
    with LiveGateway(parse_config(data)) as gateway:
        yield gateway


def test_the_decode_engines_are_in_the_signals_with_their_capacity(live):
    loop = live.app[CONTROLLER]
    assert isinstance(loop.controller, PDPressureController)
    signals = live.run(loop.signals())
    assert [(s.engine_id, s.pool, s.movable, s.max_running_requests, s.waiting_requests) for s in signals] == [
        ("ps0", "short", True, None, 0), ("pl0", "long", True, None, 0), ("d0", "decode", True, 256, 0), ("d1", "decode", True, 256, 0)]


def test_a_busy_prefill_side_gets_a_decode_engine_flipped_in_place(live):
    loop = live.app[CONTROLLER]
    d0 = live.gateway.registry["d0"]
    started = httpx.get(f"{d0.url}/server_info", timeout=10).json()["startup_time"]
    assert live.run(loop.step()) is None  # calm: nothing moves
    live.run(late_first_tokens(live, "pl0", 3))
    # Ψ_P = P90 of [ps0 0, pl0 4] = 3.6 against Ψ_D 0: the decode pool's least loaded engine (idle tie: d0) goes to
    # the long pool, the busier prefill pool; prefill-long and decode share flags, so it flips.
    assert live.run(loop.step()) == Move("d0", "decode", "long")
    deadline = time.monotonic() + 60
    while engines(live)["d0"]["state"] == "switching" and time.monotonic() < deadline:
        time.sleep(0.1)
    row = engines(live)["d0"]
    assert (row["role"], row["pool"], row["state"]) == ("prefill-long", "long", "healthy")
    info = httpx.get(f"{d0.url}/server_info", timeout=10).json()
    assert (info["disaggregation_mode"], info["startup_time"]) == ("prefill", started)  # the same process
    # The decode pool is down to min_pool_size: no further move.
    assert live.run(loop.step()) is None
    metrics = controller_metrics(live)
    assert (metrics[("laps_pool_engines", ("pool", "decode"))], metrics[("laps_pool_engines", ("pool", "long"))]) == (1.0, 2.0)
    assert metrics[("laps_controller_moves_total", ("from_pool", "decode"), ("outcome", "ok"), ("to_pool", "long"))] == 1.0
