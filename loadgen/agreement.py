"""Live against virtual: the same workload through the running gateway and through :mod:`loadgen.virtual`.

The virtual run models no HTTP hop or tokenization. To compare like with like,
:func:`serving_latency` measures that path on the live stack first: isolated
requests (one at a time, the engines idle), short and long, are sent live and
simulated, and the differences of their TTFTs give the serving latency the
virtual run then adds: a fixed part (half on the way in, half on the way out)
and a part per 1,000 new prompt tokens on the way in (new: not cached on any
engine). Tokenizing and moving a prompt costs more the longer it is; new tokens
are a proxy fitted to the data, not the mechanism: over the ~120 matched
requests of three runs of ``config.yaml`` at 3 conversations/s on this
project's 2-core machine, live minus virtual TTFT grew by 1.7–2.6 ms per 1,000
tokens, a little better explained by new tokens than by prompt tokens, and
:func:`serving_latency`'s fits gave 1.5–2.0 ms (nine, 2026-12-04).
Everything under load — queueing, batching, chunking, the scheduler's
windows, decode interference — is left to the model.
"""

from __future__ import annotations

import logging
import random
import secrets
import statistics
from dataclasses import dataclass

from laps.config import Config
from laps.tokenizer import ChatTokenizer
from loadgen.runner import RequestRecord, run_loadgen
from loadgen.simulate import simulate
from loadgen.workloads import Conversation, ExactLengthPrompts, Turn, Workload, load_mtbench

log = logging.getLogger(__name__)
METRICS = ("ttft_s", "tpot_s", "e2e_s")
LONG_PROBE_TOKENS = 3000  # the long probes' templated prompt length; the short ones are MT-Bench questions (~20-200)


@dataclass(frozen=True)
class ServingLatency:
    """The live stack's extra TTFT over the virtual run at idle: ``fixed_s`` per request and ``per_1k_s`` more per
    1,000 new prompt tokens (seconds)."""

    fixed_s: float
    per_1k_s: float


def probe_workload(count: int, spacing_s: float, tokenizer: ChatTokenizer, seed: str, max_tokens: int = 4) -> Workload:
    """``count`` single-turn probes, one every ``spacing_s`` seconds (a timed workload): MT-Bench questions and,
    every other one, a prompt of :data:`LONG_PROBE_TOKENS` tokens of real text, both drawn with ``seed`` (the same
    seed, the same probes); each short one starts with ``seed`` and its number, so no two seeds share a prompt."""
    rng = random.Random(f"probes/{seed}")
    questions = load_mtbench(max_tokens)
    rng.shuffle(questions)
    long_prompts = ExactLengthPrompts(tokenizer, rng)

    def prompt(i: int) -> str:
        if i % 2:
            return long_prompts.make(LONG_PROBE_TOKENS)
        return f"[{seed} {i}] {questions[i % len(questions)].turns[0].content}"

    conversations = [Conversation(f"probe-{i}", "probe", (Turn(prompt(i), max_tokens),), start_s=i * spacing_s)
                     for i in range(count)]
    return Workload("probe", iter(conversations), timed=True)


def ttft_offsets(live: list[RequestRecord], virtual: list[RequestRecord]) -> list[tuple[int, float]]:
    """(new prompt tokens, as the virtual run counted them; live TTFT − virtual TTFT in seconds) of the requests both
    runs answered, matched by conversation and turn."""
    sim = {(r.conversation_id, r.turn): r for r in virtual if r.ok and r.ttft_s is not None}
    return [(sim[key].new_tokens_est or 0, r.ttft_s - sim[key].ttft_s) for r in live
            if r.ok and r.ttft_s is not None and (key := (r.conversation_id, r.turn)) in sim]


def fit_serving_latency(offsets: list[tuple[int, float]]) -> ServingLatency:
    """The line through the medians of the short and the long probes' offsets ((new prompt tokens, seconds); the
    long ones have at least half of :data:`LONG_PROBE_TOKENS`), neither part below 0. With one group only (no long
    probe answered, or no short one), the median of all offsets and nothing per token, with a warning: with only
    long probes the fixed part then holds their tokens' part too.

    Raises:
        ValueError: no offset.
    """
    if not offsets:
        raise ValueError("no probe request succeeded both live and in the virtual run")
    long = [(n, d) for n, d in offsets if n >= LONG_PROBE_TOKENS // 2]
    short = [(n, d) for n, d in offsets if n < LONG_PROBE_TOKENS // 2]
    if not long or not short:
        log.warning("serving latency: no %s probe answered in both runs; the median offset of the others is taken as "
                    "the fixed part, and nothing per token", "long" if not long else "short")
        return ServingLatency(max(0.0, statistics.median(d for _, d in offsets)), 0.0)
    (n_short, d_short), (n_long, d_long) = ((statistics.median(n for n, _ in g), statistics.median(d for _, d in g))
                                            for g in (short, long))
    per_token_s = max(0.0, (d_long - d_short) / (n_long - n_short))
    return ServingLatency(max(0.0, d_short - per_token_s * n_short), 1000 * per_token_s)


async def serving_latency(url: str, config: Config, tokenizer: ChatTokenizer, count: int = 30,
                          spacing_s: float = 0.25) -> ServingLatency:
    """The live stack's extra TTFT at ``url`` over the virtual run of ``config``, at idle (:func:`fit_serving_latency`).

    ``count`` isolated requests (:func:`probe_workload`, ``spacing_s`` apart, long enough for each to
    finish alone) are sent live and simulated without serving latency; each call draws other probes, so none is in
    the live engines' prefix caches from an earlier call (the virtual engines start empty).

    Raises:
        ValueError: no probe succeeded in both runs.
        LoadgenError: the live stack cannot be reached.
    """
    duration, seed = count * spacing_s, secrets.token_hex(8)
    live = await run_loadgen(url, probe_workload(count, spacing_s, tokenizer, seed), duration_s=duration, seed=0,
                             extra_body={"ignore_eos": True})
    virtual = simulate(config, probe_workload(count, spacing_s, tokenizer, seed), duration_s=duration, seed=0,
                       ignore_eos=True, tokenizer=tokenizer)
    return fit_serving_latency(ttft_offsets(live, virtual))


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
