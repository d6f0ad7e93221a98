"""loadgen.agreement's serving latency: its probes, its fit, and what the virtual run does with it."""

from __future__ import annotations

import pytest

from laps.config import load_config
from laps.tokenizer import load_tokenizer
from loadgen.agreement import LONG_PROBE_TOKENS, ServingLatency, fit_serving_latency, probe_workload
from loadgen.simulate import simulate


def test_the_fit_goes_through_the_medians_of_the_short_and_the_long_probes():
    offsets = [(100, 0.0040), (120, 0.0050), (80, 0.0045), (3000, 0.0100), (3010, 0.0110), (2990, 0.0105)]
    fit = fit_serving_latency(offsets)
    per_token_s = (0.0105 - 0.0045) / (3000 - 100)
    assert fit.per_1k_s == pytest.approx(1000 * per_token_s)  # 2.07 ms per 1,000 tokens
    assert fit.fixed_s == pytest.approx(0.0045 - 100 * per_token_s)


def test_the_fit_without_long_probes_or_with_long_ones_faster_has_no_part_per_token():
    assert fit_serving_latency([(100, 0.004), (90, 0.006), (80, 0.005)]) == ServingLatency(0.005, 0.0)
    fit = fit_serving_latency([(100, 0.006), (3000, 0.005)])
    assert (fit.fixed_s, fit.per_1k_s) == (pytest.approx(0.006), 0.0)
    assert fit_serving_latency([(100, -0.001)]) == ServingLatency(0.0, 0.0)
    with pytest.raises(ValueError, match="no probe request succeeded"):
        fit_serving_latency([])


def test_every_other_probe_is_a_distinct_long_prompt_of_exactly_long_probe_tokens_and_seeds_draw_others():
    tok = load_tokenizer(None)

    def prompts(seed: str) -> list[str]:
        conversations = list(probe_workload(4, 0.25, tok, seed).conversations)
        assert [c.start_s for c in conversations] == [0.0, 0.25, 0.5, 0.75]
        return [c.turns[0].content for c in conversations]

    a = prompts("a")
    lengths = [len(tok.encode_chat([{"role": "user", "content": text}])) for text in a]
    assert lengths[1] == lengths[3] == LONG_PROBE_TOKENS
    assert max(lengths[0], lengths[2]) < 300
    assert a[0].startswith("[a 0] ") and a[2].startswith("[a 2] ")
    assert len(set(a)) == 4
    assert prompts("a") == a  # live and virtual runs of one measurement send the same probes
    assert not set(prompts("b")) & set(a)  # the next measurement's are new to the live engines' caches


def test_the_virtual_run_adds_the_fixed_part_and_the_part_per_new_prompt_token_to_each_ttft():
    config, tok = load_config(), load_tokenizer(None)

    def ttfts(fixed_s: float, per_1k_s: float) -> dict:
        records = simulate(config, probe_workload(2, 1.0, tok, "t"), duration_s=2.0, seed=0, ignore_eos=True,
                           serving_latency_s=fixed_s, serving_latency_per_1k_s=per_1k_s, tokenizer=tok)
        return {r.conversation_id: (r.prompt_tokens, r.new_tokens_est, r.ttft_s) for r in records}

    plain, with_latency = ttfts(0.0, 0.0), ttfts(0.004, 0.002)
    for probe, (_, new_tokens, ttft_s) in with_latency.items():
        assert ttft_s - plain[probe][2] == pytest.approx(0.004 + 0.002 * new_tokens / 1000, abs=1e-9)
    prompt_tokens, new_tokens, _ = with_latency["probe-1"]
    # the template's system turn is cached from the probe before
    assert prompt_tokens == LONG_PROBE_TOKENS and 0.95 * LONG_PROBE_TOKENS < new_tokens < prompt_tokens
    with pytest.raises(ValueError, match="serving latency must be >= 0"):
        ttfts(0.0, -0.001)
