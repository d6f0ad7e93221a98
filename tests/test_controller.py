"""The pressure controller's moves on scripted pressure sequences, checked against hand-computed ones."""

import math

import pydantic
import pytest

from policies.controller import EngineSignals, Move, PressureController, PressureControllerConfig, quantile

# With a = 1 and b = c = 0, ψ is the backlog in thousands of tokens: ψ 1.5 is 1500 queued tokens.
SCRIPTED = dict(queue_weight=1.0, sla_weight=0.0, utilisation_weight=0.0, hysteresis=0.5, cooldown_s=60.0)


def engines(short: dict[str, float], long: dict[str, float]) -> list[EngineSignals]:
    """Signals whose pressure ψ is the given value under :data:`SCRIPTED`."""
    return [EngineSignals(e, pool, gateway_queued_tokens=psi * 1000) for pool, psis in (("short", short), ("long", long)) for e, psi in psis.items()]


def run_script(config: PressureControllerConfig, steps) -> list:
    """Steps: ``("decide", now, short ψ, long ψ, expected move)`` or ``("done", engine, now)``.

    Returns the controller's decision at every ``decide`` step, in order.
    """
    controller = PressureController(config)
    decisions = []
    for step in steps:
        if step[0] == "done":
            controller.on_move_done(step[1], step[2])
            continue
        _, now, short, long, _expected = step
        decisions.append(controller.decide(engines(short, long), now))
    return decisions


SEQUENCES = {
    # Hysteresis: Ψ_long − Ψ_short must exceed τ = 0.5 strictly.
    "just under tau": [("decide", 0.0, {"a": 1.0, "b": 1.0}, {"c": 1.499, "d": 1.499}, None)],
    "exactly tau": [("decide", 0.0, {"a": 1.0, "b": 1.0}, {"c": 1.5, "d": 1.5}, None)],
    "just over tau": [("decide", 0.0, {"a": 1.0, "b": 1.0}, {"c": 1.501, "d": 1.501}, Move("a", "short", "long"))],
    "over tau the other way": [("decide", 0.0, {"a": 2.0, "b": 2.0}, {"c": 1.0, "d": 1.2}, Move("c", "long", "short"))],
    # Cooldown: the move ends at 30 s, so nothing moves before 30 + 60 = 90 s.
    "cooldown": [
        ("decide", 0.0, {"a": 0.0, "b": 0.0}, {"c": 2.0, "d": 2.0}, Move("a", "short", "long")),
        ("done", "a", 30.0),
        ("decide", 89.999, {"b": 0.0, "x": 0.0}, {"a": 2.0, "c": 2.0, "d": 2.0}, None),
        ("decide", 90.0, {"b": 0.0, "x": 0.0}, {"a": 2.0, "c": 2.0, "d": 2.0}, Move("b", "short", "long")),
    ],
    # Cooldown also holds a move in the other direction.
    "cooldown both ways": [
        ("decide", 0.0, {"a": 0.0, "b": 0.0}, {"c": 2.0, "d": 2.0}, Move("a", "short", "long")),
        ("done", "a", 10.0),
        ("decide", 69.9, {"b": 3.0}, {"a": 0.0, "c": 0.0, "d": 0.0}, None),
        ("decide", 70.0, {"b": 3.0}, {"a": 0.0, "c": 0.0, "d": 0.0}, Move("a", "long", "short")),
    ],
    # One move at a time: while "a" switches (however long), nothing else moves; the cooldown starts when it ends.
    "one move at a time": [
        ("decide", 0.0, {"a": 0.0, "b": 0.0, "e": 0.0}, {"c": 2.0, "d": 2.0}, Move("a", "short", "long")),
        ("decide", 5.0, {"b": 0.0, "e": 0.0}, {"c": 2.0, "d": 2.0}, None),
        ("decide", 500.0, {"b": 0.0, "e": 0.0}, {"c": 2.0, "d": 2.0}, None),
        ("done", "a", 500.0),
        ("decide", 559.0, {"b": 0.0, "e": 0.0}, {"a": 2.0, "c": 2.0, "d": 2.0}, None),
        ("decide", 560.0, {"b": 0.0, "e": 0.0}, {"a": 2.0, "c": 2.0, "d": 2.0}, Move("b", "short", "long")),
    ],
    # Minimum pool size 1: the donor's last engine never moves, however high the pressure gap.
    "min pool size": [
        ("decide", 0.0, {"a": 0.0}, {"c": 9.0, "d": 9.0}, None),
        ("decide", 1.0, {"a": 0.0, "b": 0.0}, {"c": 9.0, "d": 9.0}, Move("a", "short", "long")),
        ("done", "a", 2.0),
        ("decide", 100.0, {"b": 0.0}, {"a": 9.0, "c": 9.0, "d": 9.0}, None),
    ],
    # The mix shifts: long-heavy, settles, then short-heavy; the pools follow one engine at a time.
    "shifting mix": [
        ("decide", 0.0, {"a": 0.2, "b": 0.4, "c": 0.3}, {"d": 0.5, "e": 0.6}, None),
        ("decide", 10.0, {"a": 0.2, "b": 0.4, "c": 0.3}, {"d": 3.0, "e": 2.0}, Move("a", "short", "long")),
        ("decide", 40.0, {"b": 0.4, "c": 0.3}, {"d": 3.0, "e": 2.0}, None),
        ("done", "a", 40.0),
        # Ψ_short = 0.39, Ψ_long = 0.96: over τ, but the cooldown runs until 100 s.
        ("decide", 70.0, {"b": 0.4, "c": 0.3}, {"a": 0.5, "d": 1.0, "e": 0.8}, None),
        # Settled: Ψ_long = 0.78, 0.39 apart, under τ.
        ("decide", 100.0, {"b": 0.4, "c": 0.3}, {"a": 0.5, "d": 0.8, "e": 0.7}, None),
        ("decide", 200.0, {"b": 2.5, "c": 2.0}, {"a": 0.1, "d": 0.3, "e": 0.2}, Move("a", "long", "short")),
    ],
}


