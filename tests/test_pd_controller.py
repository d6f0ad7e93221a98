"""The PD controller's prefill↔decode moves on scripted pressure sequences, checked against hand-computed ones."""

import math

import pytest

from policies.controller import EngineSignals, Move, PressureController, PressureControllerConfig
from policies.pd_controller import PDPressureController
from policies.registry import make_controller

# ψ of a prefill engine is its backlog in thousands of tokens; φ of a decode engine is 0.1 per waiting request.
SCRIPTED = PressureControllerConfig(queue_weight=1.0, sla_weight=0.0, utilisation_weight=0.0, hysteresis=0.5, cooldown_s=60.0,
                                    decode_queue_weight=0.1)


def signals(short: dict[str, float], long: dict[str, float], decode: dict[str, float]) -> list[EngineSignals]:
    """Signals whose pressure (ψ, or φ for decode) is the given value under :data:`SCRIPTED`."""
    prefill = [EngineSignals(e, pool, gateway_queued_tokens=psi * 1000) for pool, psis in (("short", short), ("long", long))
               for e, psi in psis.items()]
    return prefill + [EngineSignals(e, "decode", waiting_requests=round(phi * 10)) for e, phi in decode.items()]


def run_script(steps, config: PressureControllerConfig = SCRIPTED) -> list:
    """Steps: ``("decide", now, short, long, decode)`` or ``("done", engine, now)``; the decisions in order."""
    controller = PDPressureController(config)
    decisions = []
    for step in steps:
        if step[0] == "done":
            controller.on_move_done(step[1], step[2])
        else:
            decisions.append(controller.decide(signals(*step[2:]), step[1]))
    return decisions


def test_decode_pressure_formula():
    c = PDPressureController()  # w 0.05, b 4, k 1, ℓ0 0.8
    # 4 waiting → 0.2; V 0.25 → 1.0; load max(0.9, 100/200) = 0.9 → (0.9 − 0.8)/0.2 = 0.5
    assert c.decode_pressure(EngineSignals("d", "decode", waiting_requests=4, ttft_slo_violation_share=0.25, kv_token_usage=0.9,
                                           running_requests=100, max_running_requests=200)) == pytest.approx(1.7)
    # the batch is the fuller: 190/200 = 0.95 → 0.75
    assert c.decode_pressure(EngineSignals("d", "decode", kv_token_usage=0.5, running_requests=190,
                                           max_running_requests=200)) == pytest.approx(0.75)
    # capacity unknown: KV use alone; below ℓ0 nothing
    assert c.decode_pressure(EngineSignals("d", "decode", kv_token_usage=0.79, running_requests=10_000)) == 0.0
    # running over the capacity counts as full, not more
    assert c.decode_pressure(EngineSignals("d", "decode", running_requests=300, max_running_requests=200)) == pytest.approx(1.0)


def test_busy_decode_side_takes_an_engine_from_the_calmer_prefill_pool():
    # Ψ_P = P90 of [0, 0, 1, 1] = 1; Ψ_D = 2: gap 1 > τ. The short pool (Ψ 0) gives its least loaded engine, "a".
    assert run_script([("decide", 0.0, {"a": 0.0, "b": 0.0}, {"c": 1.0, "d": 1.0}, {"x": 2.0, "y": 2.0})]) == [
        Move("a", "short", "decode")]


def test_busy_prefill_side_takes_a_decode_engine_into_its_busier_pool():
    # Ψ_P = P90 of [2, 2, 3, 3] = 3; Ψ_D = 0: the decode pool gives "x" to the long pool (Ψ 3 > 2).
    assert run_script([("decide", 0.0, {"a": 2.0, "b": 2.0}, {"c": 3.0, "d": 3.0}, {"x": 0.0, "y": 0.0})]) == [
        Move("x", "decode", "long")]


@pytest.mark.parametrize("decode_phi, expected", [(1.5, None), (1.6, Move("a", "short", "decode"))])
def test_hysteresis_between_the_sides(decode_phi, expected):
    # Ψ_P = 1 on every prefill engine (so no short↔long move either): the gap must exceed τ = 0.5.
    assert run_script([("decide", 0.0, {"a": 1.0, "b": 1.0}, {"c": 1.0, "d": 1.0}, {"x": decode_phi})]) == [expected]


def test_within_tau_between_sides_the_short_long_rule_decides():
    # Ψ_P = 1, Ψ_D = 1.5: no side move; short (0) against long (1) differ by 1 > τ: "a" goes to the long pool.
    assert run_script([("decide", 0.0, {"a": 0.0, "b": 0.0}, {"c": 1.0, "d": 1.0}, {"x": 1.5})]) == [Move("a", "short", "long")]


def test_min_pool_size_on_both_sides():
    # The lone decode engine stays, however calm it is (and the prefill pools are level: nothing moves).
    assert run_script([("decide", 0.0, {"a": 3.0, "b": 3.0}, {"c": 3.0, "d": 3.0}, {"x": 0.0})]) == [None]
    # The calmer short pool has one engine: the long pool gives one instead, its least loaded ("c").
    assert run_script([("decide", 0.0, {"a": 0.0}, {"c": 0.5, "d": 1.0}, {"x": 3.0})]) == [Move("c", "long", "decode")]
    # Neither prefill pool can give one: nothing moves.
    assert run_script([("decide", 0.0, {"a": 0.0}, {"c": 0.5}, {"x": 3.0})]) == [None]


