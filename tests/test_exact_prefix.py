"""The exact prefix cache rebuilt from KV cache events, against the radix tree that emitted them."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.sim.radix import RadixCache
from policies.exact_prefix import AllBlocksCleared, BlockRemoved, BlockStored, EngineBlocks, EventsOutOfStep, PrefixCaches
from policies.prefix_index import BlockChain, PrefixIndex


def chain(ids, block_tokens=4):
    return BlockChain(block_tokens).extend(ids)


def test_a_hit_ends_inside_a_block_at_the_last_cached_page():
    blocks = EngineBlocks(block_tokens=4)
    blocks.apply([BlockStored([11, 12, 13, 14, 15, 16], None, [1, 2, 3, 4, 5, 6], 1)])
    assert blocks.cached_tokens(chain([1, 2, 3, 4, 5, 6, 7, 8, 9])) == 6
    assert blocks.cached_tokens(chain([1, 2, 3, 4, 5, 9, 9])) == 5
    assert blocks.cached_tokens(chain([1, 2, 9])) == 2
    assert blocks.cached_tokens(chain([9, 2, 3, 4, 5, 6, 7])) == 0
    assert blocks.cached_tokens(chain([1, 2, 3, 4, 5, 6])) == 5  # the engine computes at least the last token
    assert blocks.cached_tokens(chain([])) == 0


def test_stores_chain_on_their_parent_and_removals_take_pages_off_the_end():
    blocks = EngineBlocks(block_tokens=4)
    blocks.apply([BlockStored([11, 12, 13], None, [1, 2, 3], 1), BlockStored([24, 25], 13, [4, 5], 1),
                  BlockStored([34], 13, [7], 1)])  # a branch after token 3
    assert blocks.cached_tokens(chain([1, 2, 3, 4, 5, 0])) == 5
    assert blocks.cached_tokens(chain([1, 2, 3, 7, 0])) == 4
    blocks.apply([BlockRemoved([25]), BlockRemoved([34])])
    assert blocks.cached_tokens(chain([1, 2, 3, 4, 5, 0])) == 4
    assert blocks.cached_tokens(chain([1, 2, 3, 7, 0])) == 3
    blocks.apply([AllBlocksCleared()])
    assert len(blocks) == 0 and blocks.cached_tokens(chain([1, 2, 3, 4, 5, 0])) == 0


def test_pages_of_two_tokens_count_whole_pages_only():
    blocks = EngineBlocks(block_tokens=4, page_tokens=2)
    blocks.apply([BlockStored([1, 2, 3], None, [5, 6, 7, 8, 9, 10], 2)])
    assert blocks.cached_tokens(chain([5, 6, 7, 8, 9, 10, 11, 12])) == 6
    assert blocks.cached_tokens(chain([5, 6, 7, 8, 9, 0, 0])) == 4
    assert blocks.cached_tokens(chain([5, 6, 7, 8, 9, 10])) == 4  # at most prompt - 1, rounded down to a page
    with pytest.raises(ValueError, match="must divide"):
        EngineBlocks(block_tokens=4, page_tokens=3)


def test_events_that_do_not_fit_are_refused():
    blocks = EngineBlocks(block_tokens=4)
    with pytest.raises(EventsOutOfStep, match="not cached"):
        blocks.apply([BlockStored([2], 1, [5], 1)])
    with pytest.raises(EventsOutOfStep, match="not cached"):
        blocks.apply([BlockRemoved([7])])
    with pytest.raises(EventsOutOfStep, match="page size is 1"):
        blocks.apply([BlockStored([2], None, [5, 6], 2)])


def test_prefix_caches_are_exact_for_followed_engines_and_estimate_the_others():
    caches = PrefixCaches(PrefixIndex(block_tokens=4))
    prompt = chain([1, 2, 3, 4, 5, 6, 7, 8, 9])
    caches.insert("a", prompt.keys)
    caches.insert("b", prompt.keys)
    assert caches.cached_tokens("a", prompt) == 8  # the estimate: whole blocks
    caches.follow("a")
    assert caches.is_exact("a") and caches.cached_tokens("a", prompt) == 0
    assert caches.apply("a", [BlockStored([1, 2, 3, 4, 5, 6, 7], None, [1, 2, 3, 4, 5, 6, 7], 1)])
    assert caches.cached_tokens("a", prompt) == 7 and caches.cached_tokens("b", prompt) == 8
    assert not caches.apply("a", [BlockRemoved([99])])  # out of step: back to the estimate
    assert not caches.is_exact("a") and caches.cached_tokens("a", prompt) == 8
    caches.follow("a")
    caches.forget_engine("a")
    assert not caches.is_exact("a") and caches.cached_tokens("a", prompt) == 0


ops = st.lists(st.one_of(
    st.tuples(st.just("insert"), st.lists(st.integers(0, 3), min_size=1, max_size=30)),
    st.tuples(st.just("evict"), st.integers(1, 40)),
    st.tuples(st.just("reset"), st.just(0)),
), max_size=25)


@settings(max_examples=300, deadline=None)
@given(ops=ops, prompts=st.lists(st.lists(st.integers(0, 3), max_size=40), min_size=1, max_size=5),
       block_tokens=st.sampled_from([1, 2, 4, 16]))
def test_the_hit_from_events_is_the_trees_own_match(ops, prompts, block_tokens):
    events = []
    tree = RadixCache(events)
    for op, arg in ops:
        if op == "insert":
            tree.insert(arg)
        elif op == "evict":
            tree.evict(arg)
        else:
            tree.reset()
        tree.match_prefix(arg if op == "insert" else [0])  # splits, which publish nothing
    blocks = EngineBlocks(block_tokens)
    blocks.apply(events)
    for ids in prompts:
        expected = min(tree.peek_prefix(ids), max(len(ids) - 1, 0))
        assert blocks.cached_tokens(BlockChain(block_tokens).extend(ids)) == expected
