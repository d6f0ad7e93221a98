"""Configuration loading: the shipped default, and bad files failing with key path, value and what is allowed."""

from pathlib import Path

import pytest
import yaml

from laps.config import DEFAULT_CONFIG_PATH, ConfigError, load_config, parse_config
from tests.pd_stack import pd_data


def default_data() -> dict:
    return yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())


def test_default_config_is_the_documented_deployment():
    config = load_config()
    assert (config.gateway.host, config.gateway.port) == ("127.0.0.1", 8000)
    assert (config.gateway.keepalive_timeout_s, config.gateway.body_timeout_s) == (75.0, 60.0)
    assert config.gateway.listen_backlog == 2048
    assert config.model.name == "Qwen2.5-7B-Instruct" and config.model.path is None
    assert (config.sim.model, config.sim.gpu) == ("qwen2.5-7b", "h200")
    assert config.slo.ttft_s == 0.4
    assert config.scheduling.short_threshold_tokens == 256
    assert [(e.kind, config.pool(e), e.gpus) for e in config.engines] == [("sim", "short", [0]), ("sim", "long", [1])]


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda d: d["slo"].update(ttft_s=-1), ["slo.ttft_s", "greater than 0", "-1"]),
        (lambda d: d["engines"][0].update(kind="gpu"), ["engines.0.kind", "'sim'", "'gpu'"]),
        (lambda d: d["gateway"].update(prot=8000), ["gateway.prot: unknown key; allowed: admin_key, api_keys, body_timeout_s, first_byte_timeout_s, host, keepalive_timeout_s, listen_backlog, port, request_timeout_s, shutdown_grace_s, stall_timeout_s"]),
        (lambda d: d["gateway"].update(keepalive_timeout_s=0), ["gateway.keepalive_timeout_s", "greater than 0"]),
        (lambda d: d["gateway"].update(body_timeout_s=-1), ["gateway.body_timeout_s", "greater than 0", "-1"]),
        (lambda d: d["gateway"].update(listen_backlog=0), ["gateway.listen_backlog", "greater than or equal to 1", "0"]),
        (lambda d: d["roles"]["mixed"].update(flag={}), ["roles.mixed.flag: unknown key; allowed: deadline_order, decode_turns, flags, late_requests_last, pool, short_pass"]),
        (lambda d: d["engines"][0].update(colour="red"), ["engines.0.colour: unknown key; allowed: bootstrap_port, gpus, kind, kv_events_endpoint, kv_events_replay_endpoint, name, port, role, url"]),
        (lambda d: d["engines"][1].update(role="tiny"), ["engines.1.role", "'tiny'", "allowed: long-prefill, mixed, short-prefill"]),
        (lambda d: d["roles"]["short-prefill"].update(pool="medium"), ["roles.short-prefill.pool", "'short', 'long' or 'decode'", "'medium'"]),
        (lambda d: d["engines"][1].update(name="sp0"), ["engines.1.name", "'sp0'", "more than one engine"]),
        (lambda d: d["gateway"].update(port=70000), ["gateway.port", "less than or equal to 65535", "70000"]),
        (lambda d: d.update(engines=[]), ["engines", "at least 1 item"]),
        (lambda d: d["engines"][1].update(gpus=[0]), ["engines.1.gpus", "GPU 0 is already given to engine 'sp0'"]),
        (lambda d: d["engines"][1].update(gpus=[8]), ["engines.1.gpus", "GPU 8 does not exist", "node.gpus is 8"]),
        (lambda d: d.update(node={"gpus": 1}), ["engines.1.gpus", "GPU 1 does not exist", "ids are 0..0"]),
        (lambda d: d["engines"][0].update(kind="external", gpus=[]), ["engines.0.url", "kind external needs the engine's url"]),
        (lambda d: d["engines"][0].update(kind="external", url="http://h:1"), ["engines.0.gpus", "kind external takes no gpus"]),
        (lambda d: d["engines"][0].update(url="http://h:1"), ["engines.0.url", "only kind external takes a url"]),
        (lambda d: d["engines"][0].update(kind="external", gpus=[], url="h:1"), ["engines.0.url", "should match pattern"]),
        (lambda d: d.update(sglang={"pyhton": "/usr/bin/python3"}), ["sglang.pyhton: unknown key; allowed: env, extra_args, python"]),
        (lambda d: d.update(controller={"hysterisis": 1}), ["controller.hysterisis: unknown key; allowed: cooldown_s, decode_load_threshold, decode_load_weight, decode_queue_weight, decode_role, drain_timeout_s, enabled, hysteresis"]),
        (lambda d: d.update(controller={"cooldown_s": -1}), ["controller.cooldown_s", "greater than or equal to 0", "-1"]),
        (lambda d: d.update(controller={"enabled": True, "long_role": "mixed"}), ["controller.long_role: role 'mixed' serves the short pool, not the long pool"]),
        (lambda d: d["scheduling"].update(decode_placement="aligned"), ["scheduling.decode_placement: 'aligned' chooses among the decode engines of a prefill-decode deployment and needs the pd: section; without it use scheduling.policy: aligned"]),
        (lambda d: d.update(controller={"enabled": True, "short_role": "tiny"}), ["controller.short_role: 'tiny' is not a role defined under roles; allowed: long-prefill, mixed, short-prefill"]),
        (lambda d: d.update(controller={"enabled": True, "min_pool_size": 2}),
         ["controller.min_pool_size: 2 allows no move: a pool gives up an engine only while it has more than min_pool_size, "
          "and the short and long pools have 2 engine(s) in all; set it below 2 or disable the controller"]),
        (lambda d: d["scheduling"].update(laps={"window_min_ms": 10_000}), ["scheduling.laps: window_min_ms must not exceed window_max_ms"]),
        (lambda d: d["scheduling"].update(laps={"token_buckets": [128, 64]}), ["scheduling.laps: token_buckets and length_buckets must be strictly increasing"]),
        (lambda d: d["roles"]["mixed"]["flags"].update({"kv-events-config": "{}"}),
         ["roles.mixed.flags.kv-events-config: laps sets this flag (one endpoint per engine) while scheduling.kv_events is on"]),
        (lambda d: d["roles"]["mixed"]["flags"].update({"page-size": 3}),
         ["roles.mixed.flags.page-size: pages of 3 tokens must divide scheduling.prefix_block_tokens (16)"]),
        (lambda d: d["engines"][0].update(kv_events_endpoint="tcp://h:1"),
         ["engines.0.kv_events_endpoint: only kind external takes one; laps picks the KV event ports of the engines it starts"]),
        (lambda d: d["engines"][0].update(kind="external", gpus=[], url="http://h:1", kv_events_replay_endpoint="tcp://h:2"),
         ["engines.0.kv_events_replay_endpoint: needs kv_events_endpoint"]),
        (lambda d: (d["scheduling"].update(kv_events=False), d["engines"][0].update(kind="external", gpus=[], url="http://h:1", kv_events_endpoint="tcp://h:2")),
         ["engines.0.kv_events_endpoint: scheduling.kv_events is false, so nothing follows it"]),
        (lambda d: d["engines"][0].update(kind="external", gpus=[], url="http://h:1", kv_events_endpoint="h:2"),
         ["engines.0.kv_events_endpoint", "should match pattern"]),
        (lambda d: (d["engines"][0].update(port=28555), d["engines"][1].update(port=28555)),
         ["engines.1.port: port 28555 of 'lp0' is already used by engine 'sp0'; give each engine a port of its own"]),
        (lambda d: d["engines"][1].update(port=8000), ["engines.1.port: port 8000 of 'lp0' is already used by the gateway (gateway.port)"]),
        (lambda d: d.update(roles={}), ["engines.0.role: 'short-prefill' is not a role defined under roles; roles defines none"]),
        (lambda d: d["gateway"].update(request_timeout_s=1e300), ["gateway.request_timeout_s", "less than or equal to 604800", "1e+300"]),
        (lambda d: d["model"].update(name=""), ["model.name", "at least 1 character"]),
    ],
)
def test_bad_config_names_key_value_and_allowed(edit, expected):
    data = default_data()
    edit(data)
    with pytest.raises(ConfigError) as info:
        parse_config(data, "bad.yaml")
    message = str(info.value)
    assert message.startswith("bad.yaml: invalid configuration")
    for fragment in expected:
        assert fragment in message


