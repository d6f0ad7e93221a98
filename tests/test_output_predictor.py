"""The output-length predictor: exact predictions on scripted conversation histories."""

from __future__ import annotations

import pytest

from policies.output_predictor import OutputPredictor, reply_token_counts


def test_history_predictions_on_a_scripted_conversation():
    p = OutputPredictor("history", prior_tokens=28, prior_weight=2)
    assert p.predict(None, ()) == 28  # first turn: the prior
    assert p.predict(None, (10,)) == 22  # (2*28 + 10) / 3
    assert p.predict(None, (10, 41)) == 27  # (56 + 51) / 4 = 26.75
    assert p.predict(None, (10, 40)) == 27  # 26.5 rounds half up
    assert p.predict(None, (100, 100, 100, 100)) == 76  # (56 + 400) / 6 = 76
    assert p.history_estimate((10, 40)) == 26.5


def test_the_cap_bounds_the_history_estimate():
    p = OutputPredictor("history", prior_tokens=28, prior_weight=2)
    assert p.predict(20, ()) == 20
    assert p.predict(500, (100, 100, 100, 100)) == 76
    assert p.predict(1, (400,)) == 1


def test_small_estimates_never_drop_below_one_token():
    assert OutputPredictor("history", prior_tokens=1, prior_weight=0.5).predict(None, (0, 0, 0)) == 1


def test_max_tokens_source_trusts_the_cap_and_falls_back_to_history_without_one():
    p = OutputPredictor("max_tokens", prior_tokens=28, prior_weight=2)
    assert p.predict(300, (10,)) == 300
    assert p.predict(None, (10,)) == 22


@pytest.mark.parametrize("kwargs", [{"prior_tokens": 0.5}, {"prior_weight": 0}, {"source": "oracle"}])
def test_bad_parameters_are_refused(kwargs):
    with pytest.raises(ValueError):
        OutputPredictor(**kwargs)


def test_reply_token_counts_counts_assistant_messages_oldest_first():
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "hello how are you"},
        {"role": "user", "content": "fine"},
        {"role": "assistant", "content": "good"},
        {"role": "user", "content": "bye"},
    ]
    assert reply_token_counts(messages, str.split) == (4, 1)
    assert reply_token_counts(messages[:2], str.split) == ()
