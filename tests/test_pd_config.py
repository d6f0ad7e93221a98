"""PD deployments in the config and on engine command lines: validation, bootstrap ports, flags SGLang 0.5.23 accepts."""

from __future__ import annotations

import sys

import pytest

from engines.manager import check_sim_flags, engine_command, pd_args, server_args
from engines.sim.args import parse_server_args
from laps.cli import main as laps_main
from laps.config import DEFAULT_CONFIG_PATH, ConfigError, load_config, parse_config
from tests import sglang_env
from tests.pd_stack import PD_ENGINES, pd_config, pd_data
from tests.test_pd_role_switch import flip_data

EXAMPLE_PD = DEFAULT_CONFIG_PATH.parent / "examples" / "h200x8-pd.yaml"
EXAMPLE_SIM_PD = DEFAULT_CONFIG_PATH.parent / "examples" / "sim-pd.yaml"


def test_prefill_engines_get_their_own_bootstrap_port_and_decode_engines_none():
    config = pd_config()
    by_name = {e.name: e for e in config.engines}
    assert pd_args(config, by_name["ps0"]) == ["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "mooncake", "--disaggregation-bootstrap-port", "8998"]
    assert pd_args(config, by_name["pl0"])[-1] == "8999"
    assert pd_args(config, by_name["d1"]) == ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "mooncake"]
    assert pd_args(config, by_name["pl0"], role="prefill-short")[-1] == "8999"  # a pool move keeps the port
    assert pd_args(load_config(), load_config().engines[0]) == []  # no pd: section, no PD flags


def test_pd_flags_come_before_the_role_flags_and_sim_engines_get_the_link():
    config = pd_config(pd={"transfer_backend": "nixl", "bootstrap_port": 9100, "link": "infiniband"})
    engine = config.engines[0]
    args = server_args(config, engine, 30000)
    assert args[args.index("--enable-cache-report") + 1:] == [
        "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "nixl", "--disaggregation-bootstrap-port", "9100",
        "--chunked-prefill-size", "2048",
    ]
    command = engine_command(config, engine, 30000)
    assert command[:3] == [sys.executable, "-m", "engines.sim"] and command[-2:] == ["--sim-kv-link-gb-s", "50"]
    parsed = parse_server_args(command[3:])
    assert (parsed.disaggregation_mode, parsed.disaggregation_bootstrap_port, parsed.sim_kv_link_gb_s) == ("prefill", 9100, 50.0)
    check_sim_flags(config, engine)  # the sim takes every PD flag


def test_link_bandwidth_presets_and_override():
    assert pd_config().pd.link_bytes_per_s == 450e9
    assert pd_config(pd={"link": "tcp"}).pd.link_bytes_per_s == 12.5e9
    assert pd_config(pd={"link": "tcp", "link_gb_s": 3.0}).pd.link_bytes_per_s == 3e9


def test_an_engine_may_set_its_own_bootstrap_port_and_external_ones_default_to_sglangs():
    data = pd_data()
    data["engines"][1]["bootstrap_port"] = 7000
    data["engines"].append({"name": "far", "kind": "external", "role": "prefill-long", "url": "http://10.0.0.9:30000"})
    config = parse_config(data)
    assert [config.bootstrap_port(e) for e in config.engines] == [8998, 7000, 9000, 9001, 8998]


def _broken(edit) -> str:
    data = pd_data()
    edit(data)
    with pytest.raises(ConfigError) as info:
        parse_config(data, "pd.yaml")
    return str(info.value)


@pytest.mark.parametrize(
    "edit, fragment",
    [
        (lambda d: d.pop("pd"), "roles.decode.pool: decode engines exist only with prefill-decode disaggregation; add the pd: section"),
        (lambda d: d.update(engines=d["engines"][:2]), "pd: a prefill-decode deployment needs at least one prefill engine (pool short or long) and one decode engine (pool decode); engines has 2 prefill and 0 decode"),
        (lambda d: d.update(engines=d["engines"][2:]), "engines has 0 prefill and 2 decode"),
        (lambda d: d["roles"]["decode"]["flags"].update({"disaggregation-mode": "decode"}), "roles.decode.flags.disaggregation-mode: laps sets this flag from the pd: section and the role's pool; remove it"),
        (lambda d: d["roles"]["prefill-long"]["flags"].update({"disaggregation-bootstrap-port": 9}), "roles.prefill-long.flags.disaggregation-bootstrap-port: laps sets"),
        (lambda d: d["engines"][1].update(bootstrap_port=8998), "engines.1.bootstrap_port: port 8998 (KV bootstrap of 'pl0') is already used by engine 'ps0'"),
        (lambda d: d["engines"][2].update(port=8999), "pd.bootstrap_port: port 8999 (KV bootstrap of 'pl0') is already used by engine 'd0'; set engines.1.bootstrap_port or pd.bootstrap_port"),
        (lambda d: d.update(gateway={"port": 8999}), "pd.bootstrap_port: port 8999 (KV bootstrap of 'pl0') is already used by the gateway (gateway.port)"),
        (lambda d: d["engines"][0].update(bootstrap_port=8000), "engines.0.bootstrap_port: port 8000 (KV bootstrap of 'ps0') is already used by the gateway (gateway.port)"),
        (lambda d: d["pd"].update(bootstrap_port=65535), "pd.bootstrap_port: the KV bootstrap port of 'pl0' is pd.bootstrap_port (65535) + its index in engines (1) = 65536, above 65535; lower pd.bootstrap_port or set engines.1.bootstrap_port"),
        (lambda d: d["engines"][3].update(bootstrap_port=9500), "engines.3.bootstrap_port: 'd1' is a decode engine (role 'decode'); only prefill engines serve a KV bootstrap port; remove it"),
        (lambda d: d["scheduling"].update(policy="aligned"), "scheduling.policy: 'aligned' places requests by decode context-length band; with pd: that is scheduling.decode_placement: aligned; with pd: the policy places requests on prefill engines: use one of laps, pools, least_load, round_robin, cache_aware, bucket"),
        (lambda d: d["scheduling"].update(policy="backlog"), "scheduling.policy: 'backlog' reserves each request's predicted output tokens in the chosen engine's KV pool, but with pd: the prefill engine does not decode"),
        (lambda d: d["pd"].update(transfer_backend="fake"), "pd.transfer_backend"),
        (lambda d: d["pd"].update(link="carrier-pigeon"), "pd.link"),
    ],
)
def test_bad_pd_configs_say_what_and_where(edit, fragment):
    assert fragment in _broken(edit)


