"""The simulated engine's roofline latency model (engines/sim/latency.py) and its calibration."""

from __future__ import annotations

import dataclasses

import pytest

from engines.sim.args import parse_server_args, resolve_args
from engines.sim.calibration import (
    INTERFERENCE_ANCHORS,
    MIXED_BATCH,
    PASS_ANCHORS,
    SHORT_BATCH,
    TTFT_ANCHORS,
    fit_latency,
    median_abs_error_pct,
    padded_batch,
    pass_anchor_rows,
    ttft_anchor_rows,
)
from engines.sim.core import EngineCore
from engines.sim.latency import (
    ALIGNEDSERVE_DECODE_SPREAD,
    GPUS,
    LLAMA2_7B,
    MODELS,
    GraphSpec,
    LatencyModel,
    alignedserve_anchor_batches,
    decode_graph_buckets,
    decode_spread_fraction,
    fit_alignedserve_spread,
    make_latency_model,
    prefill_graph_buckets,
)
from laps.tokenizer import load_tokenizer


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


def test_every_anchor_names_the_model_and_the_source_it_was_measured_on():
    assert {(a.model, a.source) for a in PASS_ANCHORS} == {("qwen2.5-7b", "LAPS slides")}
    assert [(a.name, a.model, a.seconds) for a in INTERFERENCE_ANCHORS] == [
        ("8 x prefill 64", "qwen2.5-32b", 74e-3), ("7 x prefill 64 + 2048", "qwen2.5-7b", 567e-3),
        ("7 x prefill 64 + 2048", "qwen2.5-32b", 2289e-3)]
    assert {(a.model, a.source) for a in TTFT_ANCHORS} == {("qwen2.5-32b", "LAPS paper Figs. 1, 3")}
    assert [round(a.p90_s * 1e3) for a in TTFT_ANCHORS] == [45, 48, 52, 125, 165, 205]


def test_an_anchor_is_compared_only_with_the_model_it_was_measured_on(h200_7b):
    h200_32b = make_latency_model("qwen2.5-32b")
    message = "anchors measured on qwen2.5-7b cannot be compared with the qwen2.5-32b model"
    with pytest.raises(ValueError, match=message):
        pass_anchor_rows(h200_32b)
    with pytest.raises(ValueError, match=message):
        fit_latency(h200_32b)
    sim = resolve_args(parse_server_args([]))
    with pytest.raises(ValueError, match="anchors measured on qwen2.5-32b cannot be compared with the qwen2.5-7b model"):
        ttft_anchor_rows(lambda: EngineCore(sim.config, sim.latency, load_tokenizer()), [[1]], [[2]], 0.2, 10, 0)


def test_padded_batch_pads_every_sequence_to_the_longest():
    assert padded_batch(MIXED_BATCH) == ((2048, 0),) * 8
    assert padded_batch(SHORT_BATCH) == SHORT_BATCH
    assert padded_batch([(3, 10), (5, 2)]) == ((5, 10), (5, 10))


def test_the_interference_pair_ragged_and_padded_lands_as_documented():
    rows = {(r["model"], r["name"]): r for m in ("qwen2.5-7b", "qwen2.5-32b")
            for r in pass_anchor_rows(make_latency_model(m), [a for a in (*PASS_ANCHORS, *INTERFERENCE_ANCHORS)
                                                              if a.model == m and a.batch in (SHORT_BATCH, MIXED_BATCH)])}
    expected = {  # model ms, error %, padded ms (None: padding changes nothing), padded error %
        ("qwen2.5-7b", "8 x prefill 64"): (11.5, -39, None, None),
        ("qwen2.5-7b", "7 x prefill 64 + 2048"): (57.1, -90, 365.0, -36),
        ("qwen2.5-32b", "8 x prefill 64"): (53.3, -28, None, None),
        ("qwen2.5-32b", "7 x prefill 64 + 2048"): (269.1, -88, 1726.7, -25),
    }
    assert rows.keys() == expected.keys()
    for key, (ms, pct, padded_ms, padded_pct) in expected.items():
        r = rows[key]
        assert (r["model_ms"], r["error_pct"]) == (pytest.approx(ms, abs=0.05), pytest.approx(pct, abs=0.5)), key
        if padded_ms is None:
            assert (r["padded_ms"], r["padded_error_pct"]) == (None, None), key
        else:
            assert (r["padded_ms"], r["padded_error_pct"]) == (pytest.approx(padded_ms, abs=0.05),
                                                               pytest.approx(padded_pct, abs=0.5)), key


def test_median_abs_error_is_taken_per_model():
    rows = [{"model": "a", "error_pct": -10.0}, {"model": "a", "error_pct": 30.0}, {"model": "a", "error_pct": 20.0},
            {"model": "b", "error_pct": -4.0}, {"model": "b", "error_pct": 2.0}]
    assert median_abs_error_pct(rows) == {"a": 20.0, "b": 3.0}


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


