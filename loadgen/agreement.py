"""Live against virtual: the same workload through the running gateway and through :mod:`loadgen.virtual`.

The virtual run models no HTTP hop or tokenization. To compare like with like,
:func:`serving_latency` measures that path on the live stack first: isolated
requests (one at a time, the engines idle) are sent live and simulated, and
the median difference of their TTFTs is the serving latency the virtual run
then adds (half on the way in, half on the way out). Everything under load —
queueing, batching, chunking, the scheduler's windows, decode interference —
is left to the model.
"""

from __future__ import annotations

import statistics

from laps.config import Config
from laps.tokenizer import ChatTokenizer
from loadgen.runner import RequestRecord, run_loadgen
from loadgen.simulate import simulate
from loadgen.workloads import Conversation, Turn, Workload, load_mtbench

METRICS = ("ttft_s", "tpot_s", "e2e_s")


def probe_workload(count: int, spacing_s: float, max_tokens: int = 4) -> Workload:
    """``count`` single-turn MT-Bench questions, one every ``spacing_s`` seconds (a timed workload)."""
    questions = load_mtbench(max_tokens)
    conversations = [Conversation(f"probe-{i}", "probe", (Turn(questions[i % len(questions)].turns[0].content, max_tokens),),
                                  start_s=i * spacing_s) for i in range(count)]
    return Workload("probe", iter(conversations), timed=True)


def ttft_offsets(live: list[RequestRecord], virtual: list[RequestRecord]) -> list[float]:
    """Live TTFT − virtual TTFT (seconds) of the requests both runs answered, matched by conversation and turn."""
    sim = {(r.conversation_id, r.turn): r.ttft_s for r in virtual if r.ok and r.ttft_s is not None}
    return [r.ttft_s - sim[(r.conversation_id, r.turn)] for r in live
            if r.ok and r.ttft_s is not None and (r.conversation_id, r.turn) in sim]


async def serving_latency(url: str, config: Config, tokenizer: ChatTokenizer, count: int = 30,
                          spacing_s: float = 0.25) -> float:
    """The median extra TTFT (seconds) of the live stack at ``url`` over the virtual run of ``config``, at idle.

    ``count`` isolated requests (``spacing_s`` apart, long enough for each to
    finish alone) are sent live and simulated without serving latency.

    Raises:
        ValueError: no probe succeeded in both runs.
        LoadgenError: the live stack cannot be reached.
    """
    duration = count * spacing_s
    live = await run_loadgen(url, probe_workload(count, spacing_s), duration_s=duration, seed=0,
                             extra_body={"ignore_eos": True})
    virtual = simulate(config, probe_workload(count, spacing_s), duration_s=duration, seed=0, ignore_eos=True,
                       tokenizer=tokenizer)
    offsets = ttft_offsets(live, virtual)
    if not offsets:
        raise ValueError("no probe request succeeded both live and in the virtual run")
    return max(0.0, statistics.median(offsets))


def compare(live: dict, virtual: dict) -> list[dict]:
    """``{"group", "metric", "stat", "live_s", "virtual_s", "diff_pct"}`` per class and statistic of two reports.

    Groups: ``all`` and every class present in both reports; metrics TTFT,
    TPOT, E2E; statistics p50 and p90; ``diff_pct`` = (virtual / live − 1)·100,
    None when either is missing.
    """
    rows = []
    groups = [("all", live, virtual)] + [
        (c, live["by_class"][c], virtual["by_class"][c]) for c in live["by_class"] if c in virtual["by_class"]]
    for name, a, b in groups:
        for metric in METRICS:
            for stat in ("p50", "p90"):
                x, y = a[metric][stat], b[metric][stat]
                diff = None if not x or y is None else (y / x - 1) * 100
                rows.append({"group": name, "metric": metric, "stat": stat, "live_s": x, "virtual_s": y, "diff_pct": diff})
    return rows
