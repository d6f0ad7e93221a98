"""Prefills in flight: what each engine will hold once they are done, in the views the schedulers get."""

from policies.admission import classified_view_of_chain
from policies.classifier import ThresholdClassifier
from policies.exact_prefix import PrefixCaches
from policies.in_flight_prefix import InFlightPrefills
from policies.prefix_index import BlockChain, PrefixIndex


def chain(ids, block_tokens=4) -> BlockChain:
    return BlockChain(block_tokens).extend(ids)


DOC = list(range(100, 112))  # three blocks of four


def test_a_prompt_shares_the_whole_blocks_of_a_prefill_in_flight_on_that_engine_until_it_ends():
    flights = InFlightPrefills(block_tokens=4)
    flights.start("doc", "a", chain(DOC).keys)
    question = chain(DOC[:10] + [7, 7, 7])  # 13 tokens, the document's first two blocks and two more tokens
    assert flights.shared_tokens("a", question) == 8 and flights.shared_tokens("b", question) == 0
    assert flights.by_engine(question, ["a", "b"]) == {"a": 8}
    assert flights.shared_tokens("a", chain(DOC)) == 11  # all 12 of them, less the one the engine computes itself
    assert flights.shared_tokens("a", chain([1] + DOC)) == 0  # a prefix, not a substring
    flights.end("doc")
    assert len(flights) == 0 and flights.shared_tokens("a", question) == 0 and flights.by_engine(question, ["a"]) == {}
    flights.end("doc")  # ended twice: nothing happens


def test_two_prefills_of_one_prefix_count_until_both_end_and_a_second_start_moves_a_request():
    flights = InFlightPrefills(block_tokens=4)
    flights.start("d1", "a", chain(DOC).keys)
    flights.start("d2", "a", chain(DOC[:8]).keys)
    flights.end("d1")
    assert flights.shared_tokens("a", chain(DOC)) == 8  # d2's two blocks are still in flight
    flights.start("d2", "b", chain(DOC[:8]).keys)  # started again: its earlier start ends
    assert (flights.shared_tokens("a", chain(DOC)), flights.shared_tokens("b", chain(DOC))) == (0, 8)
    flights.start("d3", "b", chain(DOC).keys)
    flights.forget_engine("b")
    assert len(flights) == 0 and flights.shared_tokens("b", chain(DOC)) == 0


def test_the_view_credits_a_prefill_in_flight_per_engine_but_classifies_by_what_is_cached():
    caches = PrefixCaches(PrefixIndex(block_tokens=4))
    caches.insert("b", chain(DOC[:4]).keys)  # b caches the first block
    caches.in_flight.start("doc", "a", chain(DOC).keys)  # a is prefilling the whole document
    view = classified_view_of_chain("q", chain(DOC + [5, 6]), 0.0, 0.4, ["a", "b"], caches, ThresholdClassifier(8))
    assert (view.cached_tokens, dict(view.cached_by_engine), dict(view.in_flight_by_engine)) == (4, {"a": 0, "b": 4}, {"a": 12})
    assert (view.new_tokens, view.request_class) == (10, "long")
    caches.forget_engine("a")
    assert caches.in_flight.shared_tokens("a", chain(DOC)) == 0
