"""The pressure controller in virtual time: a scripted shift moves an engine, restarts are counted, nothing is lost."""

from __future__ import annotations

import pytest
import yaml

from laps.config import DEFAULT_CONFIG_PATH, parse_config
from laps.tokenizer import load_tokenizer
from loadgen.runner import Arrival
from loadgen.virtual import VirtualRun
from loadgen.workloads import Conversation, Turn

TOK = load_tokenizer()
DOCUMENT = "The harbour master logged every ship that came in. " * 600  # ≈ 6,000 tokens: a long prefill (each
# document starts with its own name, so no two share a cached prefix)


THREE = (("sp0", "short-prefill"), ("sp1", "short-prefill"), ("lp0", "long-prefill"))


def run(*arrivals: Arrival, drain_timeout_s: float = 60.0, ignore_eos: bool = False, engines=THREE) -> tuple[VirtualRun, list]:
    """``engines`` (default two short-prefill engines and one long-prefill); ψ = backlog in thousands of tokens; decisions every second.

    The ``pools`` policy (each class only to its pool) keeps the scripted pressures simple: ``laps`` itself lets long
    prefills spill into an idle short pool, so these bursts would build no long-pool backlog to move an engine for.
    """
    data = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    data["scheduling"] = {"policy": "pools"}
    data["engines"] = [{"name": n, "kind": "sim", "role": r, "gpus": [i]} for i, (n, r) in enumerate(engines)]
    data["controller"] = dict(enabled=True, interval_s=1.0, queue_weight=1.0, sla_weight=0.0, utilisation_weight=0.0,
                              hysteresis=0.5, cooldown_s=1000.0, drain_timeout_s=drain_timeout_s, sim_restart_s=5.0)
    virtual = VirtualRun(parse_config(data), TOK, ignore_eos=ignore_eos)
    return virtual, virtual.run(list(arrivals), duration_s=60.0)


def documents(n: int, start_s: float) -> list[Arrival]:
    return [Arrival(start_s, Conversation(f"doc{start_s:g}-{i}", "test", (Turn(f"Document {start_s:g}-{i}. {DOCUMENT}", 4),)), ()) for i in range(n)]


def test_a_burst_of_documents_moves_a_short_engine_to_the_long_pool():
    virtual, records = run(*documents(20, 0.5), *documents(20, 7.0))
    # At the 1 s decision the long pool holds ~100k backlog tokens and the idle short pool none: the idle
    # short engine with the smallest id moves, drains at once and is back 5 s later as a long-prefill engine.
    assert virtual.moves == [{"engine": "sp0", "from_pool": "short", "to_pool": "long", "role": "long-prefill", "kind": "restart",
                              "ok": True, "start_s": 1.0, "drain_s": 0.0, "restart_s": 5.0, "end_s": 6.0, "drain_failed": 0}]
    assert (virtual.restart_engine_s, virtual.drain_engine_s, virtual.controller.moves) == (5.0, 0.0, 1)
    assert virtual.registry["sp0"].pool == "long" and virtual.engines["sp0"].core.config.chunked_prefill_size == 16384
    # Its request slots are the long-prefill role's now (config.yaml: 64, the short-prefill role's 256), as the live
    # gateway reads them from /v1/loads after a restart, and the scheduler sees them.
    assert [(v.id, v.max_running_requests) for v in virtual.registry.views()] == [("sp0", 64), ("sp1", 256), ("lp0", 64)]
    # The second burst (7 s) is shared by both long engines; the fresh sp0 started with an empty cache.
    assert virtual.engines["sp0"].core.stats().total_prefill_uncached_tokens > 0
    assert len(records) == 40 and all(r.ok for r in records)
    # The log holds every decision's view of the pools: before the move, while sp0 restarts (in no pool), after.
    seen = {row["t"]: (row["pool_size_short"], row["pool_size_long"]) for row in virtual.control_log}
    assert (seen[1.0], seen[2.0], seen[5.0], seen[6.0]) == ((2, 1), (1, 1), (1, 1), (1, 2))