@pytest.mark.parametrize("steps", SEQUENCES.values(), ids=SEQUENCES.keys())
def test_scripted_sequences(steps):
    expected = [step[4] for step in steps if step[0] == "decide"]
    assert run_script(PressureControllerConfig(**SCRIPTED), steps) == expected


@pytest.mark.parametrize(
    "min_pool_size, donor_size, expected",
    [(2, 2, None), (2, 3, Move("s0", "short", "long")), (3, 3, None), (3, 4, Move("s0", "short", "long"))],
)
def test_min_pool_size_above_one(min_pool_size, donor_size, expected):
    config = PressureControllerConfig(**SCRIPTED, min_pool_size=min_pool_size)
    short = {f"s{i}": 0.0 for i in range(donor_size)}
    assert PressureController(config).decide(engines(short, {"l0": 5.0}), now=0.0) == expected


@pytest.mark.parametrize(
    "values, q, expected",
    [
        # Sorted [0, 1, 2, 3, 10]: position 0.9·4 = 3.6, so 3 + 0.6·(10 − 3) = 7.2.
        ([10.0, 0.0, 3.0, 1.0, 2.0], 0.9, 7.2),
        ([1.0, 3.0], 0.9, 2.8),
        ([4.0], 0.9, 4.0),
        ([5.0, 1.0, 3.0], 0.5, 3.0),
        ([5.0, 1.0, 3.0], 1.0, 5.0),
        ([5.0, 1.0, 3.0], 0.0, 1.0),
    ],
)
def test_quantile_by_hand(values, q, expected):
    assert quantile(values, q) == pytest.approx(expected)


