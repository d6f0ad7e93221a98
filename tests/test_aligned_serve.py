"""AlignedServe: quad-tree counters, the three search cases, borrowing directions, starvation and
batch-level scheduling, each on hand-computed instances.

Most tree cases use ``QuadTree(255, leaf_tokens=4, block_tokens=4)``: depth 3, root [0, 256),
level-1 nodes 64 tokens wide, level-2 nodes 16, leaves 4; a context of c tokens is in leaf c // 4
and holds ceil(c / 4) blocks.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from policies.aligned_quadtree import QuadTree
from policies.aligned_serve import AlignedServeConfig, AlignedServeScheduler, BatchDecision


def small_tree(requests: dict[str, int] | None = None, since: dict[str, float] | None = None) -> QuadTree:
    tree = QuadTree(255, leaf_tokens=4, block_tokens=4)
    for rid, tokens in (requests or {}).items():
        tree.insert(rid, tokens, (since or {}).get(rid, 0.0))
    return tree


def assert_counters_exact(tree: QuadTree, truth: dict[str, tuple[int, float]]) -> None:
    """Every node's (count, blocks, stamp) equals a brute-force recount of ``truth`` (rid -> tokens, since)."""
    for level in range(tree.depth + 1):
        shift = 2 * (tree.depth - level)
        for index in range(4**level):
            inside = [(t, s) for t, s in truth.values() if (t // tree.leaf_tokens) >> shift == index]
            node = tree.node(level, index)
            blocks = sum(math.ceil(t / tree.block_tokens) for t, _ in inside)
            stamp = min((s for _, s in inside), default=math.inf)
            assert (node.count, node.blocks, node.stamp) == (len(inside), blocks, stamp), (level, index)
    assert len(tree) == len(truth) and tree.total_blocks == tree.node(0, 0).blocks
    longest = max(truth, key=lambda r: (truth[r][0], r)) if truth else None
    assert tree.longest() == longest


# -- counters ---------------------------------------------------------------------------------

OP = st.tuples(st.sampled_from(["insert", "remove", "grow"]), st.integers(0, 11), st.integers(1, 255), st.integers(0, 9))
OPS = st.lists(OP, max_size=60)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_counters_stay_exact_under_insert_remove_grow(ops):
    tree, truth = small_tree(), {}
    for op, n, tokens, since in ops:
        rid = f"r{n}"
        if op == "insert" and rid not in truth:
            tree.insert(rid, tokens, float(since))
            truth[rid] = (tokens, float(since))
        elif op == "remove" and rid in truth:
            assert tree.remove(rid) == truth.pop(rid)[0]
        elif op == "grow" and rid in truth:
            step = tokens % 9  # 0 .. 8 tokens: stays in the leaf, crosses one, or a block boundary
            if truth[rid][0] + step > 255:
                with pytest.raises(ValueError):
                    tree.grow(rid, step)
            else:
                assert tree.grow(rid, step) == truth[rid][0] + step
                truth[rid] = (truth[rid][0] + step, truth[rid][1])
        assert_counters_exact(tree, truth)


def test_counters_stay_exact_over_a_long_seeded_decode_run():
    rng = random.Random(8)
    tree, truth = QuadTree(4096, leaf_tokens=16, block_tokens=16), {}
    for step in range(4000):
        rid = f"r{rng.randrange(300)}"
        if rid not in truth:
            tokens = rng.randint(1, 3000)
            tree.insert(rid, tokens, float(step))
            truth[rid] = (tokens, float(step))
        elif rng.random() < 0.1:
            tree.remove(rid)
            del truth[rid]
        else:
            tree.grow(rid)  # one decode step
            truth[rid] = (truth[rid][0] + 1, truth[rid][1])
        if step % 500 == 0:
            assert_counters_exact(tree, truth)
    assert_counters_exact(tree, truth)


def test_insert_and_grow_reject_bad_lengths_and_leave_the_tree_unchanged():
    tree = small_tree({"a": 250})
    with pytest.raises(ValueError):
        tree.insert("a", 10, 0.0)
    with pytest.raises(ValueError):
        tree.insert("b", 0, 0.0)
    with pytest.raises(ValueError):
        tree.grow("a", 6)
    assert_counters_exact(tree, {"a": (250, 0.0)})


# -- search: the three cases -------------------------------------------------------------------

@pytest.mark.parametrize(
    ("requests", "budget", "k_min", "rids", "blocks", "anchor", "borrowed"),
    [
        # case 1: the whole tree fits (2 + 3 + 3 = 8 blocks) and holds K_min requests
        ({"a": 8, "b": 9, "c": 10}, 8, 3, ("a", "b", "c"), 8, (0, 0), 0),
        # case 2: 109 blocks > 20; child 0 (3/9 req/block) beats child 3 (2/100) and fits with 3
        ({"a": 10, "b": 10, "c": 10, "d": 200, "e": 200}, 20, 3, ("a", "b", "c"), 9, (1, 0), 0),
        # case 2 picks density, not count: child 0 (1 req, 3 blocks) over child 1 (5 reqs, 90 blocks);
        # then case 3 borrows one from leaf 17, shortest rid first
        ({"a": 10, "p": 70, "q": 70, "r": 70, "s": 70, "t": 70}, 40, 2, ("a", "p"), 21, (1, 0), 1),
        # case 3 borrowing past the parent: from child 0 to leaf 35 (140 tokens) in child 2
        ({"a": 10, "b": 140, "c": 250}, 50, 2, ("a", "b"), 38, (1, 0), 1),
        # case 3 at the root: everything fits but only 4 exist, so the batch stays under K_min
        ({"a": 10, "b": 20, "c": 30, "d": 40}, 64, 8, ("a", "b", "c", "d"), 26, (0, 0), 0),
    ],
    ids=["case1-fits", "case2-densest-child", "case2-density-not-count", "case3-borrow-across-parent", "case3-too-few-overall"],
)
def test_search_cases(requests, budget, k_min, rids, blocks, anchor, borrowed):
    batch = small_tree(requests).search(budget, k_min, now=0.0)
    assert (batch.rids, batch.blocks, batch.anchor, batch.borrowed, batch.starved) == (rids, blocks, anchor, borrowed, False)


def test_search_descends_to_an_over_budget_leaf_and_takes_oldest_first():
    # 5 requests of 12 tokens (3 blocks) in leaf 3: every node on the way is over 7 blocks.
    since = {"r0": 5.0, "r1": 1.0, "r2": 3.0, "r3": 2.0, "r4": 4.0}
    batch = small_tree({rid: 12 for rid in since}, since).search(7, 3, now=10.0)
    assert (batch.rids, batch.blocks, batch.anchor, batch.borrowed) == (("r1", "r3"), 6, (3, 3), 0)


def test_search_on_an_empty_tree_and_bad_arguments():
    assert small_tree().search(10, 1, 0.0) is None
    with pytest.raises(ValueError):
        small_tree({"a": 1}).search(0, 1, 0.0)


def test_search_does_not_modify_the_tree():
    requests = {"a": 10, "b": 140, "c": 250}
    tree = small_tree(requests)
    tree.search(50, 2, now=0.0)
    assert_counters_exact(tree, {r: (t, 0.0) for r, t in requests.items()})


def test_worked_example_four_long_among_sixty_short_are_split():
    """Hand-computed on the paper's motivating mix (60 requests of 32 + 600 tokens, 4 of 4,096 + 600).

    Blocks of 16 tokens: short 632 -> 40 blocks (2,400 in all), long 4,696 -> 294 (1,176).
    B_max = 3,000, K_min = 8: the root (3,576) is over budget, level-1 child 0 (60 / 2,400) is
    denser than child 1 (4 / 1,176) and fits with 60 >= 8: case 1 there. The 4 long ones then
    fit at the root but are only 4 (case 3, nothing to borrow).
    """
    tree = QuadTree(8192, leaf_tokens=64, block_tokens=16)
    for i in range(60):
        tree.insert(f"s{i:02d}", 632, 0.0)
    for i in range(4):
        tree.insert(f"l{i}", 4696, 0.0)
    first = tree.search(3000, 8, now=0.0)
    assert (len(first.rids), first.blocks, first.anchor, set(first.rids)) == (60, 2400, (1, 0), {f"s{i:02d}" for i in range(60)})
    for rid in first.rids:
        tree.remove(rid)
    second = tree.search(3000, 8, now=0.0)
    assert (second.rids, second.blocks, second.anchor, second.borrowed) == (("l0", "l1", "l2", "l3"), 1176, (0, 0), 0)


# -- borrowing directions ----------------------------------------------------------------------

@pytest.mark.parametrize(
    ("requests", "target", "count", "reach", "expected"),
    [
        ({"L": 33, "R": 52}, 41, 1, 100, ("L",)),  # leaf 8 is 2 leaves left of leaf 10, leaf 13 is 3 right
        ({"L": 28, "R": 47}, 41, 1, 100, ("R",)),  # 3 left vs 1 right
        ({"L": 33, "R": 49}, 41, 1, 100, ("L",)),  # 2 and 2: ties go left
        ({"L": 33, "R": 49}, 41, 2, 100, ("L", "R")),
        ({"x": 40, "y": 43, "z": 45}, 42, 3, 100, ("y", "x", "z")),  # own leaf by distance first, then widen
        ({"p": 32, "q": 35}, 41, 1, 100, ("q",)),  # from a left leaf, longest first
        ({"p": 48, "q": 51}, 41, 1, 100, ("p",)),  # from a right leaf, shortest first
        ({"L": 5, "M": 20}, 100, 2, 200, ("M", "L")),  # only one side has requests
        ({"L": 20, "R": 60}, 41, 2, 15, ()),  # both beyond the reach
        ({"L": 30, "R": 60}, 41, 2, 15, ("L",)),
    ],
)
def test_nearest_scans_toward_the_closer_side(requests, target, count, reach, expected):
    assert small_tree(requests).nearest(target, count, reach) == expected


# Starving request s (100 tokens, waiting since 0) with a neighbour on each side and ballast z;
# the level-1 node holding them is over the 70-block budget, so the descent reaches s's level-2
# node [96, 112) (leaves 24..27), which fits but holds 1 < K_min = 2: borrow the nearer side.
@pytest.mark.parametrize(
    ("left", "right", "borrowed_rid"),
    [
        (88, 112, "r"),  # leaf 22 is 2 leaves left of the window, leaf 28 is 1 right
        (92, 112, "l"),  # 1 and 1: ties go left
        (92, 116, "l"),  # 1 left vs 2 right
    ],
)
def test_starved_search_borrows_from_the_nearer_side(left, right, borrowed_rid):
    tree = small_tree({"s": 100, "l": left, "r": right, "z": 250}, {"s": 0.0, "l": 50.0, "r": 50.0, "z": 50.0})
    batch = tree.search(70, 2, now=200.0, starvation_s=150.0)
    assert (batch.starved, batch.anchor, batch.borrowed) == (True, (2, 6), 1)
    assert set(batch.rids) == {"s", borrowed_rid}


# -- starvation --------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("now", "starved", "rids"),
    [
        (4.9, False, ("a", "b")),  # waited 4.9 s <= 5 s: density wins (child 0, the two short ones)
        (5.0, False, ("a", "b")),  # exactly at the threshold is not yet starving
        (5.1, True, ("b", "old")),  # past it: the descent follows old to child 3, which borrows b (nearest, left)
    ],
)
def test_starvation_promotes_the_oldest_request_past_the_slo_threshold(now, starved, rids):
    threshold = AlignedServeConfig(tpot_slo_ms=100.0, starvation_tokens=50.0).starvation_s
    assert threshold == pytest.approx(5.0)
    tree = small_tree({"a": 10, "b": 12, "old": 200}, {"a": 4.0, "b": 4.0, "old": 0.0})
    batch = tree.search(55, 2, now=now, starvation_s=threshold)  # 3 + 3 + 50 = 56 blocks: over budget
    assert (batch.starved, batch.rids) == (starved, rids)


# -- batch-level scheduling --------------------------------------------------------------------

def scheduler(**overrides) -> AlignedServeScheduler:
    base = dict(block_budget=64, min_batch=2, block_tokens=4, leaf_tokens=4, max_context_tokens=255,
                batch_buffer_size=1, request_buffer_size=0, refill_reach_tokens=64)
    return AlignedServeScheduler(AlignedServeConfig(**{**base, **overrides}))


def test_shortage_evicts_the_longest_request_and_never_switches_without_a_completion():
    s = scheduler()
    s.submit("a", 120, 0.0)  # 30 blocks
    s.submit("b", 124, 0.0)  # 31 blocks
    assert s.decide(0.0) == BatchDecision(("a", "b"), (), True)
    for step in range(4):
        s.on_iteration(step)
    assert s.running_blocks == 63 and s.decide(4.0) == BatchDecision()  # 124 + 128 tokens: 31 + 32
    s.on_iteration(4.0)
    assert s.running_blocks == 65
    assert s.decide(5.0) == BatchDecision((), ("b",), False)  # 129 tokens > 125
    assert s.decide(6.0) == BatchDecision()  # a alone is under K_min, but no request completed
    s.on_complete("a", 7.0)
    assert s.decide(7.0) == BatchDecision(("b",), (), True)
    assert s.running == ("b",)


def test_a_switch_evicts_the_longest_of_the_old_batch_first():
    s = scheduler()
    s.submit("a", 40, 0.0)  # 10 blocks
    s.submit("b", 44, 0.0)  # 11 blocks
    assert s.decide(0.0).admit == ("a", "b")
    s.submit("c", 30, 1.0)  # 8 blocks
    s.submit("d", 200, 1.0)  # 50 blocks, longer than anything in the old batch
    assert s.decide(1.0) == BatchDecision()  # (c, d) wait as the candidate batch
    s.on_complete("a", 2.0)
    # b alone is under K_min: switch to (c, d); 11 + 58 > 64, so the old batch's longest (b) goes.
    assert s.decide(2.0) == BatchDecision(("c", "d"), ("b",), True)
    assert set(s.running) == {"c", "d"} and s.running_blocks == 58


def test_completion_refills_from_the_request_buffer_before_switching_batches():
    s = scheduler(request_buffer_size=4)
    for rid, tokens in {"a": 40, "b": 44, "c": 48}.items():
        s.submit(rid, tokens, 0.0)
    assert s.decide(0.0).admit == ("a", "b", "c")  # 33 blocks, band = median 44
    s.submit("d", 46, 1.0)  # within 64 tokens of the band: request buffer
    s.submit("e", 200, 1.0)  # beyond it: candidate batch
    assert s.decide(1.0) == BatchDecision()
    s.on_complete("a", 2.0)
    assert s.decide(2.0) == BatchDecision(("d",), (), False)  # 3 still run: no switch
    s.on_complete("b", 3.0)
    s.on_complete("c", 3.0)
    assert s.decide(3.0) == BatchDecision(("e",), (), True)  # d alone < K_min: switch; 12 + 50 fit
    assert set(s.running) == {"d", "e"}


def test_cancelled_requests_leave_every_buffer():
    s = scheduler(request_buffer_size=4)
    for rid, tokens in {"a": 40, "b": 44}.items():
        s.submit(rid, tokens, 0.0)
    s.decide(0.0)
    s.submit("near", 46, 1.0)
    s.submit("far", 200, 1.0)
    s.decide(1.0)
    s.on_complete("near", 2.0)
    s.on_complete("far", 2.0)
    s.on_complete("unknown", 2.0)
    s.on_complete("a", 2.0)
    s.on_complete("b", 2.0)
    assert s.decide(3.0) == BatchDecision() and s.running == ()
    s.submit("far", 200, 4.0)  # the rid is free again
    assert s.decide(4.0).admit == ("far",)


def test_config_rejects_unknown_fields_and_requests_that_could_never_fit():
    with pytest.raises(ValidationError):
        AlignedServeConfig(block_budgett=10)
    with pytest.raises(ValidationError, match="never run"):
        AlignedServeConfig(block_budget=10, block_tokens=16, max_context_tokens=161)
    with pytest.raises(ValueError):
        s = scheduler()
        s.submit("a", 10, 0.0)
        s.submit("a", 12, 0.0)


def test_random_runs_keep_the_budget_and_every_request_in_one_place():
    rng = random.Random(3)
    s = scheduler(block_budget=80, min_batch=3, batch_buffer_size=2, request_buffer_size=3)
    tokens: dict[str, int] = {}  # the runner's view: context length of every live request
    on_gpu: set[str] = set()
    for step in range(3000):
        now = float(step)
        finished = [r for r in on_gpu if tokens[r] == 255 or rng.random() < 0.02]  # at the cap, or done
        if step % 7 == 0:
            tokens[f"r{step}"] = rng.randint(1, 200)
            s.submit(f"r{step}", tokens[f"r{step}"], now)
        elif step % 11 == 0 and tokens:
            finished.append(rng.choice(sorted(tokens)))  # cancelled wherever it is
        for rid in set(finished):
            s.on_complete(rid, now)
            del tokens[rid]
            on_gpu.discard(rid)
        if on_gpu and step % 2:
            s.on_iteration(now)
            tokens.update({r: tokens[r] + 1 for r in on_gpu})
        decision = s.decide(now)
        assert not set(decision.admit) & on_gpu and set(decision.evict) <= on_gpu
        on_gpu = (on_gpu | set(decision.admit)) - set(decision.evict)
        assert set(s.running) == on_gpu <= set(tokens)
        assert s.running_blocks == sum(math.ceil(tokens[r] / 4) for r in on_gpu) <= 80