def test_requests_still_running_at_the_drain_timeout_fail_explicitly_and_none_is_lost():
    # Two chats at 0.1 s go to the short pool's least-loaded engines, two at 0.2 s likewise: both are busy when one moves.
    chats = [Arrival(0.1 * (1 + i // 2), Conversation(f"chat{i}", "test", (Turn(f"Tell me a long story about ship {i}.", 3000),)), ())
             for i in range(4)]
    virtual, records = run(*chats, *documents(20, 0.5), drain_timeout_s=2.0, ignore_eos=True)
    (move,) = virtual.moves
    assert (move["from_pool"], move["start_s"], move["drain_s"], move["restart_s"], move["end_s"]) == ("short", 1.0, 2.0, 5.0, 8.0)
    assert (virtual.drain_engine_s, virtual.restart_engine_s) == (2.0, 5.0)
    # Every request sent has a record: answered, or failed with the gateway's 502 when its engine stopped.
    assert sorted(r.conversation_id for r in records) == sorted([f"chat{i}" for i in range(4)] + [f"doc0.5-{i}" for i in range(20)])
    failed = [r for r in records if not r.ok]
    assert move["engine"] == "sp0" and sorted(r.conversation_id for r in failed) == ["chat0", "chat2"] and move["drain_failed"] == 2
    assert all(r.error.startswith(f"HTTP 502: engine {move['engine']} ") and r.end_s == pytest.approx(3.0) for r in failed)
    assert all(r.ok for r in records if r not in failed)


def test_an_empty_long_pool_is_refilled_and_the_run_summary_reports_the_move():
    # No long engine at all: the 1 s decision finds the long pool empty, the 2 s one too, so the idle short engine
    # with the smallest id moves (no hysteresis, no cooldown: the pool cannot serve its class) and is back 5 s later.
    chat = Arrival(0.1, Conversation("chat", "test", (Turn("Tell me about the moon.", 8),)), ())
    virtual, records = run(chat, *documents(1, 10.0), engines=(("sp0", "short-prefill"), ("sp1", "short-prefill")))
    assert virtual.moves == [{"engine": "sp0", "from_pool": "short", "to_pool": "long", "role": "long-prefill", "kind": "restart",
                              "ok": True, "start_s": 2.0, "drain_s": 0.0, "restart_s": 5.0, "end_s": 7.0, "drain_failed": 0}]
    assert len(records) == 2 and all(r.ok for r in records) and records[-1].laps_class == "long"
    assert virtual.summary()["controller"] == {"decisions": len(virtual.control_log), "moves": virtual.moves,
                                               "restart_engine_s": 5.0, "drain_engine_s": 0.0}


def test_decisions_stop_once_no_request_is_active_or_pending():
    # Each request leaves a request-timeout event 300 s ahead; those must not keep the controller deciding.
    chat = Arrival(0.1, Conversation("chat", "test", (Turn("Tell me about the moon.", 8),)), ())
    virtual, records = run(chat, *documents(2, 3.0))
    last_end_s = max(r.end_s for r in records)
    times = [row["t"] for row in virtual.control_log]
    assert times == [float(t) for t in range(1, len(times) + 1)]  # one per second from 1 s, none skipped
    assert times[-1] - 1.0 < last_end_s <= times[-1]  # the first decision that finds nothing left is the last


def test_a_move_between_roles_with_the_same_flags_is_instant():
    data = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    flags = {"chunked-prefill-size": 8192, "schedule-policy": "shortest-prefill-first"}
    data["roles"] = {"short-prefill": {"pool": "short", "flags": flags}, "long-prefill": {"pool": "long", "flags": dict(flags)},
                     "other": {"pool": "long", "flags": {"chunked-prefill-size": 4096}}}
    data["engines"] = [{"name": n, "kind": "sim", "role": r, "gpus": [i]} for i, (n, r) in enumerate(THREE)]
    data["controller"] = dict(enabled=True, interval_s=1.0, queue_weight=1.0, sla_weight=0.0, utilisation_weight=0.0,
                              hysteresis=0.5, cooldown_s=0.0, sim_restart_s=5.0)
    data["scheduling"] = {"policy": "pools"}
    config = parse_config(data)
    assert config.instant_move("short-prefill", "long-prefill") and not config.instant_move("short-prefill", "other")
    virtual = VirtualRun(config, TOK)
    records = virtual.run(documents(20, 0.5), duration_s=60.0)
    # The same burst as above moves sp0 at the 1 s decision, but with no drain and no restart: it serves the
    # long pool from that instant.
    assert virtual.moves[0] == {"engine": "sp0", "from_pool": "short", "to_pool": "long", "role": "long-prefill", "kind": "instant",
                                "ok": True, "start_s": 1.0, "drain_s": 0.0, "restart_s": 0.0, "end_s": 1.0, "drain_failed": 0}
    assert virtual.restart_engine_s == 0.0 and all(r.ok for r in records)
