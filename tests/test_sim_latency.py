"""The simulated engine's roofline latency model (engines/sim/latency.py) and its calibration."""

from __future__ import annotations

import pytest

from engines.sim.calibration import fit_latency, pass_anchor_rows
from engines.sim.latency import (
    GPUS,
    MODELS,
    GraphSpec,
    decode_graph_buckets,
    make_latency_model,
    prefill_graph_buckets,
)


@pytest.fixture
def h200_7b():
    return make_latency_model("qwen2.5-7b", "h200")


@pytest.mark.parametrize(("name", "quoted_billion"), [("qwen2.5-7b", 7.6), ("qwen2.5-14b", 14.7), ("qwen2.5-32b", 32.5)])
def test_parameter_counts_from_shapes_match_the_quoted_sizes(name, quoted_billion):
    assert MODELS[name].params / 1e9 == pytest.approx(quoted_billion, rel=0.015)


def test_kv_bytes_per_token_of_qwen25_7b():
    assert MODELS["qwen2.5-7b"].kv_bytes_per_token == 28 * 2 * 4 * 128 * 2 == 57_344


def test_prefill_time_is_monotone_in_new_tokens(h200_7b):
    times = [h200_7b.predict([(n, 0)]) for n in range(2, 8193, 37)]
    assert all(a <= b for a, b in zip(times, times[1:]))


def test_decode_time_is_monotone_in_context_and_batch(h200_7b):
    by_context = [h200_7b.predict([(1, h)] * 8) for h in range(0, 32000, 500)]
    by_batch = [h200_7b.predict([(1, 1000)] * bs) for bs in range(1, 256)]
    assert all(a < b for a, b in zip(by_context, by_context[1:]))
    assert all(a <= b for a, b in zip(by_batch, by_batch[1:]))


def test_long_prefill_is_compute_bound_and_decode_memory_bound(h200_7b):
    assert h200_7b.breakdown([(2048, 0)]).compute_bound
    assert not h200_7b.breakdown([(16, 0)]).compute_bound
    for bs in (1, 8, 64, 256):
        assert not h200_7b.breakdown([(1, 2000)] * bs).compute_bound


def test_short_prefills_cost_about_one_weight_read(h200_7b):
    weight_read = MODELS["qwen2.5-7b"].weight_bytes / (h200_7b.gpu.peak_bw * h200_7b.mbu)
    for n in (16, 64, 128):
        b = h200_7b.breakdown([(n, 0)])
        assert b.memory_s == pytest.approx(weight_read, rel=0.01)


def test_totals_path_equals_the_per_sequence_path(h200_7b):
    batch = [(300, 40), (17, 0), (1, 900)]
    # N = 318; pairs = 300·40 + 300·301/2 + 17·18/2 + 1·900 + 1 = 12000 + 45150 + 153 + 901; KV = Σ 2L + H
    assert h200_7b.breakdown(batch) == h200_7b.breakdown_totals(3, 318, 58204, 636 + 940, decode=False)
    decode = [(1, 10), (1, 20)]
    assert h200_7b.breakdown(decode) == h200_7b.breakdown_totals(2, 2, 32, 34, decode=True)


def test_fitted_defaults_are_the_fit_and_the_anchor_misses_are_as_documented(h200_7b):
    fitted = fit_latency(h200_7b)
    assert fitted.compute_efficiency == pytest.approx(h200_7b.compute_efficiency, abs=2e-3)
    assert fitted.memory_efficiency == pytest.approx(h200_7b.memory_efficiency, abs=2e-3)
    errors = {row["name"]: row["error_pct"] for row in pass_anchor_rows(h200_7b)}
    expected = {"prefill 16": 0, "prefill 256": 10, "prefill 1024": 67, "prefill 2048": -11, "8 x prefill 64": -39}
    for name, pct in expected.items():
        assert errors[name] == pytest.approx(pct, abs=1.5), name


# ---- CUDA-graph coverage: SGLang 0.5.23's buckets and the choice among them -------------------


def test_prefill_token_buckets_are_sglangs():
    assert prefill_graph_buckets(300) == (4, 8, 12, 16, 20, 24, 28, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192,
                                          208, 224, 240, 256, 288)
    buckets = prefill_graph_buckets(8192)
    assert len(buckets) == 58 and buckets[-3:] == (7168, 7680, 8192) and 1280 in buckets and 1088 not in buckets


def test_decode_batch_buckets_are_sglangs():
    assert decode_graph_buckets(40) == (1, 2, 4, 8, 12, 16, 24, 32, 40)
    assert decode_graph_buckets(20) == (1, 2, 4, 8, 12, 16, 20)  # max_bs is always captured
    assert decode_graph_buckets(256)[-3:] == (240, 248, 256)