def test_controller_is_on_where_it_can_work_and_its_roles_are_checked_when_on_or_set():
    data = default_data()
    # config.yaml: one short and one long engine, min_pool_size 1: neither pool can give one up
    assert load_config().controller.enabled is False
    three = {**data, "engines": [*data["engines"], {"name": "sp1", "kind": "sim", "role": "short-prefill"}]}
    assert parse_config(three).controller.enabled is True  # the short pool can give one up
    assert parse_config({**three, "controller": {"min_pool_size": 2}}).controller.enabled is False  # no move possible
    assert parse_config(pd_data()).controller.enabled is False  # one engine per prefill pool, two decode engines
    assert parse_config(pd_data(pd={"role_switch": True})).controller.enabled is True  # the decode pool can give one up
    assert parse_config({**data, "controller": {"enabled": False}}).controller.enabled is False
    external = {**data, "engines": [{"name": n, "kind": "external", "role": r, "url": f"http://10.0.0.{i}:30000"}
                                    for i, (n, r) in enumerate((("a", "short-prefill"), ("b", "long-prefill")))]}
    assert parse_config(external).controller.enabled is False  # laps cannot move external engines
    data["controller"] = {"short_role": "tiny"}  # off, but set explicitly: checked
    with pytest.raises(ConfigError, match="controller.short_role: 'tiny' is not a role defined under roles"):
        parse_config(data)
    data["controller"] = {"long_role": "short-prefill"}
    with pytest.raises(ConfigError, match="controller.long_role: role 'short-prefill' serves the short pool, not the long pool"):
        parse_config(data)
    renamed = default_data()  # roles named otherwise and no controller section: off, the default role names unchecked
    renamed["roles"] = {"fast": renamed["roles"]["short-prefill"], "slow": renamed["roles"]["long-prefill"]}
    renamed["engines"] = [dict(e, role={"short-prefill": "fast", "long-prefill": "slow"}.get(e["role"], "slow")) for e in renamed["engines"]]
    assert parse_config(renamed).controller.short_role == "short-prefill" and not parse_config(renamed).controller.enabled
    renamed["controller"] = {"enabled": True}
    with pytest.raises(ConfigError, match="controller.short_role: 'short-prefill' is not a role defined under roles; allowed: fast, slow"):
        parse_config(renamed)
    data["controller"] = {"enabled": True, "hysteresis": 2.0, "sim_restart_s": 30}
    controller = parse_config(data).controller
    assert (controller.role_for("short"), controller.role_for("long")) == ("short-prefill", "long-prefill")
    assert controller.pressure_config().hysteresis == 2.0 and controller.sim_restart_s == 30.0