# ---- decode spread (AlignedServe calibration) -------------------------------------------------


def test_alignedserve_anchor_is_reproduced_within_half_a_percent():
    efficiency, kappa = fit_alignedserve_spread()
    assert kappa == pytest.approx(ALIGNEDSERVE_DECODE_SPREAD, abs=5e-4)
    model = LatencyModel(LLAMA2_7B, GPUS["h100"], memory_efficiency=efficiency, decode_spread_fraction=ALIGNEDSERVE_DECODE_SPREAD)
    uniform, mixed = alignedserve_anchor_batches()
    b_uniform, b_mixed = model.breakdown(uniform), model.breakdown(mixed)
    assert not b_uniform.compute_bound and not b_mixed.compute_bound and b_uniform.graph == b_mixed.graph == 64
    assert b_uniform.total_s == pytest.approx(13.49e-3, rel=5e-3)
    assert b_mixed.total_s == pytest.approx(21.73e-3, rel=5e-3)
    assert b_uniform.spread_s == 0.0
    # spread_s = κ · (64·4696 − 56,704 = 243,840 padding tokens) · KV bytes per token / bandwidth
    per_token_s = LLAMA2_7B.kv_bytes_per_token / (GPUS["h100"].measured_bw * efficiency)
    assert b_mixed.spread_s == pytest.approx(ALIGNEDSERVE_DECODE_SPREAD * 243_840 * per_token_s, rel=1e-12)


def test_a_roofline_explains_37_percent_of_the_alignedserve_increase():
    efficiency, _ = fit_alignedserve_spread()
    roofline = LatencyModel(LLAMA2_7B, GPUS["h100"], memory_efficiency=efficiency)
    uniform, mixed = alignedserve_anchor_batches()
    assert roofline.predict(uniform) == pytest.approx(13.49e-3, rel=1e-9)
    assert roofline.predict(mixed) == pytest.approx(16.57e-3, abs=0.01e-3)
    assert (roofline.predict(mixed) - 13.49e-3) / (21.73e-3 - 13.49e-3) == pytest.approx(0.373, abs=1e-3)


def test_spread_is_charged_on_decode_padding_only(h200_7b):
    spread = make_latency_model(decode_spread="alignedserve")
    assert h200_7b.decode_spread_fraction == 0.0 and spread.decode_spread_fraction == ALIGNEDSERVE_DECODE_SPREAD
    even, uneven = [(1, 1000)] * 8, [(1, 100)] * 7 + [(1, 7300)]  # same Σ H = 8,000
    assert h200_7b.predict(even) == h200_7b.predict(uneven)  # pure roofline: only the sum counts
    assert spread.predict(even) == h200_7b.predict(even)
    c_kv = MODELS["qwen2.5-7b"].kv_bytes_per_token / (GPUS["h200"].measured_bw * spread.memory_efficiency)
    # padding = 8 · 7300 − 8000 = 50,400 tokens
    assert spread.predict(uneven) - h200_7b.predict(uneven) == pytest.approx(0.112 * 50_400 * c_kv, rel=1e-9)
    # a prefill sequence in the pass adds no padding; the decodes' own spread still counts
    assert spread.breakdown([(1, 100), (1, 900), (64, 0)]).spread_s == pytest.approx(0.112 * 800 * c_kv, rel=1e-9)
    assert spread.breakdown([(1, 100), (1, 900)]) == spread.breakdown_totals(2, 2, 1002, 1004, decode=True, decode_padding_tokens=800)


@pytest.mark.parametrize(("value", "kappa"), [("roofline", 0.0), ("alignedserve", 0.112), ("0.5", 0.5), (1, 1.0)])
def test_decode_spread_presets_and_numbers(value, kappa):
    assert decode_spread_fraction(value) == kappa


@pytest.mark.parametrize("value", ["padded", "1.5", -0.1])
def test_bad_decode_spread_is_refused(value):
    with pytest.raises(ValueError, match="decode spread"):
        make_latency_model(decode_spread=value)


def test_engine_core_charges_the_running_batchs_spread():
    sim = resolve_args(parse_server_args(["--sim-decode-spread", "alignedserve"]))
    core = EngineCore(sim.config, sim.latency, load_tokenizer())
    core.add_request("short", list(range(1000, 1100)), 8, ignore_eos=True)
    core.add_request("long", list(range(2000, 5000)), 8, ignore_eos=True)
    now, result = 0.0, core.step(0.0)
    assert result.prefill  # both prompts prefill in one pass; each then holds its prompt's KV
    now += result.duration_s
    result = core.step(now)
    assert result.num_decode_seqs == 2 and result.decode_context_tokens == 100 + 3000
    assert result.duration_s == sim.latency.predict([(1, 100), (1, 3000)])
    assert result.duration_s > dataclasses.replace(sim.latency, decode_spread_fraction=0.0).predict([(1, 100), (1, 3000)])
