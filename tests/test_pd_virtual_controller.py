"""The PD controller in virtual time: a decode side too small at the start gets a prefill engine, flipped in place."""

from __future__ import annotations

from laps.config import parse_config
from laps.tokenizer import load_tokenizer
from loadgen.runner import Arrival
from loadgen.virtual_pd import VirtualPDRun
from loadgen.workloads import Conversation, Turn

TOK = load_tokenizer()
FLAGS = {"max-running-requests": 8}  # the same on every role: a move between sides is a flip, one between pools instant


def pd_run(engines: list[tuple[str, str]], role_switch: bool = True, decode_flags: dict = FLAGS, **controller) -> VirtualPDRun:
    """Prefill engines of roles short/long and decode engines, on the ``pools`` policy; decisions every second.

    With these weights a prefill engine's ψ is its backlog in thousands of tokens and a decode engine's φ is
    0.05 per request waiting for admission plus up to 1 for a full batch (8 running requests).
    """
    return VirtualPDRun(parse_config({
        "scheduling": {"policy": "pools"},
        "pd": {"link": "nvlink", "role_switch": role_switch},
        "roles": {"short": {"pool": "short", "flags": FLAGS}, "long": {"pool": "long", "flags": FLAGS},
                  "decode": {"pool": "decode", "flags": decode_flags}},
        "controller": {"enabled": True, "short_role": "short", "long_role": "long", "interval_s": 1.0, "queue_weight": 1.0,
                       "sla_weight": 0.0, "utilisation_weight": 0.0, "hysteresis": 0.5, "cooldown_s": 1000.0, **controller},
        "engines": [{"name": n, "kind": "sim", "role": r, "gpus": [i]} for i, (n, r) in enumerate(engines)],
    }), TOK, ignore_eos=True)


def chats(n: int, start_s: float, max_tokens: int) -> list[Arrival]:
    return [Arrival(start_s, Conversation(f"chat{start_s:g}-{i}", "test", (Turn(f"Question {start_s:g}-{i}: why is the sky blue?",
                                                                                     max_tokens),)), ()) for i in range(n)]


TWO_SHORT_ONE_LONG_ONE_DECODE = [("ps0", "short"), ("ps1", "short"), ("pl0", "long"), ("d0", "decode")]


def test_a_decode_side_too_small_gets_the_idle_short_engine_flipped_in_place():
    run = pd_run(TWO_SHORT_ONE_LONG_ONE_DECODE)
    records = run.run(chats(20, 0.5, 300) + chats(20, 3.0, 300), duration_s=30.0)
    # At the 1 s decision d0 runs 8 (its cap: φ load term 1) with 12 waiting (0.6): Ψ_D 1.6 against an idle prefill side
    # (Ψ_P 0). The short pool (level with the long one, and larger) gives its least loaded engine, ps0, which has
    # handed off its KV already: it flips at once, no restart, and the cooldown keeps it the only move.
    assert run.moves == [{"engine": "ps0", "from_pool": "short", "to_pool": "decode", "role": "decode", "kind": "flip", "ok": True,
                          "start_s": 1.0, "drain_s": 0.0, "restart_s": 0.0, "end_s": 1.0, "drain_failed": 0}]
    assert run.registry["ps0"].pool == "decode" and run.engines["ps0"].core.config.disaggregation_mode == "decode"
    assert [v.id for v in run.registry.decode_views()] == ["ps0", "d0"] and [v.id for v in run.registry.views()] == ["ps1", "pl0"]
    assert run.restart_engine_s == 0.0
    # The second wave decodes on both: ps0 (empty) takes the requests the least-load placement gives it first.
    second = {t.tid for t in run.transfers if t.tid.startswith("chat3-")}
    assert len(second) == 20 and {t.dst for t in run.transfers if t.tid in second} == {"ps0", "d0"}
    assert {t.src for t in run.transfers if t.tid in second} == {"ps1"}
    assert len(records) == 40 and all(r.ok and r.completion_tokens == 300 for r in records)
    assert run.control_log[0]["pool_pressure_decode"] == 1.6 and run.control_log[0]["pool_pressure_prefill"] == 0.0


def test_across_sides_with_other_flags_the_engine_restarts_as_a_decode_engine():
    run = pd_run(TWO_SHORT_ONE_LONG_ONE_DECODE, decode_flags={**FLAGS, "chunked-prefill-size": 4096}, sim_restart_s=5.0)
    records = run.run(chats(20, 0.5, 300) + chats(20, 7.0, 300), duration_s=30.0)
    assert run.moves == [{"engine": "ps0", "from_pool": "short", "to_pool": "decode", "role": "decode", "kind": "restart", "ok": True,
                          "start_s": 1.0, "drain_s": 0.0, "restart_s": 5.0, "end_s": 6.0, "drain_failed": 0}]
    core = run.engines["ps0"].core
    assert (core.config.disaggregation_mode, core.config.chunked_prefill_size) == ("decode", 4096)
    assert "ps0" in {t.dst for t in run.transfers} and len(records) == 40 and all(r.ok for r in records)


def test_without_role_switch_the_decode_pool_keeps_its_size():
    run = pd_run(TWO_SHORT_ONE_LONG_ONE_DECODE, role_switch=False)
    records = run.run(chats(20, 0.5, 300) + chats(20, 3.0, 300), duration_s=30.0)
    assert run.moves == [] and [v.id for v in run.registry.decode_views()] == ["d0"]
    assert len(records) == 40 and all(r.ok for r in records)


def test_a_busy_decode_engine_is_not_flipped_the_move_is_given_up_and_nothing_fails():
    # The long pool's documents build ~60k backlog tokens (Ψ_P ≈ 48) while both decode engines decode 2,000-token
    # replies: at the 1 s decision d0 (the least loaded: id) is to go to the long pool, but it is still decoding when the
    # 0.5 s drain ends; the flip is given up, d0 serves as decode again, no request fails.
    document = "The harbour master logged every ship that came in. " * 600
    docs = [Arrival(0.8, Conversation(f"doc{i}", "test", (Turn(f"Document {i}. {document}", 4),)), ()) for i in range(10)]
    run = pd_run([("ps0", "short"), ("pl0", "long"), ("d0", "decode"), ("d1", "decode")], drain_timeout_s=0.5)
    records = run.run(chats(4, 0.0, 2000) + docs, duration_s=60.0)
    assert run.moves == [{"engine": "d0", "from_pool": "decode", "to_pool": "long", "role": "long", "kind": "flip", "ok": False,
                          "start_s": 1.0, "drain_s": 0.5, "restart_s": 0.0, "end_s": 1.5, "drain_failed": 0}]
    assert run.registry["d0"].pool == "decode" and not run.registry["d0"].draining
    assert run.engines["d0"].core.config.disaggregation_mode == "decode"
    assert len(records) == 14 and all(r.ok for r in records)
