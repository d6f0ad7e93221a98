"""Engine kinds: command lines and environments per kind, external engines served without a process,
and every shipped role's command line accepted by SGLang 0.5.23's own parser."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import httpx
import pytest
import yaml
from aiohttp.test_utils import TestServer

from engines.client import EngineClient
from engines.kv_events import KVEventSource
from engines.manager import (FREE_PORT_RANGE, SGLANG_PLUGIN_DIR, EngineManager, EngineProcess, _ephemeral_ports, engine_command,
                             engine_env, flag_args, free_port, kv_event_sources, port_free, port_listeners,
                             server_args, sim_model)
from gateway.app import create_app
from gateway.state import GATEWAY
from laps.config import DEFAULT_CONFIG_PATH, Config, EngineConfig, load_config, parse_config
from laps.tokenizer import load_tokenizer
from loadgen.virtual import engine_cores
from tests import sglang_env
from tests.fake_engine import FakeEngine

MODEL = "Qwen2.5-7B-Instruct"
EXAMPLE_H200X8 = DEFAULT_CONFIG_PATH.parent / "examples" / "h200x8.yaml"


def shipped_data() -> dict:
    return yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())


def config_with(engines: list[dict], **top) -> Config:
    data = shipped_data()
    data.update(engines=engines, **top)
    return parse_config(data)


def test_sglang_command_line_has_gpus_role_flags_and_extra_args():
    config = config_with(
        [{"name": "sp0", "kind": "sglang", "role": "short-prefill", "gpus": [2, 3]}],
        sglang={"python": "/opt/sgl/bin/python", "extra_args": ["--log-level", "warning"], "env": {"SGLANG_X": "1", "CUDA_VISIBLE_DEVICES": "7"}},
    )
    engine = config.engines[0]
    command = engine_command(config, engine, 30001)
    assert command[:3] == ["/opt/sgl/bin/python", "-m", "sglang.launch_server"]
    assert command[3:] == [
        "--model-path", MODEL, "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", "30001", "--tp-size", "2",
        "--enable-metrics", "--enable-cache-report", "--chunked-prefill-size", "2048", "--max-running-requests", "256",
        "--cuda-graph-backend-prefill", "breakable", "--log-level", "warning",
    ]
    assert engine_env(config, engine) == {"SGLANG_X": "1", "CUDA_VISIBLE_DEVICES": "2,3"}  # the engine's GPUs win


def test_flags_become_sglang_arguments_a_list_space_separated():
    flags = {"enable-mixed-chunk": True, "disable-radix-cache": False, "schedule-policy": None,
             "cuda-graph-bs-prefill": [16, 32], "chunked-prefill-size": 2048}
    assert flag_args(flags) == ["--enable-mixed-chunk", "--cuda-graph-bs-prefill", "16", "32", "--chunked-prefill-size", "2048"]


def test_sim_command_line_shares_the_sglang_arguments():
    config = config_with([{"name": "lp0", "kind": "sim", "role": "short-prefill"}], sglang={"extra_args": ["--device", "cpu"]})
    engine = config.engines[0]
    command = engine_command(config, engine, 30002, role="long-prefill")
    assert command[:3] == [sys.executable, "-m", "engines.sim"]
    assert command[3:-4] == server_args(config, engine, 30002, role="long-prefill")
    assert command[-4:] == ["--sim-model", "qwen2.5-7b", "--sim-gpu", "h200"]
    assert "16384" in command and "--device" not in command and "--tp-size" in command
    assert engine_env(config, engine) == {}


def late_last_config(**sglang) -> Config:
    data = shipped_data()
    data["roles"]["mixed"]["late_requests_last"] = True
    data.update(slo={"ttft_s": 0.5, "ttft_per_1k_new_tokens_s": 0.06}, sglang=sglang, engines=[
        {"name": "real", "kind": "sglang", "role": "mixed", "gpus": [3]}, {"name": "simulated", "kind": "sim", "role": "mixed"}])
    return parse_config(data)


def test_late_requests_last_starts_sglang_with_laps_plugin_and_the_sim_with_its_model(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/site/extra")
    config = late_last_config()
    real, simulated = config.engines
    # The fixed objective, not the length-aware one (engines.manager.late_last_objective says why).
    plugin = {"LAPS_TTFT_S": "0.5", "LAPS_TTFT_PER_1K_NEW_TOKENS_S": "0"}
    # SGLang finds the plugin through the dist-info in its directory, put ahead of the gateway's PYTHONPATH.
    assert engine_env(config, real) == {"PYTHONPATH": f"{SGLANG_PLUGIN_DIR}{os.pathsep}/site/extra", **plugin,
                                        "CUDA_VISIBLE_DEVICES": "3"}
    assert list(SGLANG_PLUGIN_DIR.glob("*.dist-info/entry_points.txt")) and (SGLANG_PLUGIN_DIR / "laps_sglang_plugin.py").is_file()
    assert engine_env(late_last_config(env={"PYTHONPATH": "/opt/sgl"}), real)["PYTHONPATH"] == f"{SGLANG_PLUGIN_DIR}{os.pathsep}/opt/sgl"
    assert engine_env(config, real, role="short-prefill") == {"CUDA_VISIBLE_DEVICES": "3"}  # a role without it
    assert "--sim-late-last-ttft-s" not in engine_command(config, real, 30000)
    # The simulated engine models the plugin from its command line, in real time and in virtual time alike.
    assert engine_command(config, simulated, 30001)[-4:] == ["--sim-late-last-ttft-s", "0.5", "--sim-late-last-per-1k-s", "0"]
    assert engine_env(config, simulated) == {}
    assert (sim_model(config, simulated).config.late_last_ttft_s, sim_model(config, simulated).config.late_last_per_1k_s) == (0.5, 0.0)
    assert sim_model(config, simulated, role="short-prefill").config.late_last_ttft_s is None
    # The plugin changes the engine, so a move between roles that differ in it restarts the engine.
    data = shipped_data()
    data["roles"]["other"] = {**data["roles"]["mixed"], "late_requests_last": True}
    assert not parse_config(data).instant_move("mixed", "other")


def test_deadline_order_gives_the_plugin_the_short_threshold_and_the_engine_models_prefill_rate(monkeypatch, caplog):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    data = late_last_config().model_dump(mode="json")
    data["roles"]["mixed"]["deadline_order"] = True
    data["scheduling"]["short_threshold_tokens"] = 300
    config = parse_config(data)
    real, simulated = config.engines
    rate = sim_model(config, real).config.late_last_prefill_s_per_1k
    # The sim section's engine model: a pass of a whole chunk with nothing cached, per 1,000 of its tokens.
    chunk = sim_model(config, real).config.chunked_prefill_size
    assert rate == sim_model(config, real).latency.predict([(chunk, 0)]) / chunk * 1000
    env = engine_env(config, real)
    assert (env["LAPS_DEADLINE_ORDER_ABOVE_TOKENS"], env["LAPS_PREFILL_S_PER_1K_TOKENS"]) == ("299", repr(rate))
    assert engine_command(config, simulated, 30001)[-2:] == ["--sim-late-last-deadline-order-above", "299"]
    assert sim_model(config, simulated).config.late_last_deadline_order_tokens == 299
    assert "LAPS_DEADLINE_ORDER_ABOVE_TOKENS" not in engine_env(late_last_config(), real)  # off unless asked
    # A real engine whose flags the engine model cannot take still starts, with late requests last, without the order.
    odd = {**data, "roles": {**data["roles"], "mixed": {**data["roles"]["mixed"],
                                                       "flags": {**data["roles"]["mixed"]["flags"], "attention-backend": "fa3"}}}}
    with caplog.at_level("WARNING", "laps.engines"):
        env = engine_env(parse_config(odd), real)
    assert env["LAPS_TTFT_S"] == "0.5" and "LAPS_DEADLINE_ORDER_ABOVE_TOKENS" not in env
    assert "engine real: deadline_order is off" in caplog.text and "--attention-backend fa3" in caplog.text
    # It changes the engine, so a move between roles that differ in it restarts the engine.
    data["roles"]["other"] = {**data["roles"]["mixed"], "deadline_order": False}
    assert not parse_config(data).instant_move("mixed", "other")
    data["roles"]["other"] = {**data["roles"]["mixed"], "late_requests_last": False}
    with pytest.raises(ValueError, match="deadline_order is part of laps' SGLang plugin: it needs late_requests_last: true"):
        parse_config(data)


def test_short_pass_gives_the_plugin_and_the_simulated_engine_the_short_threshold(monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    data = late_last_config().model_dump(mode="json")
    data["roles"]["mixed"].update(deadline_order=True, short_pass=True)
    data["scheduling"]["short_threshold_tokens"] = 300
    config = parse_config(data)
    real, simulated = config.engines
    assert engine_env(config, real)["LAPS_SHORT_PASS_TOKENS"] == "300"
    assert engine_command(config, simulated, 30001)[-4:] == ["--sim-late-last-deadline-order-above", "299",
                                                              "--sim-short-pass-tokens", "300"]
    assert sim_model(config, simulated).config.late_last_short_pass_tokens == 300
    data["roles"]["mixed"]["short_pass"] = False
    assert "LAPS_SHORT_PASS_TOKENS" not in engine_env(parse_config(data), real)  # off unless asked
    assert "--sim-short-pass-tokens" not in engine_command(parse_config(data), simulated, 30001)
    # It changes the engine, so a move between roles that differ in it restarts the engine; it needs the order.
    data["roles"]["other"] = {**data["roles"]["mixed"], "short_pass": True}
    assert not parse_config(data).instant_move("mixed", "other")
    data["roles"]["other"] = {**data["roles"]["mixed"], "short_pass": True, "deadline_order": False}
    with pytest.raises(ValueError, match="short_pass takes its short requests from the plugin's deadline order"):
        parse_config(data)
    for off in (-1, 0, "-2"):
        data["roles"]["other"] = {**data["roles"]["mixed"], "short_pass": True,
                                  "flags": {**data["roles"]["mixed"]["flags"], "chunked-prefill-size": off}}
        with pytest.raises(ValueError, match=f"short_pass cuts a pass's chunk budget: it needs chunked prefill, not "
                                             f"flags.chunked-prefill-size: {int(off)} "):
            parse_config(data)


def test_decode_turns_give_the_plugin_and_the_simulated_engine_the_short_requests_most_new_tokens(monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    data = late_last_config().model_dump(mode="json")
    data["roles"]["mixed"].update(decode_turns=True, flags={**data["roles"]["mixed"]["flags"], "prefill-decode-interval": 1})
    data["scheduling"]["short_threshold_tokens"] = 300
    config = parse_config(data)
    real, simulated = config.engines
    assert engine_env(config, real)["LAPS_DECODE_TURN_SHORT_TOKENS"] == "299"
    assert engine_command(config, simulated, 30001)[-2:] == ["--sim-decode-turn-short-tokens", "299"]
    engine = sim_model(config, simulated).config
    assert (engine.prefill_decode_interval, engine.decode_turn_short_tokens) == (1, 299)
    data["roles"]["mixed"]["decode_turns"] = False
    assert "LAPS_DECODE_TURN_SHORT_TOKENS" not in engine_env(parse_config(data), real)  # off unless asked
    assert "--sim-decode-turn-short-tokens" not in engine_command(parse_config(data), simulated, 30001)
    # It changes the engine, so a move between roles that differ in it restarts the engine.
    data["roles"]["other"] = {**data["roles"]["mixed"], "decode_turns": True}
    assert not parse_config(data).instant_move("mixed", "other")
    # It keeps or drops what SGLang's interval owes, in the plugin: it needs both.
    data["roles"]["other"] = {**data["roles"]["mixed"], "decode_turns": True, "late_requests_last": False}
    with pytest.raises(ValueError, match="decode_turns is part of laps' SGLang plugin: it needs late_requests_last: true"):
        parse_config(data)
    flags = {k: v for k, v in data["roles"]["mixed"]["flags"].items() if k != "prefill-decode-interval"}
    for interval, here in ((None, "unset"), (0, "0")):
        data["roles"]["other"] = {**data["roles"]["mixed"], "decode_turns": True,
                                  "flags": flags if interval is None else {**flags, "prefill-decode-interval": interval}}
        with pytest.raises(ValueError, match=rf"decode_turns keeps or drops the decode passes SGLang's "
                                             rf"prefill-decode-interval owes: it needs flags.prefill-decode-interval >= "
                                             rf"1 \(here: {here}\)"):
            parse_config(data)


async def test_a_restart_into_a_role_without_the_plugin_starts_the_engine_without_it(monkeypatch):
    config = late_last_config()
    real = config.engines[0]
    started: list[tuple[str, dict]] = []

    async def start(self):
        started.append((self.role, dict(self.env)))

    async def nothing(self, *args, **kwargs):
        return None

    for name, fake in (("start", start), ("stop", nothing), ("wait_ready", nothing)):
        monkeypatch.setattr(EngineProcess, name, fake)
    manager = EngineManager(config)
    manager.engines["real"] = EngineProcess(real, "mixed", engine_command(config, real, 30000), engine_env(config, real), 30000,
                                            Path("unused.log"))
    await manager.restart("real", "short-prefill", EngineClient())
    await manager.restart("real", "mixed", EngineClient())
    assert [(role, "LAPS_TTFT_S" in env, "PYTHONPATH" in env) for role, env in started] == [
        ("short-prefill", False, False), ("mixed", True, True)]


def test_late_requests_last_needs_shortest_prefill_first_and_names_the_role():
    data = shipped_data()
    data["roles"]["short-prefill"]["late_requests_last"] = True
    with pytest.raises(ValueError) as info:
        parse_config(data)
    assert str(info.value) == ("<config>: invalid configuration\n  roles.short-prefill: late_requests_last reorders the queue "
                               "of shortest-prefill-first: it needs flags.schedule-policy: shortest-prefill-first "
                               "(unset here: SGLang's default fcfs)")
    data["roles"]["short-prefill"]["flags"]["schedule-policy"] = "lpm"
    with pytest.raises(ValueError, match=r"\(here: lpm\)$"):
        parse_config(data)


def test_external_engine_has_no_command():
    config = config_with([{"name": "far", "kind": "external", "role": "long-prefill", "url": "http://10.0.0.7:30000"}])
    with pytest.raises(ValueError, match="external"):
        engine_command(config, config.engines[0], 30003)


async def test_external_engines_are_served_without_a_process(tmp_path: Path):
    fakes = {"sp0": FakeEngine("sp0"), "lp0": FakeEngine("lp0")}
    servers = {name: TestServer(f.app) for name, f in fakes.items()}
    for s in servers.values():
        await s.start_server()
    engines = [
        {"name": name, "kind": "external", "role": role, "url": str(servers[name].make_url("")).rstrip("/")}
        for name, role in (("sp0", "short-prefill"), ("lp0", "long-prefill"))
    ]
    app = create_app(config_with(engines, log_dir=str(tmp_path)))
    gateway = TestServer(app, handler_cancellation=True)
    await gateway.start_server()
    try:
        assert app[GATEWAY].manager.engines == {}
        async with aiohttp.ClientSession(str(gateway.make_url(""))) as session:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello!"}]}
            async with session.post("/v1/chat/completions", json=body) as resp:
                assert resp.status == 200 and resp.headers["x-laps-engine"] == "sp0"
        assert len(fakes["sp0"].bodies) == 1
    finally:
        await gateway.close()
        for s in servers.values():
            await s.close()


async def test_manager_lists_external_engines_and_refuses_to_restart_them():
    config = config_with([{"name": "far", "kind": "external", "role": "long-prefill", "url": "http://10.0.0.7:30000"}])
    manager = EngineManager(config)
    client = EngineClient()  # never used: there is nothing to wait for
    assert await manager.start(client) == {"far": "http://10.0.0.7:30000"}
    with pytest.raises(KeyError):
        await manager.restart("far", "short-prefill", client)
    with pytest.raises(ValueError, match="'medium' is not defined"):
        await manager.restart("far", "medium", client)
    await manager.stop()


@pytest.mark.parametrize("path", [DEFAULT_CONFIG_PATH, EXAMPLE_H200X8.parent / "sim-pd.yaml", EXAMPLE_H200X8.parent / "h200x8-pd.yaml"])
def test_shipped_short_roles_capture_sglangs_own_prefill_buckets_the_awd_depths_among_them(path: Path):
    """A pass pads to the next captured bucket: SGLang's own buckets (no ``cuda-graph-bs-prefill``) pad little, and
    hold every AWD depth (``scheduling.laps.token_buckets``), so a window's batch still replays its graph."""
    from engines.sim.args import parse_server_args, resolve_args
    from engines.sim.latency import prefill_graph_buckets

    config = load_config(path)
    short = [name for name, role in config.roles.items() if role.pool == "short"]
    assert short
    for name in short:
        flags = config.roles[name].flags
        assert "cuda-graph-bs-prefill" not in flags and flags["cuda-graph-backend-prefill"] == "breakable"
        sim = resolve_args(parse_server_args(flag_args(flags)))
        chunk = int(flags["chunked-prefill-size"])
        assert sim.prefill_graph.sizes == prefill_graph_buckets(chunk)
        assert set(config.scheduling.laps.token_buckets) <= set(sim.prefill_graph.sizes)
    long = [role for role in config.roles.values() if role.pool == "long"]
    assert all(role.flags["cuda-graph-backend-prefill"] == "disabled" for role in long)