def test_kv_events_are_followed_where_laps_starts_the_engine_or_an_external_one_names_its_endpoint():
    data = default_data()
    data["roles"]["mixed"]["flags"]["page-size"] = 4
    data["engines"] += [{"name": "far", "kind": "external", "role": "mixed", "url": "http://h:1", "kv_events_endpoint": "tcp://h:5557"},
                        {"name": "dark", "kind": "external", "role": "mixed", "url": "http://h:2"}]
    config = parse_config(data)
    assert [(e.name, config.publishes_kv_events(e), config.page_tokens(e)) for e in config.engines] == [
        ("sp0", True, 1), ("lp0", True, 1), ("far", True, 4), ("dark", False, 4)]
    data["scheduling"]["kv_events"] = False
    del data["engines"][2]["kv_events_endpoint"]
    data["roles"]["mixed"]["flags"].update({"kv-events-config": "{}", "page-size": 3})  # laps neither sets nor checks them
    config = parse_config(data)
    assert not any(config.publishes_kv_events(e) for e in config.engines)


def test_unreadable_and_non_yaml_files(tmp_path: Path):
    with pytest.raises(ConfigError, match="cannot read configuration"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("engines: [\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: not valid YAML \(line 2, column 1\)"):
        load_config(bad)
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(bad)
    bad.write_bytes(b"model:\n  name: caf\xe9\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: not UTF-8 text \(byte 0xe9 at offset 18\)"):
        load_config(bad)
    for empty in ("", "# nothing but a comment\n"):
        bad.write_text(empty)
        with pytest.raises(ConfigError, match="bad.yaml: the file holds no configuration"):
            load_config(bad)


def test_a_key_given_twice_is_refused_with_its_line(tmp_path: Path):
    """PyYAML keeps the last of two equal keys: a second ``gateway:`` block would silently replace the first."""
    path = tmp_path / "twice.yaml"
    text = DEFAULT_CONFIG_PATH.read_text()
    path.write_text(text + "gateway:\n  port: 8001\n")
    with pytest.raises(ConfigError, match=rf"twice.yaml: not valid YAML \(line {text.count(chr(10)) + 1}, column 1\): key 'gateway' is given twice"):
        load_config(path)
    engines = text.index("engines:\n")  # YAML's merge key: the second engine takes the first's keys and overrides some
    path.write_text(text[:engines] + "engines:\n  - &sp0 {name: sp0, kind: sim, role: short-prefill, gpus: [0]}\n"
                    "  - <<: *sp0\n    name: lp0\n    role: long-prefill\n    gpus: [1]\n" + text[text.index("\nlog_dir:"):])
    assert [(e.name, e.role, e.gpus) for e in load_config(path).engines] == [("sp0", "short-prefill", [0]), ("lp0", "long-prefill", [1])]


def test_errors_of_a_file_give_the_line_of_the_key_at_fault(tmp_path: Path):
    text = DEFAULT_CONFIG_PATH.read_text()
    lines = text.splitlines()
    lp0_port = next(i for i, line in enumerate(lines) if line.strip().startswith("port:") and "lp0" in "".join(lines[i - 4:i])) + 1
    path = tmp_path / "c.yaml"
    path.write_text(text.replace("  port: 8000", "  prot: 8000", 1))  # a field's error
    with pytest.raises(ConfigError) as info:
        load_config(path)
    gateway_port = lines.index("  port: 8000") + 1
    assert str(info.value).splitlines()[1].startswith(f"  gateway.prot (line {gateway_port}): unknown key; allowed: ")
    edited = lines.copy()  # a root validator's error, which names its key path first
    edited[lp0_port - 1] = "    port: 8000"
    path.write_text("\n".join(edited) + "\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).splitlines()[1] == (f"  engines.1.port (line {lp0_port}): port 8000 of 'lp0' is already used by the "
                                               "gateway (gateway.port); give each engine a port of its own, or leave it out "
                                               "(null: a free port is picked)")


def test_errors_show_no_key_no_whole_file_and_stop_at_a_file_nested_too_deep(tmp_path: Path):
    data = default_data()
    data["gateway"]["admin_key"] = "short"
    data["gateway"]["api_keys"] = ["sk-client-secret-123456"]
    del data["engines"]
    with pytest.raises(ConfigError) as info:
        parse_config(data, "bad.yaml")
    assert str(info.value).splitlines()[1:] == ["  gateway.admin_key: String should have at least 8 characters", "  engines: Field required"]
    assert "sk-client" not in str(info.value)  # a missing key's input, the whole file, is not shown
    data = default_data()
    data["slo"]["ttft_s"] = {"a": [[i] for i in range(1000)]}
    with pytest.raises(ConfigError) as info:
        parse_config(data, "bad.yaml")
    assert str(info.value).endswith("(got {'a': [[...], [...], [...], [...], [...], [...], ...]})")  # a value cut short
    data = default_data()
    data["engines"][0]["gpus"] = ["x"] * 1000
    with pytest.raises(ConfigError) as info:
        parse_config(data, "bad.yaml")
    assert str(info.value).splitlines()[-2:] == [
        "  engines.0.gpus.19: Input should be a valid integer, unable to parse string as an integer (got 'x')", "  ... and 980 more"]
    deep = tmp_path / "deep.yaml"
    deep.write_text("model:\n  path: " + "[" * 2000 + "]" * 2000 + "\n")
    with pytest.raises(ConfigError, match="deep.yaml: not valid YAML: nested deeper than the parser goes"):
        load_config(deep)


def test_a_key_that_overrides_a_merged_one_is_found_on_its_own_line(tmp_path: Path):
    text = DEFAULT_CONFIG_PATH.read_text()
    engines = text.index("engines:\n")
    path = tmp_path / "merged.yaml"
    path.write_text(text[:engines] + "engines:\n  - &sp0 {name: sp0, kind: sim, role: short-prefill, gpus: [0], port: 9001}\n"
                    "  - <<: *sp0\n    name: lp0\n    role: long-prefill\n    gpus: [1]\n    port: 70000\n" + text[text.index("\nlog_dir:"):])
    own_line = path.read_text().splitlines().index("    port: 70000") + 1
    with pytest.raises(ConfigError, match=rf"engines\.1\.port \(line {own_line}\): Input should be less than or equal to 65535"):
        load_config(path)
