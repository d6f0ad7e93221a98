"""SGLang router baselines on small hand-made cases, and the policy registry."""

import typing

import pytest

from laps.config import SchedulingConfig, load_config
from laps.cost import engine_traits
from policies.registry import POLICIES, make_scheduler
from policies.router_baselines import BucketPicker, CacheAwarePicker, RoundRobinPicker
from policies.types import EngineView, RequestView


def engines(*loads: int, healthy: tuple[bool, ...] | None = None) -> list[EngineView]:
    healthy = healthy or (True,) * len(loads)
    return [EngineView(f"w{i}", "short", ok, load) for i, (load, ok) in enumerate(zip(loads, healthy))]


def req(prompt: int, hits: dict | None = None) -> RequestView:
    return RequestView("r", prompt, max((hits or {}).values(), default=0), cached_by_engine=hits or {})


def test_round_robin_cycles_over_healthy_engines():
    picker = RoundRobinPicker()
    views = engines(0, 0, 0, healthy=(True, False, True))
    assert [picker.pick(req(10), views, 0.0) for _ in range(4)] == ["w0", "w2", "w0", "w2"]
    assert picker.pick(req(10), engines(0, healthy=(False,)), 0.0) is None


@pytest.mark.parametrize(
    "loads, hits, expected, why",
    [
        ((0, 0, 0), {"w1": 40}, "w1", "balanced, match ratio 0.4 > 0.3"),
        ((0, 0, 0), {"w1": 30}, "w0", "ratio 0.3 is not above the threshold: smallest tree (all empty: first)"),
        ((100, 10, 0), {"w0": 90}, "w2", "imbalanced (100 - 0 > 64 and 100 > 1.5 x 0): least loaded"),
        ((70, 10, 50), {"w0": 90}, "w0", "max - min = 60 is within 64: balanced, best match"),
        ((200, 140, 150), {"w0": 90}, "w0", "200 - 140 > 64 but 200 < 1.5 x 140: balanced"),
        ((200, 130, 150), {"w0": 90}, "w1", "200 - 130 > 64 and 200 > 1.5 x 130: imbalanced"),
    ],
)
def test_cache_aware_rule(loads, hits, expected, why):
    assert CacheAwarePicker().pick(req(100, hits), engines(*loads), 0.0) == expected, why


def test_cache_aware_falls_back_to_the_smallest_tree_and_grows_it():
    picker = CacheAwarePicker()
    views = engines(0, 0)
    assert picker.pick(req(500), views, 0.0) == "w0"
    assert picker.pick(req(100), views, 0.0) == "w1"  # w0's tree holds 500 tokens now
    assert picker.pick(req(100, {"w1": 90}), views, 0.0) == "w1"  # 0.9 match
    assert picker.tree_tokens == {"w0": 500, "w1": 110}


def test_bucket_learns_length_ranges_and_relearns_after_the_window():
    picker = BucketPicker(window_s=5.0)
    views = engines(0, 0)
    for t, n in enumerate((10, 20, 300, 400)):
        picker.pick(req(n), views, 0.01 * t)
    # First pick learned from one length: boundary [10]; lengths above 10 go to w1.
    assert picker.boundaries == [10]
    assert picker.pick(req(15), views, 5.0) == "w0"  # relearned at t = 5 from 10, 15, 20, 300, 400
    assert picker.boundaries == [20]
    assert picker.pick(req(25), views, 5.1) == "w1"
    assert picker.pick(req(12), engines(100, 0), 5.2) == "w1"  # imbalanced: least loaded


def test_every_configurable_policy_has_a_scheduler():
    names = set(typing.get_args(SchedulingConfig.model_fields["policy"].annotation))
    assert names == set(POLICIES)
    with pytest.raises(ValueError, match="needs the engines' traits"):
        make_scheduler(SchedulingConfig(policy="laps"))
    for name in names:
        scheduler = make_scheduler(SchedulingConfig(policy=name), engine_traits(load_config()))
        assert hasattr(scheduler, "decide") and hasattr(scheduler, "submit")