@pytest.mark.sglang
def test_every_shipped_command_line_parses_in_sglang(sglang_parser: sglang_env.SGLangParser):
    """Each role of config.yaml, on each kind laps launches, as SGLang 0.5.23 parses it (the sim: its SGLang part)."""
    config = parse_config(shipped_data())
    cases: dict[str, list[str]] = {}
    for role in config.roles:
        for kind in ("sglang", "sim"):
            engine = config_with([{"name": "e", "kind": kind, "role": role, "gpus": [0, 1]}]).engines[0]
            argv = engine_command(config, engine, 30000)[3:] if kind == "sglang" else server_args(config, engine, 30000)
            cases[f"{kind}/{role}"] = argv
        cpu = config_with([{"name": "e", "kind": "sglang", "role": role}], sglang={"extra_args": sglang_env.CPU_SERVER_ARGS})
        cases[f"sglang-cpu-test/{role}"] = engine_command(cpu, cpu.engines[0], 30000)[3:]
    example = load_config(EXAMPLE_H200X8)
    for engine in example.engines:
        if engine.kind == "sglang":
            cases[f"examples/h200x8.yaml/{engine.name}"] = engine_command(example, engine, engine.port)[3:]
    cases["a bad flag is caught"] = ["--model-path", MODEL, "--no-such-flag", "1"]
    errors = dict(zip(cases, sglang_parser.errors(list(cases.values()))))
    assert "unrecognized arguments: --no-such-flag" in errors.pop("a bad flag is caught")
    assert errors == {name: None for name in errors}