def test_pool_pressure_is_p90_not_max():
    # Short: ψ [0, 1, 2, 3, 10] → P90 7.2 (max 10); long: ψ [8, 8] → 8. 8 − 7.2 = 0.8 > τ = 0.5,
    # so a short engine moves to the long pool, where the max would have moved a long engine instead.
    controller = PressureController(PressureControllerConfig(**SCRIPTED))
    signals = engines({"a": 0.0, "b": 1.0, "c": 2.0, "d": 3.0, "e": 10.0}, {"f": 8.0, "g": 8.0})
    assert controller.pool_pressure([s for s in signals if s.pool == "short"]) == pytest.approx(7.2)
    assert controller.decide(signals, now=0.0) == Move("a", "short", "long")


def test_pressure_formula_by_hand():
    # a = 2, b = 3, c = 1: 2·(1500 + 500)/1000 + 3·0.25 − 1·0.5 = 4 + 0.75 − 0.5 = 4.25.
    config = PressureControllerConfig(queue_weight=2.0, sla_weight=3.0, utilisation_weight=1.0)
    signals = EngineSignals("e", "short", gateway_queued_tokens=1500, engine_waiting_tokens=500, ttft_slo_violation_share=0.25, kv_token_usage=0.5)
    assert PressureController(config).pressure(signals) == pytest.approx(4.25)


@pytest.mark.parametrize(
    "donors, expected",
    [
        # (id, running requests, backlog tokens): fewest running, then fewest backlog tokens, then smallest id.
        ([("a", 3, 0), ("b", 1, 900), ("c", 2, 0)], "b"),
        ([("a", 1, 900), ("b", 1, 100), ("c", 1, 500)], "b"),
        ([("c", 0, 0), ("a", 0, 0), ("b", 0, 0)], "a"),
        ([("b", 0, 10), ("a", 0, 10), ("c", 0, 0)], "c"),
    ],
)
def test_donor_is_least_loaded(donors, expected):
    controller = PressureController(PressureControllerConfig(**SCRIPTED))
    signals = [EngineSignals(e, "short", gateway_queued_tokens=backlog, running_requests=running) for e, running, backlog in donors]
    signals.append(EngineSignals("l", "long", gateway_queued_tokens=5000))
    assert controller.decide(signals, now=0.0) == Move(expected, "short", "long")


def test_external_engines_count_but_never_move():
    controller = PressureController(PressureControllerConfig(**SCRIPTED))
    # "a" is the least loaded but external; "b" moves. Both weigh in the short pool's pressure.
    signals = [EngineSignals("a", "short", movable=False), EngineSignals("b", "short", running_requests=4),
               EngineSignals("l", "long", gateway_queued_tokens=5000)]
    assert controller.decide(signals, now=0.0) == Move("b", "short", "long")
    only_external = PressureController(PressureControllerConfig(**SCRIPTED))
    assert only_external.decide([signals[0], EngineSignals("x", "short", movable=False), signals[2]], now=0.0) is None
    assert (only_external.moves, only_external.in_progress) == (0, None)


def test_an_empty_pool_is_refilled_first_from_the_other_pools_least_loaded_engine():
    # After a manual move emptied the long pool: at the second decision that finds it empty, "b" (fewest running,
    # then fewest backlog tokens) moves, though the short pool's pressure is the higher one and the cooldown of
    # the last move still runs.
    controller = PressureController(PressureControllerConfig(**SCRIPTED))
    assert controller.decide(engines({"a": 0.0, "z": 0.0}, {"x": 2.0}), now=0.0) == Move("a", "short", "long")
    controller.on_move_done("a", now=1.0)
    signals = [EngineSignals("a", "short", gateway_queued_tokens=900, running_requests=1),
               EngineSignals("b", "short", gateway_queued_tokens=3000),
               EngineSignals("c", "short", gateway_queued_tokens=5000)]
    assert controller.decide(signals, now=2.0) is None  # empty once: maybe a missed load poll
    assert controller.decide(signals, now=2.5) == Move("b", "short", "long")
    assert math.isnan(controller.stats()["pool_pressure_long"]) and controller.stats()["pool_size_long"] == 0
    assert controller.decide(signals, now=3.0) is None  # one move at a time
    controller.on_move_done("b", now=4.0)
    refilled = [s for s in signals if s.engine_id != "b"] + [EngineSignals("b", "long")]
    assert controller.decide(refilled, now=5.0) is None  # back to the pressure rule: cooldown until 64 s
    assert controller.decide(engines({"a": 0.0}, {"x": 0.0, "y": 0.0}), now=6.0) is None
    assert controller.decide(engines({}, {"x": 0.0, "y": 0.0}), now=7.0) is None  # the short pool: empty once
    assert controller.decide(engines({"a": 0.0}, {"x": 0.0, "y": 0.0}), now=8.0) is None  # back: nothing to refill
    assert controller.decide(engines({}, {"x": 0.0, "y": 0.0}), now=9.0) is None
    assert controller.decide(engines({}, {"x": 0.0, "y": 0.0}), now=10.0) == Move("x", "long", "short")  # the other way
    assert controller.moves == 3