def test_the_least_loaded_engine_moves():
    controller = PDPressureController(SCRIPTED)
    engines = [EngineSignals("a", "short", running_requests=3), EngineSignals("b", "short", running_requests=1),
               EngineSignals("c", "long", running_requests=0), EngineSignals("d", "long", running_requests=0),
               EngineSignals("x", "decode", waiting_requests=30, running_requests=5),
               EngineSignals("y", "decode", waiting_requests=30, running_requests=2)]
    # Ψ_P 0 against Ψ_D 3; both prefill pools at 0 and equally large: the short pool gives "b" (fewer running than "a").
    assert controller.decide(engines, 0.0) == Move("b", "short", "decode")


def test_cooldown_and_one_move_at_a_time_hold_the_side_rule():
    busy_decode = ({"a": 0.0, "b": 0.0, "e": 0.0}, {"c": 0.0, "d": 0.0}, {"x": 3.0})
    assert run_script([
        ("decide", 0.0, *busy_decode),
        ("decide", 5.0, *busy_decode),  # "a" is still flipping
        ("done", "a", 30.0),
        ("decide", 89.9, {"b": 0.0, "e": 0.0}, {"c": 0.0, "d": 0.0}, {"x": 3.0, "a": 3.0}),  # cooldown until 90 s
        ("decide", 90.0, {"b": 0.0, "e": 0.0}, {"c": 0.0, "d": 0.0}, {"x": 3.0, "a": 3.0}),
    ]) == [Move("a", "short", "decode"), None, None, Move("b", "short", "decode")]


def test_a_short_long_move_starts_the_cooldown_of_the_side_rule_too():
    assert run_script([
        ("decide", 0.0, {"a": 0.0, "b": 0.0}, {"c": 2.0, "d": 2.0}, {"x": 2.0, "y": 2.0}),  # Ψ_P 2 = Ψ_D: short → long
        ("done", "a", 0.0),
        ("decide", 59.0, {"b": 0.0}, {"a": 0.0, "c": 0.0, "d": 0.0}, {"x": 3.0, "y": 3.0}),
        ("decide", 60.0, {"b": 0.0}, {"a": 0.0, "c": 0.0, "d": 0.0}, {"x": 3.0, "y": 3.0}),
    ]) == [Move("a", "short", "long"), None, Move("a", "long", "decode")]


def test_an_empty_decode_pool_is_refilled_at_the_second_decision_without_waiting_for_the_cooldown():
    assert run_script([
        ("decide", 0.0, {"a": 0.0, "b": 0.0}, {"c": 0.0, "d": 0.0}, {"x": 0.0, "y": 0.0}),
        ("decide", 1.0, {"a": 5.0, "b": 5.0}, {"c": 5.0, "d": 5.0}, {"x": 0.0, "y": 0.0}),  # Ψ_P 5 vs 0: "x" to the short pool
        ("done", "x", 2.0),
        ("decide", 3.0, {"a": 0.0, "b": 0.0, "x": 0.0}, {"c": 0.0, "d": 0.0}, {}),  # the other decode engine went down
        ("decide", 4.0, {"a": 0.0, "b": 0.0, "x": 0.0}, {"c": 0.0, "d": 0.0}, {}),
    ]) == [None, Move("x", "decode", "short"), None, Move("a", "short", "decode")]


def test_stats_carry_the_sides():
    controller = PDPressureController(SCRIPTED)
    controller.decide(signals({"a": 0.0, "b": 0.0}, {"c": 1.0, "d": 1.0}, {"x": 2.0, "y": 1.0}), 0.0)
    stats = controller.stats()
    assert (stats["pool_size_decode"], stats["pool_size_short"], stats["pool_size_long"]) == (2, 2, 2)
    assert stats["pool_pressure_decode"] == pytest.approx(1.9)  # P90 of [1, 2]
    assert stats["pool_pressure_prefill"] == pytest.approx(1.0)
    assert (stats["moves"], stats["move_in_progress"]) == (1, 1)
    idle = PDPressureController(SCRIPTED)
    idle.decide(signals({"a": 0.0}, {"c": 0.0}, {}), 0.0)
    assert idle.stats()["pool_size_decode"] == 0 and math.isnan(idle.stats()["pool_pressure_decode"])


def test_the_short_long_controller_ignores_decode_engines():
    # The same signals as the first move above: without decode sizing only short↔long moves (1 > τ: "a" to long).
    assert PressureController(SCRIPTED).decide(signals({"a": 0.0, "b": 0.0}, {"c": 1.0, "d": 1.0}, {"x": 9.0}), 0.0) == Move(
        "a", "short", "long")


def test_make_controller():
    assert type(make_controller(SCRIPTED, sizes_decode=True)) is PDPressureController
    assert type(make_controller(SCRIPTED, sizes_decode=False)) is PressureController