def test_the_8xh200_example_uses_each_gpu_once_with_real_sglang_engines():
    config = load_config(EXAMPLE_H200X8)
    assert sorted(g for e in config.engines for g in e.gpus) == list(range(8))
    assert {e.kind for e in config.engines} == {"sglang"}
    assert [config.pool(e) for e in config.engines].count("short") == 4
    # Both pools' roles run the same flags, as in examples/sim-h200x8.yaml: moves between them are instant.
    sim = load_config(EXAMPLE_H200X8.parent / "sim-h200x8.yaml")
    assert config.instant_move("short-prefill", "long-prefill") and config.controller.enabled
    flags = {k: v for k, v in config.roles["short-prefill"].flags.items() if k != "mem-fraction-static"}
    assert flags == sim.roles["short-prefill"].flags == sim.roles["long-prefill"].flags
    assert all(role.late_requests_last and role.deadline_order and role.short_pass and role.decode_turns
               for c in (config, sim) for role in (c.roles["short-prefill"], c.roles["long-prefill"]))
    # The real engines get the deadline order for prompts of at least the short threshold (256 new tokens), at the
    # sim section's engine model's full-chunk rate (Qwen2.5-7B on an H200), the simulated ones the same threshold.
    env = engine_env(config, config.engines[0])
    rate = sim_model(config, config.engines[0]).config.late_last_prefill_s_per_1k
    assert (env["LAPS_DEADLINE_ORDER_ABOVE_TOKENS"], env["LAPS_PREFILL_S_PER_1K_TOKENS"]) == ("255", repr(rate))
    assert sim_model(sim, sim.engines[0]).config.late_last_deadline_order_tokens == 255
    assert env["LAPS_SHORT_PASS_TOKENS"] == "256" and sim_model(sim, sim.engines[0]).config.late_last_short_pass_tokens == 256
    # Decode turns: one decode pass owed after a prefill pass while 1,024 requests run, kept while every waiting request
    # is short (at most 255 new tokens) and no chunked prefill is in progress.
    engine = sim_model(sim, sim.engines[0]).config
    assert env["LAPS_DECODE_TURN_SHORT_TOKENS"] == "255" and (
        engine.prefill_decode_interval, engine.prefill_decode_interval_min_bs,
        engine.decode_turn_short_tokens) == (1, 1024, 255)


