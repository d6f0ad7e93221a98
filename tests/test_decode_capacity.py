"""bench/decode_capacity.py: the steady-state decode capacity on scripted pass costs, and one workload's figures."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))  # decode_capacity imports dominance from next to it
_spec = importlib.util.spec_from_file_location("decode_capacity", BENCH / "decode_capacity.py")
decode_capacity = sys.modules["decode_capacity"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(decode_capacity)


class Passes:
    """A decode pass of 1 ms plus 10 µs a sequence plus 1 ns a token of context; records what it was asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[int, int]] = []

    def decode_s(self, seqs: int, context_tokens: int) -> float:
        self.asked.append((seqs, context_tokens))
        return 1e-3 + 1e-5 * seqs + 1e-9 * context_tokens


def test_the_batch_is_the_slots_or_what_the_kv_pool_holds_whichever_is_fewer():
    passes = Passes()
    # 1,000 KV tokens hold 6 requests of 100 + 50 tokens, but only 4 slots: 4 sequences of context 125, a pass of
    # 1 ms + 40 µs + 500 ns; 4 tokens a pass, 50 a reply, 2 engines
    assert decode_capacity.decode_capacity_rps(passes, 1000, 4, 100.0, 50.0, 2) == pytest.approx(2 * 4 / 1.0405e-3 / 50)
    assert passes.asked == [(4, 500)]
    # with 64 slots the KV pool binds: 6 sequences, context 750 tokens
    assert decode_capacity.decode_capacity_rps(passes, 1000, 64, 100.0, 50.0, 1) == pytest.approx(6 / 1.06075e-3 / 50)
    assert passes.asked[-1] == (6, 750)


@pytest.mark.parametrize("kv, reply, engines, says", [(100, 50.0, 1, "does not fit"), (1000, 0.0, 1, "must be > 0"),
                                                      (1000, 50.0, 0, "must be > 0")])
def test_a_request_that_cannot_decode_is_an_error(kv, reply, engines, says):
    with pytest.raises(ValueError, match=says):
        decode_capacity.decode_capacity_rps(Passes(), kv, 4, 100.0, reply, engines)


def test_a_workload_gives_its_mean_lengths_and_the_capacity_of_its_decoding_engines():
    unified = decode_capacity.workload_capacity("chat-single", 20.0, pd=False)
    long_replies = decode_capacity.workload_capacity("chat-single", 20.0, pd=False, reply_tokens=256)
    pd = decode_capacity.workload_capacity("mixed", 10.0, pd=True)
    assert unified["decode_engines"] == long_replies["decode_engines"] == 8 and pd["decode_engines"] == 2
    assert 0 < unified["reply_tokens"] < 256 == long_replies["reply_tokens"]
    assert unified["prompt_tokens"] == long_replies["prompt_tokens"] > 0  # the same requests
    assert unified["decode_capacity_rps"] > long_replies["decode_capacity_rps"] > 0 and pd["decode_capacity_rps"] > 0


def test_a_dominance_json_gives_each_verdicts_saturation_and_least_loads_arrivals_there(tmp_path):
    path = tmp_path / "d.json"
    rows = [{"workload": "mixed", "policy": "least_load", "pd": False, "load": 400.0, "requests": 3000, "duration_s": 7.5},
            {"workload": "mixed", "policy": "laps", "pd": False, "load": 400.0, "requests": 1, "duration_s": 1.0},
            {"workload": "mixed", "policy": "least_load", "pd": True, "load": 300.0, "requests": 900, "duration_s": 3.0}]
    verdicts = [{"workload": "mixed", "saturation_load": 400.0}, {"workload": "mixed (PD 6+2)", "saturation_load": 300.0},
                {"workload": "docs", "saturation_load": 250.0}]
    path.write_text(json.dumps({"verdict": verdicts, "rows": rows}))
    assert decode_capacity.dominance_points(path) == [("mixed", "mixed", False, 400.0, 400.0),
                                                      ("mixed (PD 6+2)", "mixed", True, 300.0, 300.0),
                                                      ("docs", "docs", False, 250.0, None)]


@pytest.mark.parametrize("text, says", [("", "Expecting value"), ("[]", "no 'verdict' and 'rows' lists"),
                                        ('{"verdict": 3, "rows": []}', "no 'verdict' and 'rows' lists"),
                                        ('{"verdict": [], "rows": []}', "no workload in it"),
                                        ('{"verdict": ["mixed"], "rows": []}', "a verdict without"),
                                        ('{"verdict": [{"workload": "nope", "saturation_load": 3}], "rows": []}', "a verdict without"),
                                        ('{"verdict": [{"workload": "mixed", "saturation_load": 0}], "rows": []}', "a verdict without")])
def test_a_file_that_is_not_a_dominance_json_is_a_value_error_naming_it(tmp_path, text, says):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"bad.json: .*{says}"):
        decode_capacity.dominance_points(path)
    assert decode_capacity.main(["--of", str(path)]) == 2


def test_replies_past_the_engines_context_are_refused():
    with pytest.raises(ValueError, match="pass the engines' 32,768-token context"):
        decode_capacity.workload_capacity("chat-single", 20.0, pd=False, reply_tokens=100_000)
