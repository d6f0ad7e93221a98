"""The simulated engine's command line (engines/sim/args.py): SGLang 0.5.23's flags and derived defaults."""

from __future__ import annotations

import dataclasses

import pytest

from engines.manager import server_args
from engines.sim.args import SimServerArgs, parse_server_args, resolve_args
from engines.sim.core import EngineCore
from engines.sim.latency import decode_graph_buckets
from engines.sim.server import plugin_lines
from laps.config import load_config
from laps.tokenizer import load_tokenizer



def test_h200_defaults_follow_sglangs_memory_heuristic():
    sim = resolve_args(SimServerArgs())
    assert sim.config.chunked_prefill_size == 8192
    assert sim.decode_graph.backend == "full" and sim.decode_graph.sizes == decode_graph_buckets(256)
    assert sim.prefill_graph.backend == "breakable" and len(sim.prefill_graph.sizes) == 58
    # reserve = 512 + 1.5·8192 + 1024/8 + 2·256 + 8·58 = 13,904 MiB of 143,771: 0.90329 -> 0.903
    assert sim.mem_fraction_static == 0.903
    assert sim.config.max_total_tokens == sim.latency.max_total_tokens(0.903)
    assert 2_000_000 < sim.config.max_total_tokens < 2_200_000
    assert sim.config.max_running_requests == 4096  # clip(tokens / 32768 · 512, 2048, 4096)


def test_role_flags_change_the_derived_defaults():
    sim = resolve_args(parse_server_args(["--chunked-prefill-size", "2048", "--max-running-requests", "64"]))
    assert sim.prefill_graph.sizes[-1] == 2048 and len(sim.prefill_graph.sizes) == 42
    assert sim.decode_graph.sizes == (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64)  # capped at the request slots
    # reserve = 512 + 3072 + 128 + 2·64 + 8·42 = 4,176 MiB, raised to the 10 GiB floor: 0.92877 -> 0.929
    assert sim.mem_fraction_static == 0.929
    no_chunk = resolve_args(SimServerArgs(model_path="Qwen/Qwen2.5-32B-Instruct", chunked_prefill_size=-1))
    assert no_chunk.sim_model == "qwen2.5-32b" and no_chunk.config.chunked_prefill_size is None
    for off in (0, -5):  # SGLang 0.5.23's scheduler turns chunking off at 0 or less, not only at -1
        assert resolve_args(SimServerArgs(chunked_prefill_size=off)).config.chunked_prefill_size is None
    assert no_chunk.prefill_graph.sizes == ()
    # reserve = 512 + 1.5·16384 (max_prefill_tokens) + 128 + 512 = 25,728 MiB: 0.82105 -> 0.821
    assert no_chunk.mem_fraction_static == 0.821
    interval = resolve_args(parse_server_args(["--prefill-decode-interval", "1", "--prefill-decode-interval-min-bs", "1024"]))
    assert (interval.config.prefill_decode_interval, interval.config.prefill_decode_interval_min_bs) == (1, 1024)
    assert (sim.config.prefill_decode_interval, sim.config.prefill_decode_interval_min_bs) == (0, 0)  # SGLang's default: off


@pytest.mark.parametrize(
    ("argv", "decode", "prefill", "max_seqs"),
    [
        (["--cuda-graph-backend-prefill", "full"], "full", "full", 16),  # 8192 // 512 request slots
        (["--disable-cuda-graph"], "disabled", "disabled", None),
        (["--disable-prefill-cuda-graph", "--cuda-graph-backend-prefill", "breakable"], "full", "breakable", None),
        (["--cuda-graph-backend-decode", "disabled"], "disabled", "breakable", None),
    ],
)
def test_cuda_graph_backend_flags(argv, decode, prefill, max_seqs):
    sim = resolve_args(parse_server_args(argv))
    assert (sim.decode_graph.backend, sim.prefill_graph.backend, sim.prefill_graph.max_seqs) == (decode, prefill, max_seqs)


def test_explicit_graph_sizes_decide_the_bucket_a_pass_replays():
    sim = resolve_args(parse_server_args(["--cuda-graph-bs-prefill", "64", "16", "32", "--cuda-graph-max-bs-decode", "8",
                                          "--max-total-tokens", "50000"]))
    assert sim.prefill_graph.sizes == (16, 32, 64) and sim.decode_graph.sizes == (1, 2, 4, 8)
    core = EngineCore(sim.config, sim.latency, load_tokenizer())
    core.add_request("a", list(range(100, 120)), 3, ignore_eos=True)
    core.add_request("b", list(range(200, 215)), 3, ignore_eos=True)
    assert core.step(0.0).graph == 64  # 20 + 15 = 35 tokens pad to the 64-token graph
    assert core.step(0.1).graph == 2  # two decodes replay the batch-2 graph
    eager = resolve_args(parse_server_args(["--cuda-graph-max-bs-prefill", "16", "--max-total-tokens", "50000"]))
    core = EngineCore(eager.config, eager.latency, load_tokenizer())
    core.add_request("c", list(range(100, 120)), 1, ignore_eos=True)
    assert core.step(0.0).graph is None  # 20 tokens exceed the largest captured prefill (16): eager