def test_the_8xh200_examples_capture_sglangs_own_prefill_buckets_so_a_pass_pads_little():
    from engines.sim.args import parse_server_args, resolve_args
    from engines.sim.latency import prefill_graph_buckets

    config = load_config(EXAMPLE_H200X8.parent / "sim-h200x8.yaml")
    argv = engine_command(config, config.engines[0], 30000)[3:]
    sim = resolve_args(parse_server_args(argv))
    assert sim.prefill_graph.backend == "breakable" and sim.prefill_graph.sizes == prefill_graph_buckets(1024)
    # A 540-token pass replays the 576-token graph; the coarse buckets (64, 128, ..., 1,024) padded it to 1,024.
    assert sim.prefill_graph.bucket(540) == 576
    coarse = resolve_args(parse_server_args([*argv, "--cuda-graph-bs-prefill", "64", "128", "256", "512", "1024"]))
    assert coarse.prefill_graph.bucket(540) == 1024
    assert sim.latency.prefill_s([(540, 0)]) < 0.7 * coarse.latency.prefill_s([(540, 0)])


def test_a_sim_role_flag_the_engine_model_does_not_take_fails_before_any_process_starts():
    import asyncio

    import yaml

    from engines.manager import EngineManager
    from laps.config import DEFAULT_CONFIG_PATH, parse_config

    data = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    data["roles"]["short-prefill"]["flags"]["chunked-prefill-sise"] = 512
    manager = EngineManager(parse_config(data))
    with pytest.raises(RuntimeError, match=r"roles.short-prefill.flags.chunked-prefill-sise \(engine sp0\): unrecognized arguments: --chunked-prefill-sise 512"):
        asyncio.run(manager.start(client=None))
    assert manager.engines == {}