@pytest.mark.parametrize(
    ("spec", "size", "seqs", "bucket"),
    [
        (GraphSpec("breakable", prefill_graph_buckets(8192)), 1, 1, 4),
        (GraphSpec("breakable", prefill_graph_buckets(8192)), 33, 1, 48),  # pads 33 tokens to 48
        (GraphSpec("breakable", prefill_graph_buckets(8192)), 257, 40, 288),  # breakable: any sequence count
        (GraphSpec("breakable", prefill_graph_buckets(8192)), 1025, 1, 1280),
        (GraphSpec("breakable", prefill_graph_buckets(8192)), 8193, 1, None),  # beyond the largest: eager
        (GraphSpec("full", prefill_graph_buckets(8192), max_seqs=16), 512, 16, 512),
        (GraphSpec("full", prefill_graph_buckets(8192), max_seqs=16), 512, 17, None),  # more requests than slots
        (GraphSpec("disabled", prefill_graph_buckets(8192)), 64, 1, None),
        (GraphSpec("full", decode_graph_buckets(256)), 3, 3, 4),
        (GraphSpec("full", decode_graph_buckets(256)), 13, 13, 16),
        (GraphSpec("full", decode_graph_buckets(256)), 257, 257, None),
        (GraphSpec("breakable", (16, 32, 64)), 40, 2, 64),  # --cuda-graph-bs-prefill 16 32 64
    ],
)
def test_graph_bucket_choice(spec, size, seqs, bucket):
    assert spec.bucket(size, seqs) == bucket


def test_graph_padding_and_launch_cost(h200_7b):
    # 33 tokens replay the 48-token graph: the linear layers run 48 rows.
    b33, b48 = h200_7b.breakdown([(33, 0)]), h200_7b.breakdown([(48, 0)])
    assert b33.graph == 48
    assert b33.compute_s == pytest.approx(b48.compute_s, rel=0.01)
    # Decode: the 16-sequence graph covers 13; past max_bs a decode pass runs eagerly, launch-bound.
    assert h200_7b.breakdown([(1, 100)] * 13).graph == 16
    small = make_latency_model(decode_graph=GraphSpec("full", decode_graph_buckets(16)))
    eager = small.breakdown([(1, 100)] * 17)
    assert eager.graph is None and eager.launch_s == pytest.approx(28 * small.eager_launch_per_layer_s)
    assert eager.total_s > eager.memory_s + small.pass_overhead_s  # the launches, not the weights, set the time
    disabled = make_latency_model(decode_graph=GraphSpec("disabled"))
    assert disabled.predict([(1, 100)]) > h200_7b.predict([(1, 100)])


def test_tensor_parallelism_splits_the_work():
    one, two = make_latency_model(tp_size=1), make_latency_model(tp_size=2)
    assert two.breakdown([(4096, 0)]).flops == pytest.approx(one.breakdown([(4096, 0)]).flops / 2)
    assert two.predict([(4096, 0)]) < one.predict([(4096, 0)])
    assert two.breakdown([(4096, 0)]).comm_s > 0


def test_bigger_models_and_slower_gpus_are_slower():
    batch = [(512, 0)]
    assert (make_latency_model("qwen2.5-7b").predict(batch) < make_latency_model("qwen2.5-14b").predict(batch)
            < make_latency_model("qwen2.5-32b").predict(batch))
    assert make_latency_model(gpu="h200").predict([(1, 0)]) < make_latency_model(gpu="h100").predict([(1, 0)])
    assert make_latency_model(gpu="h100").predict(batch) < make_latency_model(gpu="a100").predict(batch)


def test_kv_pool_size_from_memory(h200_7b):
    m = MODELS["qwen2.5-7b"]
    expected = int((GPUS["h200"].memory_bytes * 0.88 - m.params * 2) // m.kv_bytes_per_token)
    assert h200_7b.max_total_tokens(0.88) == expected
    with pytest.raises(ValueError, match="do not fit"):
        make_latency_model("qwen2.5-32b", "a100").max_total_tokens(0.5)


@pytest.mark.parametrize("batch", [[], [(0, 5)], [(3, -1)]])
def test_bad_batches_raise(h200_7b, batch):
    with pytest.raises(ValueError):
        h200_7b.predict(batch)


def test_unknown_presets_raise():
    with pytest.raises(ValueError, match="unknown sim model"):
        make_latency_model("llama-70b")
    with pytest.raises(ValueError, match="unknown sim gpu"):
        make_latency_model(gpu="b200")