@pytest.mark.parametrize(
    ("signals", "min_pool_size"),
    [
        (engines({"a": 5.0}, {}), 1),  # the only engine: the donor would be left empty
        (engines({"a": 5.0, "b": 5.0}, {}), 2),  # the donor would fall below min_pool_size
        ([EngineSignals("a", "short", movable=False), EngineSignals("b", "short", movable=False)], 1),  # external only
        ([], 1),  # nothing serves at all
    ],
)
def test_an_empty_pool_stays_empty_when_the_other_pool_cannot_give(signals, min_pool_size):
    controller = PressureController(PressureControllerConfig(**SCRIPTED, min_pool_size=min_pool_size))
    assert [controller.decide(signals, now=t) for t in (0.0, 1.0, 2.0)] == [None] * 3 and controller.moves == 0


def test_on_move_done_must_name_the_move_in_progress():
    controller = PressureController(PressureControllerConfig(**SCRIPTED))
    with pytest.raises(ValueError, match="no move"):
        controller.on_move_done("a", now=0.0)
    controller.decide(engines({"a": 0.0, "b": 0.0}, {"c": 2.0}), now=0.0)
    with pytest.raises(ValueError, match="no move of engine b"):
        controller.on_move_done("b", now=1.0)
    controller.on_move_done("a", now=1.0)


def test_stats_report_pools_and_moves():
    controller = PressureController(PressureControllerConfig(**SCRIPTED))
    controller.decide(engines({"a": 0.0, "b": 1.0}, {"c": 2.0}), now=0.0)
    assert controller.stats() == {
        "pool_size_short": 2, "pool_size_long": 1,
        "pool_pressure_short": pytest.approx(0.9), "pool_pressure_long": pytest.approx(2.0),
        "moves": 1, "move_in_progress": 1,
    }


@pytest.mark.parametrize(
    "fields",
    [
        {"queue_weight": -1.0},
        {"sla_weight": -0.1},
        {"utilisation_weight": -1.0},
        {"pool_quantile": 1.1},
        {"pool_quantile": -0.1},
        {"hysteresis": -0.5},
        {"cooldown_s": -1.0},
        {"min_pool_size": 0},
        {"tau": 0.5},
    ],
)
def test_config_rejects(fields):
    with pytest.raises(pydantic.ValidationError):
        PressureControllerConfig(**fields)


def test_config_defaults_and_frozen():
    config = PressureControllerConfig()
    assert (config.pool_quantile, config.min_pool_size) == (0.9, 1)
    with pytest.raises(pydantic.ValidationError):
        config.hysteresis = 0.0


@pytest.mark.parametrize(
    "fields",
    [
        {"pool": "mixed"},
        {"gateway_queued_tokens": -1},
        {"engine_waiting_tokens": -1},
        {"running_requests": -1},
        {"ttft_slo_violation_share": 1.5},
        {"kv_token_usage": -0.1},
    ],
)
def test_signals_reject(fields):
    with pytest.raises(ValueError):
        EngineSignals(**{"engine_id": "e", "pool": "short", **fields})