def test_bad_flags_and_policies_are_refused():
    with pytest.raises(ValueError, match="unrecognized arguments: --no-such-flag"):
        parse_server_args(["--no-such-flag"])
    with pytest.raises(ValueError, match="invalid choice"):
        parse_server_args(["--schedule-policy", "sjf"])
    with pytest.raises(ValueError, match="Unknown schedule_policy"):
        resolve_args(parse_server_args(["--schedule-policy", "priority"]))
    assert resolve_args(parse_server_args(["--schedule-policy", "lpm"])).config.schedule_policy == "lpm"
    spf = ["--schedule-policy", "shortest-prefill-first"]
    with pytest.raises(ValueError, match="--sim-late-last-deadline-order-above needs --sim-late-last-ttft-s"):
        resolve_args(parse_server_args([*spf, "--sim-late-last-deadline-order-above", "255"]))
    with pytest.raises(ValueError, match="--sim-late-last-deadline-order-above must be a number of tokens >= 0, got -1"):
        resolve_args(parse_server_args([*spf, "--sim-late-last-ttft-s", "0.4", "--sim-late-last-deadline-order-above", "-1"]))
    sim = resolve_args(parse_server_args([*spf, "--sim-late-last-ttft-s", "0.4", "--sim-late-last-deadline-order-above", "0"]))
    assert (sim.config.late_last_deadline_order_tokens, sim.config.late_last_prefill_s_per_1k) == (
        0, sim.latency.predict([(8192, 0)]) / 8192 * 1000)  # an H200's default chunk
    ordered = [*spf, "--sim-late-last-ttft-s", "0.4", "--sim-late-last-deadline-order-above", "255"]
    with pytest.raises(ValueError, match="--sim-short-pass-tokens needs --sim-late-last-deadline-order-above"):
        resolve_args(parse_server_args([*spf, "--sim-late-last-ttft-s", "0.4", "--sim-short-pass-tokens", "256"]))
    with pytest.raises(ValueError, match="--sim-short-pass-tokens must be a number of tokens >= 1, got 0"):
        resolve_args(parse_server_args([*ordered, "--sim-short-pass-tokens", "0"]))
    assert resolve_args(parse_server_args([*ordered, "--sim-short-pass-tokens", "256"])).config.late_last_short_pass_tokens == 256
    with pytest.raises(ValueError, match="--sim-short-pass-tokens cuts a pass's chunk budget: it needs chunked prefill, not "
                                         "--chunked-prefill-size -1"):
        resolve_args(parse_server_args([*ordered, "--sim-short-pass-tokens", "256", "--chunked-prefill-size", "-1"]))
    late = [*spf, "--sim-late-last-ttft-s", "0.4"]
    with pytest.raises(ValueError, match="--sim-decode-turn-short-tokens keeps or drops the decode passes that "
                                         "--prefill-decode-interval owes: it needs --prefill-decode-interval >= 1"):
        resolve_args(parse_server_args([*late, "--sim-decode-turn-short-tokens", "255"]))
    with pytest.raises(ValueError, match="--sim-decode-turn-short-tokens models part of laps' plugin: it needs "
                                         "--sim-late-last-ttft-s"):
        resolve_args(parse_server_args([*spf, "--prefill-decode-interval", "1", "--sim-decode-turn-short-tokens", "255"]))
    turns = [*late, "--prefill-decode-interval", "1", "--sim-decode-turn-short-tokens"]
    with pytest.raises(ValueError, match="--sim-decode-turn-short-tokens must be a number of tokens >= 0, got -1"):
        resolve_args(parse_server_args([*turns, "-1"]))
    assert resolve_args(parse_server_args([*turns, "255"])).config.decode_turn_short_tokens == 255


def test_the_engine_says_at_start_up_which_plugin_order_it_models():
    spf = ["--schedule-policy", "shortest-prefill-first"]
    assert plugin_lines(resolve_args(parse_server_args(spf)).config) == []
    late = resolve_args(parse_server_args([*spf, "--sim-late-last-ttft-s", "0.4"])).config
    assert plugin_lines(late) == ["shortest-prefill-first puts requests that have waited longer than 0.4 s + 0 s per "
                                  "1,000 new tokens behind all others (laps' plugin, modelled)"]
    ordered = dataclasses.replace(late, late_last_deadline_order_tokens=255, late_last_prefill_s_per_1k=0.0224)
    assert plugin_lines(ordered)[1] == ("requests in time of more than 255 new tokens go by deadline, less the longest "
                                        "ones where, at 0.0224 s per 1,000 new tokens after the chunked prefill in "
                                        "progress, one would end late (Moore's order)")
    short_pass = dataclasses.replace(ordered, late_last_short_pass_tokens=256)
    assert plugin_lines(short_pass)[2] == ("a prefill pass that carries requests in time of at most 255 new tokens holds "
                                           "at most 256 tokens, or what they need where more (short passes)")
    turns = dataclasses.replace(short_pass, prefill_decode_interval=1, decode_turn_short_tokens=255)
    assert plugin_lines(turns)[3] == ("a decode pass that --prefill-decode-interval owes is kept only while no chunked "
                                      "prefill is in progress and every waiting request has at most 255 new tokens "
                                      "(decode turns)")


def test_the_managers_command_line_for_every_shipped_role_parses():
    config = load_config()
    for engine in config.engines:
        argv = server_args(config, engine, 30000)
        sim = resolve_args(parse_server_args(argv))
        flags = config.roles[engine.role].flags
        assert sim.config.chunked_prefill_size == flags["chunked-prefill-size"]
        assert sim.config.max_running_requests == flags["max-running-requests"]
        assert sim.args.enable_cache_report
