"""The KV transfer model: bytes, presets, and max-min fair sharing of engine ports."""

import pytest

from engines.sim.kv_transfer import LINKS, KvTransferNetwork, kv_transfer_bytes
from engines.sim.latency import MODELS

GB = 1e9


def test_bytes_of_a_qwen_7b_prompt_per_tensor_parallel_rank():
    # 28 layers x 2 (K, V) x 4 kv heads x 128 head dim x 2 bytes = 57,344 B per token; 1000 tokens:
    assert kv_transfer_bytes(MODELS["qwen2.5-7b"].kv_bytes_per_token, 1000) == 57_344_000
    assert kv_transfer_bytes(MODELS["qwen2.5-7b"].kv_bytes_per_token, 1000, tp_size=2) == 28_672_000  # each rank its half
    with pytest.raises(ValueError, match="tokens must be >= 0"):
        kv_transfer_bytes(57_344, -1)
    with pytest.raises(ValueError, match="tp_size must be >= 1, got 0"):
        kv_transfer_bytes(57_344, 10, tp_size=0)


def test_link_presets():
    assert [LINKS[n].bandwidth_bytes_per_s for n in ("nvlink", "infiniband", "tcp")] == [450e9, 50e9, 12.5e9]


def test_solo_transfer_time_is_bytes_over_bandwidth():
    # 1000 Qwen-7B tokens over InfiniBand: 57,344,000 B / 50e9 B/s = 1.14688 ms.
    net = KvTransferNetwork(LINKS["infiniband"].bandwidth_bytes_per_s)
    net.start("r", "p0", "d0", 57_344_000, now=2.0)
    assert net.next_done_s() == pytest.approx(2.0 + 0.00114688, abs=1e-12)
    assert net.pop_done(2.001) == []
    (t,) = net.pop_done(2.01)
    assert (t.tid, t.end_s, t.inflation) == ("r", pytest.approx(2.00114688, abs=1e-12), pytest.approx(1.0))
    assert net.in_flight == 0 and net.next_done_s() is None


def test_a_burst_from_one_engine_shares_its_egress():
    # 4 equal transfers of 1 GB leave p0 at once over 10 GB/s: each gets 2.5 GB/s, all end at 0.4 s (4 solo times).
    net = KvTransferNetwork(10 * GB)
    for i in range(4):
        net.start(f"r{i}", "p0", f"d{i}", 1 * GB, now=0.0)
    done = net.pop_done(1.0)
    assert [t.tid for t in done] == ["r0", "r1", "r2", "r3"]
    assert [t.end_s for t in done] == pytest.approx([0.4] * 4, abs=1e-12)
    assert [t.inflation for t in done] == pytest.approx([4.0] * 4)


def test_unshared_links_give_every_transfer_the_full_bandwidth():
    net = KvTransferNetwork(10 * GB, shared=False)
    for i in range(4):
        net.start(f"r{i}", "p0", "d0", 1 * GB, now=0.0)
    assert [t.end_s for t in net.pop_done(1.0)] == pytest.approx([0.1] * 4, abs=1e-12)


def test_rates_are_recomputed_when_a_transfer_ends():
    # 10 GB/s. a: 1 GB p0->d0, b: 3 GB p0->d1, both from t=0: 5 GB/s each; a ends at 0.2 s with b at 2 GB left,
    # which then runs at 10 GB/s: ends at 0.4 s.
    net = KvTransferNetwork(10 * GB)
    net.start("a", "p0", "d0", 1 * GB, 0.0)
    net.start("b", "p0", "d1", 3 * GB, 0.0)
    (a,) = net.pop_done(net.next_done_s())
    assert a.end_s == pytest.approx(0.2, abs=1e-12)
    (b,) = net.pop_done(1.0)
    assert b.end_s == pytest.approx(0.4, abs=1e-12)
    assert b.inflation == pytest.approx(0.4 / 0.3)


def test_max_min_fairness_across_egress_and_ingress():
    # 10 GB/s ports. x: p0->d0, y: p1->d0, z: p1->d1 (1 GB each). d0's ingress and p1's egress each carry two:
    # progressive filling fixes all three at 5 GB/s (no port can give more), so all end at 0.2 s;
    # then a fourth, w: p2->d2, alone on its ports, runs at 10 GB/s.
    net = KvTransferNetwork(10 * GB)
    for tid, src, dst in (("x", "p0", "d0"), ("y", "p1", "d0"), ("z", "p1", "d1")):
        net.start(tid, src, dst, 1 * GB, 0.0)
    w = net.start("w", "p2", "d2", 1 * GB, 0.0)
    assert w.rate_bytes_per_s == 10 * GB
    done = {t.tid: t.end_s for t in net.pop_done(1.0)}
    assert done == {"w": pytest.approx(0.1), "x": pytest.approx(0.2), "y": pytest.approx(0.2), "z": pytest.approx(0.2)}


def test_unequal_bottlenecks_leave_spare_capacity_to_others():
    # x: p0->d0, y: p0->d1, z: p1->d1, v: p2->d1. d1's ingress has three (y, z, v) -> 10/3 each;
    # then p0's egress has 10 - 10/3 left for x alone: 20/3 GB/s.
    net = KvTransferNetwork(10 * GB)
    started = [net.start(tid, src, dst, 1 * GB, 0.0)
               for tid, src, dst in (("x", "p0", "d0"), ("y", "p0", "d1"), ("z", "p1", "d1"), ("v", "p2", "d1"))]
    rates = {t.tid: t.rate_bytes_per_s for t in started}
    assert rates == {"x": pytest.approx(20 / 3 * GB), "y": pytest.approx(10 / 3 * GB),
                     "z": pytest.approx(10 / 3 * GB), "v": pytest.approx(10 / 3 * GB)}


def test_cancel_frees_bandwidth_and_time_cannot_go_back():
    net = KvTransferNetwork(10 * GB)
    net.start("a", "p0", "d0", 2 * GB, 0.0)
    net.start("b", "p0", "d1", 2 * GB, 0.0)
    cancelled = net.cancel("a", 0.2)  # both at 5 GB/s until 0.2 s: b has 1 GB left, then 10 GB/s
    assert cancelled is not None and cancelled.end_s is None
    assert net.cancel("a", 0.2) is None
    (b,) = net.pop_done(1.0)
    assert b.end_s == pytest.approx(0.3, abs=1e-12)
    with pytest.raises(ValueError, match="time went backwards"):
        net.start("c", "p0", "d0", 1, 0.5)
    with pytest.raises(ValueError, match="already in flight"):
        net.start("d", "p0", "d0", 1, 1.0)
        net.start("d", "p0", "d0", 1, 1.0)
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        KvTransferNetwork(0)
