"""Classifiers: the threshold fallback and the fitted cost model's boundary L_m(H)."""

import pytest
from scipy.optimize import brentq

from policies.classifier import CostModelClassifier, PrefillCostModel, ThresholdClassifier
from policies.types import RequestView

# Coefficients of the shape an H200 gives a 7B model: ~3.5 ms weight read spread over
# the memory terms, compute ~ 2·P FLOPs per token at ~790 TFLOP/s.
MODEL = PrefillCostModel(alpha=1.0e-9, beta=1.9e-5, gamma_w=5.0e-5, gamma_r=4.0e-7)


@pytest.mark.parametrize(
    "prompt, cached, expected",
    [(255, 0, "short"), (256, 0, "long"), (4000, 3800, "short"), (4000, 3744, "long"), (10, 0, "short")],
)
def test_threshold_classifies_by_new_tokens(prompt, cached, expected):
    assert ThresholdClassifier(256).classify(RequestView("r", prompt, cached)) == expected


@pytest.mark.parametrize("cached", [0, 1, 100, 2048, 32768])
def test_boundary_closed_form_equals_numeric_root(cached):
    l_m = MODEL.boundary_tokens(cached)
    numeric = brentq(lambda L: MODEL.compute_s(L, cached) - MODEL.memory_s(L, cached), 1e-9, 1e6)
    assert l_m == pytest.approx(numeric, rel=1e-9)


def test_boundary_at_zero_cache_is_gamma_w_minus_beta_over_alpha():
    assert MODEL.boundary_tokens(0) == pytest.approx((5.0e-5 - 1.9e-5) / 1.0e-9)
    assert PrefillCostModel(1e-9, 6e-5, 5e-5, 4e-7).boundary_tokens(0) == 0.0


def test_cost_model_classifier_uses_the_boundary_at_h():
    clf = CostModelClassifier(MODEL)
    l_m = MODEL.boundary_tokens(2000)
    assert clf.classify(RequestView("a", 2000 + int(l_m) - 1, 2000)) == "short"
    assert clf.classify(RequestView("b", 2000 + int(l_m) + 1, 2000)) == "long"


def test_boundary_needs_positive_alpha():
    with pytest.raises(ValueError):
        PrefillCostModel(0.0, 1e-5, 5e-5, 4e-7).boundary_tokens(10)