def test_bootstrap_port_without_pd_is_refused():
    data = pd_data()
    del data["pd"]
    data["roles"] = {k: v for k, v in data["roles"].items() if v["pool"] != "decode"}
    data["engines"] = [dict(data["engines"][0], bootstrap_port=9000)]
    with pytest.raises(ConfigError, match="engines.0.bootstrap_port: only engines of a prefill-decode deployment"):
        parse_config(data)


def test_the_pd_example_has_both_prefill_pools_a_decode_pool_and_distinct_bootstrap_ports():
    config = load_config(EXAMPLE_PD)
    assert sorted(g for e in config.engines for g in e.gpus) == list(range(8))
    assert [config.pool(e) for e in config.engines] == ["short", "long", "long", "long", "decode", "decode", "decode", "decode"]
    assert [config.bootstrap_port(e) for e in config.engines if config.pool(e) != "decode"] == [8998, 8999, 9000, 9001]
    assert (config.controller.short_role, config.controller.long_role) == ("prefill-short", "prefill-long")


def test_the_sim_pd_example_launches_each_engine_with_its_pd_flags():
    config = load_config(EXAMPLE_SIM_PD)
    modes = {}
    for engine in config.engines:
        check_sim_flags(config, engine)
        parsed = parse_server_args(engine_command(config, engine, 30000)[3:])
        modes[engine.name] = (parsed.disaggregation_mode, parsed.disaggregation_bootstrap_port, parsed.sim_kv_link_gb_s)
    assert modes == {"ps0": ("prefill", 18998, 450.0), "pl0": ("prefill", 18999, 450.0), "d0": ("decode", 8998, 450.0), "d1": ("decode", 8998, 450.0)}


@pytest.mark.sglang
def test_every_pd_command_line_parses_in_sglang(sglang_parser: sglang_env.SGLangParser):
    """Each PD role on each transfer backend laps offers, and every engine of the PD example, as SGLang 0.5.23 parses them."""
    cases: dict[str, list[str]] = {}
    for backend in ("mooncake", "nixl", "mooncake_tcp"):
        config = pd_config(pd={"transfer_backend": backend})
        for engine in config.engines:
            cases[f"{backend}/{engine.role}/{engine.name}"] = server_args(config, engine, 30000)
    flip = pd_config(pd={"role_switch": True})  # --enable-pd-role-switch and a bootstrap port on decode engines too
    for engine in flip.engines:
        cases[f"role_switch/{engine.role}/{engine.name}"] = server_args(flip, engine, 30000)
    cpu = pd_config(sglang={"extra_args": sglang_env.CPU_SERVER_ARGS}, engines=[dict(e, kind="sglang") for e in PD_ENGINES])
    for engine in cpu.engines:
        cases[f"sglang-cpu-test/{engine.role}/{engine.name}"] = engine_command(cpu, engine, 30000)[3:]
    example = load_config(EXAMPLE_PD)
    for engine in example.engines:
        cases[f"examples/h200x8-pd.yaml/{engine.name}"] = engine_command(example, engine, engine.port)[3:]
    cases["a bad mode is caught"] = ["--model-path", "Qwen2.5-7B-Instruct", "--disaggregation-mode", "both"]
    errors = dict(zip(cases, sglang_parser.errors(list(cases.values()))))
    assert "invalid choice: 'both'" in errors.pop("a bad mode is caught")
    assert errors == {name: None for name in errors}


def test_serve_port_override_is_checked_against_the_bootstrap_ports(capsys):
    assert laps_main(["serve", "--config", str(EXAMPLE_SIM_PD), "--port", "18999"]) == 2  # refused before anything starts
    assert "pd.bootstrap_port: port 18999 (KV bootstrap of 'pl0') is already used by the gateway (gateway.port)" in capsys.readouterr().err


def test_the_controller_sizes_the_decode_pool_only_with_role_switch_and_checks_its_decode_role():
    on = {"enabled": True, "short_role": "prefill-short", "long_role": "prefill-long"}
    assert parse_config(flip_data(controller=on)).controller_sizes_decode()
    assert not parse_config(flip_data(controller={**on, "enabled": False})).controller_sizes_decode()
    no_switch = flip_data(controller=on)
    no_switch["pd"]["role_switch"] = False
    assert not parse_config(no_switch).controller_sizes_decode()
    with pytest.raises(ValueError, match=r"controller.decode_role: 'nope' is not a role defined under roles"):
        parse_config(flip_data(controller={**on, "decode_role": "nope"}))
    with pytest.raises(ValueError, match=r"controller.decode_role: role 'prefill-long' serves the long pool, not the decode pool"):
        parse_config(flip_data(controller={**on, "decode_role": "prefill-long"}))
    parse_config({**no_switch, "controller": {**on, "decode_role": "prefill-long"}})  # not checked where it is not used
