"""The per-engine prefix index: chained block keys, hits, LRU bound, correction by reported cached tokens."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.prefix_index import CHAIN_OVERHEAD_BYTES, BlockChain, PrefixIndex, block_keys


def test_block_keys_are_chained_over_full_blocks():
    a = block_keys(list(range(40)), 16)
    b = block_keys(list(range(32)) + [99] * 8, 16)
    c = block_keys([7] + list(range(1, 40)), 16)
    assert len(a) == 2 and a == b  # the trailing partial block has no key
    assert c[0] != a[0] and c[1] != a[1]  # a change in block 0 changes every later key


def test_hit_is_the_longest_leading_run_of_blocks():
    index = PrefixIndex(block_tokens=4, max_blocks=100)
    turn1 = list(range(10))  # 2 full blocks
    index.insert("e0", block_keys(turn1, 4))
    turn2 = turn1 + list(range(100, 110))  # same history, new message: 5 full blocks
    keys = block_keys(turn2, 4)
    assert index.cached_tokens("e0", keys) == 8
    assert index.cached_tokens("e1", keys) == 0
    other = block_keys([5] + turn2[1:], 4)
    assert index.cached_tokens("e0", other) == 0


def test_lru_bound_evicts_least_recently_used_blocks():
    index = PrefixIndex(block_tokens=2, max_blocks=4)
    a, b = block_keys([1, 2, 3, 4], 2), block_keys([5, 6, 7, 8], 2)
    index.insert("e", a)
    index.insert("e", b)
    index.insert("e", a[:1])  # refresh a's first block
    index.insert("e", block_keys([9, 9], 2))  # one more: the oldest (a[1]) goes
    assert index.blocks("e") == 4
    assert index.cached_tokens("e", a) == 2
    assert index.cached_tokens("e", b) == 4


def test_observe_forgets_blocks_older_than_an_evicted_one_and_inserts_the_prompt():
    index = PrefixIndex(block_tokens=2, max_blocks=100)
    old = block_keys([1, 1, 2, 2], 2)
    conv = block_keys([3, 3, 4, 4, 5, 5], 2)
    newer = block_keys([6, 6], 2)
    for keys in (old, conv, newer):
        index.insert("e", keys)
    turn2 = block_keys([3, 3, 4, 4, 5, 5, 7, 7], 2)
    assert index.cached_tokens("e", turn2) == 6
    index.observe("e", turn2, reported_cached_tokens=2)  # the engine had evicted conv[1]
    assert index.cached_tokens("e", old) == 0  # older than the evicted block: gone
    assert index.cached_tokens("e", newer) == 2  # newer: kept
    assert index.cached_tokens("e", turn2) == 8  # the engine just computed the whole prompt


def test_observe_with_a_correct_estimate_forgets_nothing():
    index = PrefixIndex(block_tokens=2, max_blocks=100)
    first = block_keys([1, 1, 2, 2], 2)
    index.insert("e", first)
    index.observe("e", block_keys([1, 1, 2, 2, 3, 3], 2), reported_cached_tokens=5)
    assert index.blocks("e") == 3


def test_forget_engine_and_bad_arguments():
    index = PrefixIndex(block_tokens=2, max_blocks=10)
    index.insert("e", block_keys([1, 2], 2))
    index.forget_engine("e")
    assert index.blocks("e") == 0
    with pytest.raises(ValueError):
        PrefixIndex(block_tokens=0)


def test_byte_budget_is_split_over_engines_and_kv_capacity_caps_each():
    from policies.prefix_index import BYTES_PER_BLOCK_ENTRY

    index = PrefixIndex.from_byte_budget(block_tokens=4, budget_bytes=40 * BYTES_PER_BLOCK_ENTRY, engines=2)
    assert index.max_blocks == 20
    index.insert("a", block_keys(list(range(200)), 4))  # 50 blocks offered, 20 kept (the newest)
    assert index.blocks("a") == 20
    index.set_capacity("a", kv_tokens=32)  # the engine's KV pool holds 8 blocks: trim now
    assert index.blocks("a") == index.capacity("a") == 8
    assert index.capacity("b") == 20
    assert index.cached_tokens("a", block_keys(list(range(200)), 4)) == 0  # the oldest (leading) blocks went first
    with pytest.raises(ValueError, match="too small"):
        PrefixIndex.from_byte_budget(4, 10, 2)


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.lists(st.integers(0, 151_000), max_size=40), max_size=6), block_tokens=st.integers(1, 17))
def test_block_chain_extended_piece_by_piece_equals_block_keys_of_the_whole(parts, block_tokens):
    chain = BlockChain(block_tokens)
    whole: list[int] = []
    for part in parts:
        before = chain
        chain = chain.extend(part)
        whole += part
        assert list(chain.keys) == block_keys(whole, block_tokens)
        assert list(chain.tail) == whole[len(whole) - len(whole) % block_tokens:] and chain.tokens == len(whole)
        assert list(chain.ids) == whole
        assert before.tokens == len(whole) - len(part)  # extend never changes the chain it extends
    assert chain.nbytes == 8 * len(chain.keys) + 4 * len(whole) + CHAIN_OVERHEAD_BYTES


def test_a_prefill_reported_after_its_own_first_token_forgets_nothing_of_other_prompts():
    # Another conversation's blocks, then this request: routed with nothing cached, its prefill's blocks go in at
    # its first token, and the engine reports 16 of its tokens cached. Block 1 is in the index only because the
    # request put it there: no eviction, and the other conversation's blocks stay.
    index = PrefixIndex(16, 4096)
    index.insert("e", [100, 101, 102])
    index.insert_prefilled("e", [1, 2, 3], routed_cached_tokens=0)
    index.observe("e", [1, 2, 3, 4], 16, routed_cached_tokens=0)
    assert index.cached_tokens("e", [100, 101, 102]) == 48 and index.cached_tokens("e", [1, 2, 3, 4]) == 64
    # Routed with 48 tokens cached but only 16 reported: block 1 was evicted, and with it every block used before it.
    index.insert("e", [7, 8])
    index.observe("e", [1, 2, 3, 4], 16, routed_cached_tokens=48)
    assert index.cached_tokens("e", [100, 101, 102]) == 0 and index.cached_tokens("e", [7, 8]) == 32


def test_a_whole_hit_on_a_prompt_of_whole_blocks_is_no_eviction():
    # The engine reports at most prompt - 1 tokens cached (it computes the last one again): 31 of a 32-token prompt
    # it holds whole. Nothing was evicted, so the other prompt's blocks stay.
    index = PrefixIndex(16, 4096)
    index.insert("e", [100, 101, 102])
    index.insert("e", [1, 2])
    index.observe("e", [1, 2], 31, routed_cached_tokens=32)
    assert index.cached_tokens("e", [100, 101, 102]) == 48


def test_a_first_token_inserts_only_the_blocks_past_those_it_was_routed_by():
    index = PrefixIndex(16, max_blocks=5)
    index.insert("e", [1, 2])
    index.insert("e", [100])
    index.insert_prefilled("e", [1, 2, 3, 4], routed_cached_tokens=32)  # blocks 1 and 2 keep their place, behind 100
    index.insert("e", [200])  # a sixth block: the least recently used, block 1, goes
    assert index.cached_tokens("e", [1, 2, 3, 4]) == 0 and index.cached_tokens("e", [100]) == 16