@pytest.mark.parametrize(
    ("role", "flags", "controller", "expected"),
    [
        # A value the engine model refuses only when it builds its latency model.
        ("short-prefill", {"sim-decode-spread": 2.0}, False,
         "roles.short-prefill.flags.sim-decode-spread (engine sp0): decode spread must be in [0, 1], got 2.0"),
        # The role an engine would be moved to is checked too when the controller is on, before anything starts.
        ("long-prefill", {"sim-decode-spread": -1}, True,
         "roles.long-prefill.flags.sim-decode-spread (engine sp0): decode spread must be in [0, 1], got -1.0"),
    ],
)
def test_a_bad_sim_flag_value_names_its_key_before_any_engine_starts(role, flags, controller, expected):
    data = shipped_data()
    data["roles"][role]["flags"].update(flags)
    data["controller"] = {"enabled": controller}
    assert_refused_before_anything_runs(parse_config(data), expected)


@pytest.mark.parametrize(("calibration", "gpu", "message"), [
    (None, "h200", "{path}: cannot read calibration: No such file or directory"),
    ({"format": "laps-sim-calibration/1", "gpu": "h200", "compute_efficiency": 0.5, "memory_efficiency": 0.4}, "a100",
     "{path}: fitted against the h200 preset, but the simulated GPU is a100"),
])
def test_a_bad_sim_calibration_names_its_key_before_any_engine_starts(tmp_path, calibration, gpu, message):
    path = tmp_path / "calibration.json"
    if calibration is not None:
        path.write_text(json.dumps(calibration))
    data = shipped_data()
    data["sim"] = {"gpu": gpu, "calibration": str(path)}
    assert_refused_before_anything_runs(parse_config(data), "sim.calibration: " + message.format(path=path))


