"""An engine's /v1/loads body into the gateway's EngineLoad: sums over data-parallel ranks, the capacity where every rank says."""

import pytest

from gateway.engine_load import engine_load

RANK = {"num_running_reqs": 3, "num_waiting_reqs": 2, "num_waiting_uncached_tokens": 500, "num_used_tokens": 1000,
        "max_total_num_tokens": 4000, "cache_hit_rate": 0.5}


def test_ranks_are_summed_and_the_capacity_is_read_where_every_rank_gives_it():
    load = engine_load({"loads": [{**RANK, "max_running_requests": 64}, {**RANK, "max_running_requests": 32}]}, {})
    assert (load.running_requests, load.waiting_requests, load.waiting_uncached_tokens, load.max_running_requests) == (6, 4, 1000, 96)
    assert load.token_usage == 0.25 and load.cache_hit_rate == 0.5
    assert engine_load({"loads": [{**RANK, "max_running_requests": 64}, RANK]}, {}).max_running_requests is None
    assert engine_load({"loads": [{**RANK, "max_running_requests": "64"}]}, {}).max_running_requests is None
    assert engine_load({"loads": [{**RANK, "max_running_requests": True}]}, {}).max_running_requests is None  # not 1
    assert engine_load({"loads": [{**RANK, "max_running_requests": 0}]}, {}).max_running_requests is None  # SGLang's unset


def test_a_rank_without_a_field_read_is_refused():
    with pytest.raises(ValueError, match="a rank lacks a numeric field"):
        engine_load({"loads": [{k: v for k, v in RANK.items() if k != "num_used_tokens"}]}, {})
