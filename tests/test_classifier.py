"""Classifiers: the threshold fallback and the fitted cost model's boundary L_m(H)."""

import pytest
from scipy.optimize import brentq

from policies.classifier import CostModelClassifier, PrefillCostModel, ThresholdClassifier
from policies.types import RequestView

# The paper's form (no memory floor), with γw > β so that L_m(0) = (γw − β)/α = 31,000.
PAPER_FORM = PrefillCostModel(alpha=1.0e-9, beta=1.9e-5, gamma_w=5.0e-5, gamma_r=4.0e-7)
# Qwen2.5-7B on an H200 from first principles (DESIGN §1, §6): α = 2·layers·hidden / 790 TFLOP/s,
# β = 2·P / 790 TFLOP/s, γw = γr = 57,344 KV bytes per token / 4.3 TB/s, m0 = 15 GB / 4.3 TB/s.
H200_7B = PrefillCostModel(alpha=2.5e-10, beta=1.9e-5, gamma_w=1.33e-8, gamma_r=1.33e-8, memory_floor_s=3.5e-3)
MODEL = PAPER_FORM


@pytest.mark.parametrize(
    "prompt, cached, expected",
    [(255, 0, "short"), (256, 0, "long"), (4000, 3800, "short"), (4000, 3744, "long"), (10, 0, "short")],
)
def test_threshold_classifies_by_new_tokens(prompt, cached, expected):
    assert ThresholdClassifier(256).classify(RequestView("r", prompt, cached)) == expected


@pytest.mark.parametrize("model", [PAPER_FORM, H200_7B], ids=["paper-form", "h200-7b"])
@pytest.mark.parametrize("cached", [0, 1, 100, 2048, 32768])
def test_boundary_closed_form_equals_numeric_root(model, cached):
    l_m = model.boundary_tokens(cached)
    numeric = brentq(lambda L: model.compute_s(L, cached) - model.memory_s(L, cached), 1e-9, 1e6)
    assert l_m == pytest.approx(numeric, rel=1e-9)


def test_h200_boundary_is_in_the_published_memory_bound_range():
    # DESIGN §1: memory-bound up to roughly 150-500 batched tokens on an H200.
    assert 150 < H200_7B.boundary_tokens(0) < 200
    assert H200_7B.boundary_tokens(8192) < H200_7B.boundary_tokens(0)


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


def test_fit_recovers_a_known_roofline_model_and_its_boundary():
    import numpy as np

    from policies.cost_fit import CostFit, fit_cost_model

    truth = CostFit(H200_7B, overhead_s=0.002, rms_relative_error=0.0)
    grid = [(L, H) for L in (8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192) for H in (0, 1024, 4096, 16384)]
    L, H = np.array(grid, dtype=float).T
    times = truth.predict_s(L, H)
    fit = fit_cost_model(list(zip(L, H, times)))
    assert fit.rms_relative_error < 1e-3
    for cached in (0, 1024, 4096):
        assert fit.model.boundary_tokens(cached) == pytest.approx(H200_7B.boundary_tokens(cached), rel=0.02)


def test_fit_rejects_too_few_or_bad_samples():
    from policies.cost_fit import fit_cost_model

    with pytest.raises(ValueError, match="at least 6"):
        fit_cost_model([(1, 0, 0.01)] * 5)
    with pytest.raises(ValueError, match="positive time"):
        fit_cost_model([(1, 0, 0.0)] * 6)