def assert_refused_before_anything_runs(config: Config, expected: str) -> None:
    """The engine manager refuses ``config`` with ``expected`` before starting any engine, and laps simulate
    (:func:`engine_cores`) with the same message before its run."""
    manager = EngineManager(config)
    with pytest.raises(RuntimeError) as info:
        asyncio.run(manager.start(client=None))
    assert str(info.value) == expected and manager.engines == {}
    with pytest.raises(ValueError) as info:
        engine_cores(config, load_tokenizer())
    assert str(info.value) == expected


def test_free_ports_are_outside_the_ephemeral_range_and_bindable():
    for _ in range(20):
        port = free_port()
        assert FREE_PORT_RANGE[0] <= port <= FREE_PORT_RANGE[1] and port not in _ephemeral_ports()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))


def test_engines_laps_starts_publish_kv_events_on_ports_of_their_own(monkeypatch, tmp_path: Path):
    config = config_with([{"name": "sp0", "kind": "sim", "role": "short-prefill", "port": 31000},
                          {"name": "lp0", "kind": "sglang", "role": "long-prefill"},
                          {"name": "far", "kind": "external", "role": "long-prefill", "url": "http://10.0.0.7:30000",
                           "kv_events_endpoint": "tcp://10.0.0.7:5557", "kv_events_replay_endpoint": "tcp://10.0.0.7:5558"}],
                         log_dir=str(tmp_path))
    started = []

    async def no_process(self):
        started.append(self)

    async def ready(self, client, timeout_s):
        return None

    monkeypatch.setattr(EngineProcess, "start", no_process)
    monkeypatch.setattr(EngineProcess, "wait_ready", ready)
    manager = EngineManager(config)
    asyncio.run(manager.start(client=None))
    ports = [p.port for p in started]
    kv_ports = [int(e.split(":")[-1]) for p in started for e in (p.kv_events.endpoint, p.kv_events.replay_endpoint)]
    assert len(set(ports + kv_ports)) == 6 and config.gateway.port not in kv_ports and 31000 in ports
    for p in started:
        flag = p.command.index("--kv-events-config")
        assert json.loads(p.command[flag + 1]) == {"publisher": "zmq", "endpoint": p.kv_events.endpoint, "bind": True,
                                                   "replay_endpoint": p.kv_events.replay_endpoint}
        assert p.kv_events.endpoint.startswith("tcp://127.0.0.1:")
    sources = kv_event_sources(config, manager.engines)
    assert sources["far"] == KVEventSource("tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558")
    assert sources["sp0"] == KVEventSource(manager.engines["sp0"].kv_events.endpoint, manager.engines["sp0"].kv_events.replay_endpoint)
    assert set(sources) == {"sp0", "lp0", "far"} and kv_event_sources(config, {}).keys() == {"far"}  # engines given by URL: not followed
    off = config.model_copy(update={"scheduling": config.scheduling.model_copy(update={"kv_events": False})})
    assert "--kv-events-config" not in engine_command(off, off.engines[0], 31000) and kv_event_sources(off, manager.engines) == {}


class _NeverReady:
    """An engine client whose ``GET /ready`` never answers ready."""

    async def ready(self, url: str) -> str:
        return "unreachable"


async def test_an_engine_that_exits_before_it_is_ready_shows_its_own_start_s_log_only(tmp_path: Path):
    """The engine's log file keeps every earlier run (appended); the failure shows the lines of this start."""
    log = tmp_path / "engine-x.log"
    log.write_text("".join(f"\n=== 2026-01-01 10:0{i}:00 starting as mixed: earlier command\nearlier run {i}\n" for i in range(5)))
    engine = EngineProcess(EngineConfig(name="x", role="mixed"), "mixed", [sys.executable, "-c", "print('this run'); raise SystemExit(3)"], {},
                           free_port(), log)
    await engine.start()
    with pytest.raises(RuntimeError) as info:
        await engine.wait_ready(_NeverReady(), timeout_s=60)
    header, *lines = str(info.value).splitlines()
    assert header == "engine x exited with code 3 before it was ready:"
    assert len(lines) == 2 and lines[0].startswith("=== ") and lines[0].endswith(f"starting as mixed: {sys.executable} -c print('this run'); raise SystemExit(3)")
    assert lines[1] == "this run"
    assert log.read_text().count("earlier run") == 5  # still in the file


def test_an_engine_whose_port_another_process_listens_on_is_not_started(monkeypatch, tmp_path: Path):
    """Whatever answers ``GET /ready`` on the port would pass for the engine: a stale engine of an earlier run took over
    its traffic while the engine itself crash-looped on "address already in use"."""
    port = free_port()
    config = config_with([{"name": "sp0", "kind": "sim", "role": "short-prefill"},
                          {"name": "lp0", "kind": "sim", "role": "long-prefill", "port": port}], log_dir=str(tmp_path))
    started = []

    async def start(self):
        started.append(self.config.name)

    monkeypatch.setattr(EngineProcess, "start", start)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind (its connections inherit it)
        other.bind(("127.0.0.1", port))
        other.listen()
        with pytest.raises(RuntimeError) as info:
            asyncio.run(EngineManager(config).start(client=None))
        with socket.create_connection(("127.0.0.1", port)) as client:
            served, _ = other.accept()
            served.close()  # the server's side closes first: its end stays in TIME_WAIT on the port
            client.recv(1)
    assert str(info.value) == (f"engine lp0: port {port} is already in use by another process (an engine left from an earlier run?); "
                               "stop it or give this engine another port")
    assert started == []  # checked before any engine starts
    assert not port_free(port) and port_free(port, as_server=True)  # a server's bind takes a port with only TIME_WAIT left


class _AlwaysReady:
    """An engine client whose ``GET /ready`` always answers ready, whoever listens."""

    async def ready(self, url: str) -> str:
        return "ready"


async def test_an_engine_is_ready_only_when_its_own_process_listens_on_its_port(tmp_path: Path):
    """A restarted engine's port taken meanwhile by another process: its ``/ready`` must not pass for the engine's."""
    port = free_port()
    listen = (f"import socket, time; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
              f"s.bind(('127.0.0.1', {port})); s.listen(); time.sleep(30)")
    loading = EngineProcess(EngineConfig(name="x", role="mixed"), "mixed", [sys.executable, "-c", "import time; time.sleep(30)"], {},
                            port, tmp_path / "engine-x.log")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as stranger:
        stranger.bind(("127.0.0.1", port))
        stranger.listen()
        await loading.start()
        try:
            with pytest.raises(RuntimeError, match=rf"^engine x not ready after 1 s \(another process answers on port {port}\):"):
                await loading.wait_ready(_AlwaysReady(), timeout_s=1)
        finally:
            await loading.stop()
    own = EngineProcess(EngineConfig(name="x", role="mixed"), "mixed", [sys.executable, "-c", listen], {}, port, tmp_path / "engine-x.log")
    await own.start()
    try:
        await own.wait_ready(_AlwaysReady(), timeout_s=20)
        assert port_listeners(port) == {own.process.pid}
    finally:
        await own.stop()


def test_an_engine_process_leaves_the_terminal_and_outlives_a_ctrl_c_caught_before_it_did():
    """uvloop forks an engine with every signal blocked and unblocks them just before exec: a Ctrl-C to the terminal's
    process group between the fork and setsid() was pending then, and killed the engine (exit code -2). The child
    here makes that SIGINT pending, runs the engines' preexec_fn, unblocks as libuv does, and must live on, a session
    leader."""
    script = (
        "import os, signal\n"
        "from engines.manager import engine_preexec\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})\n"
        "signal.raise_signal(signal.SIGINT)\n"  # to this thread (the imports started others, which do not block it)
        "engine_preexec()\n"
        "signal.signal(signal.SIGINT, signal.SIG_DFL)\n"
        "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})\n"
        "print(os.getsid(0) == os.getpid() != os.getppid())\n"
    )
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=root,
                            env={**os.environ, "PYTHONPATH": str(root)})
    assert (result.returncode, result.stdout, result.stderr) == (0, "True\n", "")


def test_a_simulated_engine_drains_its_streams_through_a_second_sigterm():
    """When the gateway process that started an engine dies, the kernel sends the engine its parent-death SIGTERM once
    per thread that carries it (two were seen): the first starts the drain, the next must not abort the requests in
    flight (aiohttp's own handler did, within ~70 ms of a scheduler's SIGKILL)."""
    port = free_port()
    root = Path(__file__).resolve().parent.parent
    engine = subprocess.Popen([sys.executable, "-m", "engines.sim", "--port", str(port)], cwd=root, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not _ready(f"http://127.0.0.1:{port}/ready"):
            assert engine.poll() is None and time.monotonic() < deadline, engine.stderr.read()
            time.sleep(0.05)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "ignore_eos": True, "stream": True}
        chunks = []
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line:
                    chunks.append(line)
                if len(chunks) == 3:
                    engine.send_signal(signal.SIGTERM)
                    time.sleep(0.05)
                    engine.send_signal(signal.SIGTERM)
        assert chunks[-1] == "data: [DONE]"
        assert '"finish_reason":"length"' in chunks[-2]  # all 200 tokens, not "abort"
        assert engine.wait(timeout=30) == 0
        assert "SIGTERM again: still draining the requests in flight" in engine.stderr.read()
    finally:
        engine.kill()
        engine.wait()


def _ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _sleeper(log_path: Path) -> EngineProcess:
    """An engine process of kind ``sglang`` that is a sleeping Python (what it runs does not matter here)."""
    return EngineProcess(EngineConfig(name="e", kind="sglang", role="short-prefill"), "short-prefill",
                         [sys.executable, "-c", "import time; time.sleep(60)"], {}, 30000, log_path)


async def test_a_real_engine_waits_for_its_previous_process_to_leave_its_gpus(tmp_path: Path, caplog):
    """A gateway (or scheduler process) that died leaves its engines draining; an engine started again on the same
    GPUs meanwhile would find their memory taken. The new start waits for the old process, named by the pid file."""
    log_path = tmp_path / "engine-e.log"
    old = _sleeper(log_path)
    await old.start()
    assert (tmp_path / "engine-e.pid").read_text().split()[0] == str(old.process.pid)
    new = _sleeper(log_path)  # the old one's gateway is gone: nobody stops it
    starting = asyncio.create_task(new.start())
    await asyncio.sleep(0.5)
    assert not starting.done()
    os.killpg(old.process.pid, signal.SIGTERM)  # its drain ends
    await asyncio.wait_for(starting, 10)
    assert f"engine e: its previous process (pid {old.process.pid}) still runs" in caplog.text
    assert (tmp_path / "engine-e.pid").read_text().split()[0] == str(new.process.pid)
    await new.stop()
    assert not (tmp_path / "engine-e.pid").exists()
    await old.process.wait()


async def test_a_previous_engine_process_is_killed_after_the_wait_and_a_stale_pid_file_is_ignored(tmp_path: Path):
    from engines.manager import await_predecessor

    log_path = tmp_path / "engine-e.log"
    old = _sleeper(log_path)
    await old.start()
    await asyncio.wait_for(await_predecessor("e", log_path, within_s=0.3), 10)
    assert await asyncio.wait_for(old.process.wait(), 10) == -signal.SIGKILL
    (tmp_path / "engine-e.pid").write_text(f"{os.getpid()} 0\n")  # this pid runs, but started at another time
    await asyncio.wait_for(await_predecessor("e", log_path, within_s=60), 1)
