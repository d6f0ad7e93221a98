"""Does laps as shipped beat every router baseline on every workload, at every load? One benchmark, one verdict.

    python bench/dominance.py --pd --out runs/dominance/dominance.json       # about 75 min on 2 cores
    python bench/dominance.py --quick --out runs/dominance/quick.json        # 3 workloads, 4 loads, shorter points

8 simulated H200s with Qwen2.5-7B (the engine model of ``laps simulate``), TTFT SLO 0.4 s, and
the length-aware objective 0.4 s + 0.06 s per 1,000 new prompt tokens (about twice the
per-token prefill time of a long prompt on this engine, so a 30k-token prefill is allowed
2.2 s). Workloads (``laps simulate --dataset`` names): ``hh-rlhf`` chats, ``mixed`` (20% long),
``docs`` (50% long), ``chat-single`` (single-turn first turns, 90% short, ``max_tokens`` 256),
``shared-docs`` (10k–30k-token documents asked several questions each, interleaved; our own
prefix-heavy construction), the ``azure-conv`` replay sped up, and ``code-burst`` sped up (bursty code
completion: prompts of ~1,500 tokens, replies of ~13; our own construction in the shape of Splitwise's
coding trace). Replies end at the simulated engine's own end of text (median 30 tokens) or at ``max_tokens``,
whichever is first (``bench/held_out.py`` runs them to the trace's lengths). The issue's short-heavy mix has
256-token replies; with them ``chat-single`` is decode-bound (by the engine model's ``decode_s`` 8 engines decode at
most ~930 conversations/s of them) and past that TTFT stays low for every policy while the decode batches grow,
until the request slots fill, which in a point of finite length happens at a load set by that length: a knee and a
goodput of the TTFT objective there would measure the point's length, not the scheduler. ``bench/steady_state.py
--ignore-eos --duration 20`` runs that shape over 20 s of arrivals instead, TPOT beside TTFT.

Policies: ``laps`` as shipped (``examples/sim-h200x8.yaml``, unedited: pools as preferences,
predicted-TTFT routing, the controller on with instant moves, laps' SGLang plugin in the engines: late requests
last, long prompts by deadline less the longest where one would end late, Moore's order, short passes, decode turns
with SGLang's prefill-decode interval) and
the baselines over all 8 engines with SGLang's default flags and order: ``least_load`` (unified
FCFS), ``least_load+spf`` (least load to engines running ``--schedule-policy
shortest-prefill-first``), ``cache_aware``, ``bucket``, ``round_robin`` (the rules of SGLang's
router). ``--pd`` adds the PD runs (6 prefill + 2 decode)
of ``mixed`` and ``docs``. Every sweep also runs a control, ``least_load+spf/laps-flags``: least load to
engines with laps' own flags (a 1,024-token chunk instead of SGLang's 8,192, prefill CUDA graphs,
``shortest-prefill-first``, the prefill-decode interval) and plugin (``late_requests_last``, ``deadline_order``,
``short_pass``, ``decode_turns``); it is not in the
verdict, but a second
table sets laps against it alone, which separates what laps' scheduling buys from what its engines buy.

Loads: least_load's saturation load is searched first (the offered load at which its violations
reach 5%, geometric steps then bisection), then every policy runs at 0.2, 0.5, 0.8, 1.0, 1.2 and
1.5 times it (``--quick``: 0.5, 1.0, 1.2, 1.5), and then at 1.25 times the top load again while laps or any
baseline still has ≤ 5% violations there (up to 3×): otherwise a goodput and a knee past 1.5× would read as
1.5× for both sides. The offered load is conversations per second for
Poisson workloads and the replay speed-up for ``azure-conv`` and ``code-burst``; rows also give the achieved request
rate. ``--burstiness B`` draws the Poisson workloads' arrival gaps from a gamma distribution of shape B with the same
mean (0.25: bursts, a coefficient of variation of 2), the saturation search's too; rows say which (``burstiness``,
None for a replayed workload, which keeps its trace's times). Rows: ``{workload, policy, load, rate_rps,
slo_violation_rate, length_slo_violation_rate, ttft_p90_s, short_ttft_p90_s, goodput_rps, prefill_busy_fraction,
prefill_load, short_slo_violation_rate, long_slo_violation_rate, tpot_p90_s, e2e_p90_s, burstiness}`` (``goodput_rps``: requests
per second that met the fixed objective;
``prefill_busy_fraction``: the mean share of the run the prefill engines spent in prefill passes; ``prefill_load``:
their prefill-pass seconds over the point's seconds of arrivals instead, the prefill the arrivals asked for against
what the engines can run meanwhile, above 1 past their prefill capacity, where only a backlog served after the
arrivals end keeps violations down; the last two:
the fixed objective's violation rate within the short and the long class, None for a class with no request;
``violation_floor``: the fewest violations of the fixed objective that any scheduler could have on the row's
arrivals, as a rate, from ``bench/violation_floor.py``: the prefill compute alone, a perfect prefix cache, all 8
engines prefilling, in PD too, no decode, each prefill on one engine; ``short_decode_floor_s``, PD rows only (every
policy's, each on its own run): with the decode engines passing as they did in that run, the P90 over the short
requests of the soonest a client could have had their first token, which in PD leaves with a decode engine at the
start of its next pass: each one's isolated forward pass from its arrival (the prefix its engine had cached), then the
wait for whichever decode engine ends the pass it runs first (in hindsight; the KV transfer left out), plus the
gateway's overhead; a bound for that run's decode passes, which another placement of the prefills would shift; None
where the run moved an engine to or from decoding). One PNG per workload next to the JSON. The verdict (printed, and under ``verdict``):

* ``never_worse``: at every load laps' violation rate ≤ the best baseline's + 0.5 points (fixed
  and length-aware);
* ``knee``: at the first load where the best baseline reaches 5%, laps ≤ 0.6× its violations
  (knee and goodput on the fixed objective, on ``shared-docs`` on the length-aware one: there
  0.4 s is out of reach for a third of the requests at any load);
* ``goodput``: laps' goodput (the highest offered load with ≤ 5% violations, interpolated) ≥ 1.2×
  the best baseline's (≥ 1.0× on ``shared-docs``); next to it, the share of its time the best baseline's
  prefill engines spend in prefill passes at the saturation load (``prefill_busy_fraction`` of each row:
  how much room is left, decode passes taking most of the rest) and its ``prefill_load`` there (near 1, a goodput
  1.2× as high asks for more prefill than the engines can run while the arrivals last);
* ``short_p90``: from 0.5× saturation up, laps' short-class P90 TTFT ≤ 0.5× the best baseline's,
  or ≤ 2× the physical floor (the P90 of the short requests' isolated forward passes plus the
  gateway's measured overhead, 0.56 ms) where the baseline is within 2× of that floor; every TTFT here as a client
  sees it, the rows' simulated one plus that overhead (virtual time leaves it out; every policy pays it). Each miss is printed under
  the tables with its target, the baseline with the lowest short P90, and both sides' TPOT and end-to-end P90
  (``tpot_p90_s``, ``e2e_p90_s`` of the rows): where that baseline's TTFT was bought by deferring its decode
  passes, they say so; in PD also laps' ``short_decode_floor_s``, and whether the target is below it (then no
  placement of laps' prefills meets it with the decode passes and cache hits of its run).

Next to the knee and goodput checks (fixed objective only) the violation floor says whether a miss could be
avoided at all: laps' floor at the knee (a floor above 0.6× the best baseline's rate there would make that
target unreachable on those arrivals) and the load where laps' floor reaches 5% over the best baseline's goodput
(a goodput ceiling; "≥" where the floor stays under 5% at every load run; an estimate, not a bound: it is
interpolated between loads, and on multi-turn workloads taken on laps' own arrivals). The floor leaves out
decode, KV memory and request slots, so a floor far below a miss does not say the miss is avoidable.

Exit status (a sweep's and ``--verdict-of``'s): 0 when laps meets every target, 1 when it misses one (or the JSON
cannot be written), 2 on a usage error or a refused ``--verdict-of`` file, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import multiprocessing
import multiprocessing.pool
import random
import reprlib
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import Progress  # noqa: E402
from rich.table import Table  # noqa: E402

from engines.sim.latency import make_latency_model  # noqa: E402
from laps.config import Config, load_config, parse_config  # noqa: E402
from laps.doc_help import doc_parser  # noqa: E402
from laps.tokenizer import load_tokenizer  # noqa: E402
from loadgen.cli import gamma_shape, output_file, positive_float, positive_int  # noqa: E402
from loadgen.outputs import beside, check_output_path, is_stdout, is_stream, make_folders, open_output, remove_empty  # noqa: E402
from loadgen.report import build_report, ms  # noqa: E402
from loadgen.simulate import simulate_run  # noqa: E402
from loadgen.virtual import VirtualRun  # noqa: E402
from loadgen.workloads import CODE_BURST_RATE_RPS, TIMED_DATASETS, build_workload, load_azure_trace  # noqa: E402
from policy_compare import POLICIES as COMPARED, ROLES  # noqa: E402
from violation_floor import IdealPrefixCache, violation_floor  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "examples" / "sim-h200x8.yaml"
SLO_TTFT_S = 0.4
PER_1K_S = 0.06
VIOLATION_TARGET = 0.05
GATEWAY_OVERHEAD_S = 0.56e-3  # README, Gateway overhead: added latency p50 at concurrency 1
WORKLOADS = ("mixed", "docs", "chat-single", "shared-docs", "azure-conv", "hh-rlhf", "code-burst")
QUICK_WORKLOADS = ("mixed", "chat-single", "shared-docs")
PD_WORKLOADS = ("mixed", "docs")
# Our policy names -> policy_compare's (scheduling.policy over engines of one SGLang role).
BASELINES = {"least_load": "least_load", "least_load+spf": "sglang-spf", "cache_aware": "cache_aware",
             "bucket": "bucket", "round_robin": "round_robin"}
CONTROL = "least_load+spf/laps-flags"
"""least_load to engines running laps' own engine flags (``examples/sim-h200x8.yaml``'s: its chunk size, prefill CUDA
graphs, ``shortest-prefill-first``, laps' SGLang plugin). Not a baseline of the verdict (the router rules run on SGLang as it ships) but
its control: laps against it is what the scheduling alone buys, apart from the flags laps ships with."""
POLICIES = ("laps", *BASELINES, CONTROL)
LOADS = (0.2, 0.5, 0.8, 1.0, 1.2, 1.5)
QUICK_LOADS = (0.5, 1.0, 1.2, 1.5)
# First guess of least_load's saturation load (conversations/s, or replay speed-up) per workload.
FIRST_GUESS = {"hh-rlhf": 200.0, "mixed": 200.0, "docs": 60.0, "chat-single": 400.0, "shared-docs": 8.0, "azure-conv": 60.0,
               "code-burst": 15.0}


def _trace_rate_rps(trace) -> float:
    """Requests per second of a replayed ``trace`` at speed-up 1."""
    return len(trace) / trace[-1].arrival_s


# Mean request rate of the replayed workloads at speed-up 1 (their offered load is a speed-up).
TRACE_RATE_RPS = {"azure-conv": _trace_rate_rps(load_azure_trace()), "code-burst": CODE_BURST_RATE_RPS}
assert set(TRACE_RATE_RPS) == set(TIMED_DATASETS)
# The objective that saturation and goodput are measured on: the fixed one, except where it is out of every scheduler's
# reach (shared-docs: a 30k-token prefill alone takes ~0.9 s, so least_load misses 0.4 s for a third of the requests
# at any load), where it is the length-aware one.
OBJECTIVE = {"shared-docs": "length_slo_violation_rate"}


def shipped_engine_role() -> dict:
    """The engine setup of ``examples/sim-h200x8.yaml``'s roles (both run the same flags and plugin), as a short-pool
    role's body."""
    return load_config(SHIPPED).roles["short-prefill"].model_dump()


def baseline_setup(policy: str) -> tuple[str, str, dict]:
    """A baseline's (or the control's) ``scheduling.policy``, and the name and body of the role every engine runs."""
    if policy == CONTROL:
        return "least_load", "laps-flags", shipped_engine_role()
    scheduling, role = COMPARED[BASELINES[policy]]
    return scheduling, role, ROLES[role]


def pd_deployment(policy: str) -> Config:
    """6 prefill + 2 decode simulated engines: laps with the shipped pools, controller and objectives, or a baseline placing
    prefills."""
    shipped = load_config(SHIPPED)
    roles = {**({k: v.model_dump() for k, v in shipped.roles.items()} if policy == "laps" else
                {"prefill": baseline_setup(policy)[2]}),
             "decode": {"pool": "decode", "flags": {}}}
    prefill_roles = ["short-prefill"] * 3 + ["long-prefill"] * 3 if policy == "laps" else ["prefill"] * 6
    data = {
        "model": {"name": "Qwen2.5-7B-Instruct"}, "sim": {"model": "qwen2.5-7b", "gpu": "h200"},
        "slo": shipped.slo.model_dump() if policy == "laps" else {"ttft_s": SLO_TTFT_S},
        "scheduling": {"policy": "laps" if policy == "laps" else baseline_setup(policy)[0]},
        "pd": {"link": "nvlink"}, "roles": roles,
        "engines": [{"name": f"p{i}", "kind": "sim", "role": r, "gpus": [i]} for i, r in enumerate(prefill_roles)]
                   + [{"name": f"d{i}", "kind": "sim", "role": "decode", "gpus": [6 + i]} for i in range(2)],
    }
    if policy == "laps":
        data["controller"] = shipped.controller.model_dump()
    return parse_config(data, f"dominance-pd[{policy}]")


def point_config(policy: str, pd: bool) -> Config:
    """The deployment ``policy`` runs on: the shipped file for laps, 8 engines of one role for a baseline or the control."""
    if pd:
        return pd_deployment(policy)
    if policy == "laps":
        return load_config(SHIPPED)
    scheduling, role, body = baseline_setup(policy)
    return parse_config({
        "model": {"name": "Qwen2.5-7B-Instruct"}, "slo": {"ttft_s": SLO_TTFT_S}, "sim": {"model": "qwen2.5-7b", "gpu": "h200"},
        "scheduling": {"policy": scheduling}, "roles": {role: body},
        "engines": [{"name": f"e{i}", "kind": "sim", "role": role, "gpus": [i]} for i in range(8)],
    }, f"dominance[{policy}]")


REQUESTS_PER_POINT = 3000
MAX_DURATION_S = 10.0  # the default --duration: most simulated seconds of arrivals per point
QUICK_MAX_DURATION_S = 6.0  # with --quick


def point_duration_s(workload: str, load: float, max_duration_s: float) -> float:
    """Simulated seconds of arrivals for a point: enough for ~3,000 first turns, between 1.5 s and ``max_duration_s``
    (high-rate chat points would otherwise simulate tens of thousands of requests each). A replayed workload
    (``load`` its speed-up) replays the same stretch of its trace at every load, its first ~3,000 requests, whatever
    ``max_duration_s``: a shorter one would hold only the trace's first seconds at low loads and its bursts only at
    high ones."""
    if workload in TRACE_RATE_RPS:
        return REQUESTS_PER_POINT / TRACE_RATE_RPS[workload] / load
    return min(max_duration_s, max(1.5, REQUESTS_PER_POINT / load))


def simulate_point(workload: str, policy: str, load: float, duration_s: float, seed: int, pd: bool = False,
                   burstiness: float = 1.0, **options) -> tuple[Config, VirtualRun]:
    """``policy``'s deployment (:func:`point_config`) on ``workload`` (seeded ``workload/{seed}``) at ``load``
    (conversations per second, or a replayed workload's speed-up) for ``duration_s`` of arrivals; the config and the
    finished run. ``burstiness``: the gamma shape of a Poisson workload's arrival gaps (1: Poisson;
    :func:`~loadgen.workloads.arrival_times`), which a replayed workload ignores. ``options`` go to
    :func:`~loadgen.simulate.simulate_run` (``on_prompt``, ``ignore_eos``, ``max_requests``)."""
    tokenizer = load_tokenizer()
    config = point_config(policy, pd)
    wl = build_workload(workload, random.Random(f"workload/{seed}"), tokenizer=tokenizer)
    timing = {"time_scale": 1.0 / load} if wl.timed else {"rate": load, "burstiness": burstiness}
    return config, simulate_run(config, wl, duration_s=duration_s, seed=seed, tokenizer=tokenizer, **timing, **options)


def run_point(workload: str, policy: str, load: float, max_duration_s: float, seed: int, pd: bool = False,
              burstiness: float = 1.0) -> dict:
    """Simulate one (workload, policy, offered load) point (``burstiness`` as for :func:`simulate_point`); its row."""
    duration_s = point_duration_s(workload, load, max_duration_s)
    prefills = PrefillWork(load_tokenizer())
    passes = PassLog() if pd else None
    config, run = simulate_point(workload, policy, load, duration_s, seed, pd, burstiness, on_prompt=prefills.arrive,
                                 on_pass=passes.on_pass if passes else None)
    records = run.records
    if any("decode" in (m.get("from_pool"), m.get("to_pool")) for m in getattr(run, "moves", ())):
        passes = None  # an engine moved to or from decoding: which engines decoded when is not kept
    report = build_report(records, slo_ttft_s=SLO_TTFT_S, slo_ttft_per_1k_s=PER_1K_S)
    shorts = isolated_short_passes(records)
    met = sum(r.ok and r.ttft_s is not None and r.ttft_s <= SLO_TTFT_S for r in records)
    return {
        "workload": workload, "policy": policy, "pd": pd, "load": load, "duration_s": duration_s,
        "burstiness": None if workload in TRACE_RATE_RPS else burstiness,
        "rate_rps": report["throughput_rps"], "requests": report["requests"]["sent"],
        "slo_violation_rate": report["slo"]["violation_rate"],
        "length_slo_violation_rate": report["length_slo"]["violation_rate"],
        "ttft_p90_s": report["ttft_s"]["p90"],
        "short_ttft_p90_s": report["by_class"]["short"]["ttft_s"]["p90"],
        # what a policy's TTFT costs in decoding: where laps' short P90 misses, whether the baseline's was bought by
        # deferring the decode passes (its TPOT and end-to-end latency say)
        "tpot_p90_s": report["tpot_s"]["p90"],
        "e2e_p90_s": report["e2e_s"]["p90"],
        # which class the violations fall on (the gateway's class at arrival, under every policy): where a target is
        # missed, this says whether the short requests or the long ones pay
        "short_slo_violation_rate": report["by_class"]["short"]["slo_violation_rate"],
        "long_slo_violation_rate": report["by_class"]["long"]["slo_violation_rate"],
        "goodput_rps": met / report["duration_s"] if report["duration_s"] > 0 else 0.0,  # achieved; the verdict's is a load
        "short_floor_s": short_floor_s(shorts),
        # PD: the short P90 that no placement of this run's prefills could beat, its decode passes and cache hits as they were
        "short_decode_floor_s": short_decode_floor_s(shorts, passes, decode_engines(config)),
        "prefill_busy_fraction": prefill_busy_fraction(run, config, report["duration_s"]),
        "prefill_load": prefill_busy_fraction(run, config, duration_s),
        "moves": len(run.moves) if hasattr(run, "moves") else 0,
        # the fewest violations of the fixed objective any scheduler could have on this run's arrivals with all
        # the engines prefilling (bench/violation_floor.py): where a target is missed, whether it could be met
        "violation_floor": prefills.floor_rate(run) if records else None,
    }


class PrefillWork:
    """Each arriving request's arrival time, prompt length and most cached tokens under a perfect cache; then the
    run's violation floor (:mod:`violation_floor`)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache = IdealPrefixCache()
        self.requests: list[tuple[float, int, int]] = []  # (arrival s, new tokens, cached tokens)

    def arrive(self, record, prompt_ids: list[int]) -> None:
        """:func:`~loadgen.simulate.simulate_run`'s ``on_prompt``: a follow-up turn's new user message (less a token, for
        a merge at its edge) is all that no earlier sequence holds."""
        tail = max(1, len(self.tokenizer.encode(record.user)) - 1) if record.turn else None
        cached = self.cache.arrive(prompt_ids, unshared_tail_tokens=tail)
        self.requests.append((record.start_s, len(prompt_ids) - cached, cached))

    def floor_rate(self, run) -> float:
        """The floor over the run's requests, every engine of the run prefilling (in PD the decode engines too: the
        controller may flip one), each request's work on the engine model that computes it fastest."""
        models = {slot.core.latency for slot in run.engines.values()}
        work_s = [min(m.prefill_compute_s(new, cached) for m in models) for _, new, cached in self.requests]
        return violation_floor([a for a, _, _ in self.requests], work_s, SLO_TTFT_S, len(run.engines)) / len(run.records)


def decode_engines(config: Config) -> list[str]:
    """The engines ``config`` starts in the decode pool."""
    return [e.name for e in config.engines if config.roles[e.role].pool == "decode"]


def prefill_busy_fraction(run, config: Config, duration_s: float) -> float | None:
    """The prefill engines' mean seconds in prefill passes over ``duration_s`` (the run's: the share of it they were
    busy prefilling; its seconds of arrivals: the ``prefill_load``, above 1 past their capacity); engine model."""
    decode = decode_engines(config)
    busy = [slot.core.stats().total_prefill_busy_s for name, slot in run.engines.items() if name not in decode]
    return sum(busy) / len(busy) / duration_s if busy and duration_s > 0 else None


def isolated_short_passes(records) -> list[tuple[float, float]]:
    """(arrival s, isolated forward pass s) of each answered short request: its prefill alone, with the prefix its
    engine had cached, on the engine model."""
    model = make_latency_model()
    return [(r.start_s, model.predict([(max(1, (r.prompt_tokens or 1) - (r.cached_tokens or 0)), r.cached_tokens or 0)]))
            for r in records if r.laps_class == "short" and r.ok and r.prompt_tokens]


def short_floor_s(shorts: Sequence[tuple[float, float]]) -> float | None:
    """P90 over the short requests (``shorts``: :func:`isolated_short_passes`) of their isolated forward pass, plus the
    gateway's overhead."""
    passes = [p for _, p in shorts]
    return float(np.percentile(passes, 90)) + GATEWAY_OVERHEAD_S if passes else None


class PassLog:
    """Every engine's forward passes in a run, as they start (``simulate_run``'s ``on_pass``): for the soonest a PD
    request's first token can leave.

    In PD the client's first token leaves with the decode engine, at the start of the first pass after the request's
    KV arrived (SGLang's prebuilt batch; :mod:`loadgen.virtual_pd`), so however the prefills are placed, a first token
    waits for a decode engine to end the pass it is in."""

    def __init__(self) -> None:
        self.starts: dict[str, list[float]] = {}
        self.ends: dict[str, list[float]] = {}

    def on_pass(self, engine_id: str, start_s: float, result) -> None:
        """A pass starts (``result``: its :class:`~engines.sim.core.StepResult`)."""
        self.starts.setdefault(engine_id, []).append(start_s)
        self.ends.setdefault(engine_id, []).append(start_s + result.duration_s)

    def wait_s(self, t: float, engines: Sequence[str]) -> float:
        """Seconds from ``t`` until the first of ``engines`` can take a request: 0 where one is idle at ``t`` (no pass
        of it began before ``t`` and ends after it), else the soonest end of the passes they run then; inf for no
        engine."""
        wait = math.inf
        for name in engines:
            starts = self.starts.get(name, [])
            k = bisect.bisect_left(starts, t) - 1  # the last pass that began before t
            wait = min(wait, max(0.0, self.ends[name][k] - t) if k >= 0 else 0.0)
        return wait


def short_decode_floor_s(shorts: Sequence[tuple[float, float]], passes: PassLog | None, decode: Sequence[str]) -> float | None:
    """PD only (``shorts``: :func:`isolated_short_passes`; ``passes``: the run's, else None; ``decode``: its decode
    engines): P90 over the short requests of the
    soonest their first token could have reached a client with the decode engines passing as they did, plus the
    gateway's overhead: the isolated forward pass from arrival, then the wait for the decode engine that ends its pass
    first (:meth:`PassLog.wait_s`; the KV transfer left out). A bound for this run's decode passes and cache hits (each
    prefill with the prefix its engine had), which another placement of the prefills would change (another policy's
    decode engines pass at other times)."""
    if passes is None:
        return None
    firsts = [p + passes.wait_s(a + p, decode) for a, p in shorts]
    return float(np.percentile(firsts, 90)) + GATEWAY_OVERHEAD_S if firsts else None


def _ignore_sigint() -> None:
    """Pool workers leave Ctrl-C to the main process, which stops them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def simulation_pool(jobs: int) -> multiprocessing.pool.Pool:
    """``jobs`` worker processes for simulations. A ``multiprocessing.Pool``, not a ``ProcessPoolExecutor``: on Ctrl-C
    (a ``KeyboardInterrupt`` in the main process only) leaving its ``with`` block stops the simulations running instead
    of waiting them out."""
    return multiprocessing.Pool(jobs, _ignore_sigint)


def simulate_all(jobs: int, fn, calls: list[tuple], console: Console) -> list:
    """``fn(*args)`` for every ``args`` in ``calls`` on a :func:`simulation_pool` of ``jobs`` processes; the results in
    the order of ``calls``, with a status line of how many are done.

    Raises:
        KeyboardInterrupt: on Ctrl-C, once the workers are stopped.
    """
    with simulation_pool(jobs) as pool, console.status("simulating") as status:
        pending = [pool.apply_async(fn, args) for args in calls]
        results = []
        for result in pending:
            results.append(result.get())
            status.update(f"simulating: {len(results)} of {len(pending)} runs done")
    return results


def saturation_load(workload: str, duration_s: float, seed: int, pd: bool, pool: multiprocessing.pool.Pool,
                    burstiness: float = 1.0) -> float:
    """least_load's offered load at 5% violations (of :data:`OBJECTIVE`'s objective): a geometric ladder two probes at a
    time (factor 2), then two rounds of two probes at the thirds of the bracket in log space; the bracket's geometric middle."""
    key = OBJECTIVE.get(workload, "slo_violation_rate")

    def probe(loads: list[float]) -> list[float]:
        pending = [pool.apply_async(run_point, (workload, "least_load", load, duration_s, seed, pd, burstiness)) for load in loads]
        return [result.get()[key] or 0.0 for result in pending]  # None: no request in the window, nothing violated

    passing, failing = [], []
    base = FIRST_GUESS[workload] * (0.75 if pd else 1.0)
    for _ in range(5):
        pair = [base, 2 * base]
        for load, v in zip(pair, probe(pair)):
            (failing if v > VIOLATION_TARGET else passing).append(load)
        if failing and any(p < min(failing) for p in passing):
            break
        base = base * 4 if not failing else base / 4
    if not failing or not passing:
        return (passing or failing)[-1]
    hi = min(failing)
    lo = max(p for p in passing if p < hi) if any(p < hi for p in passing) else hi / 2
    for _ in range(2):
        a, b = lo * (hi / lo) ** (1 / 3), lo * (hi / lo) ** (2 / 3)
        va, vb = probe([a, b])
        if va > VIOLATION_TARGET:
            hi = a
        elif vb > VIOLATION_TARGET:
            lo, hi = a, b
        else:
            lo = b
    return math.sqrt(lo * hi)


def goodput(rows: list[dict], key: str = "slo_violation_rate") -> float:
    """The highest offered load with ≤ 5% violations, interpolated between the loads around it (0 when the lowest fails).

    On the offered-load axis (conversations/s, or the replay speed-up), the same for every policy: the
    achieved request rate depends on the policy (a faster answer starts the next turn sooner, a long
    tail of late answers stretches the run).
    """
    rows = sorted(rows, key=lambda r: r["load"])
    best = 0.0
    for prev, cur in zip([None, *rows], rows):
        if cur[key] <= VIOLATION_TARGET:
            best = cur["load"]
            continue
        if prev is not None and prev[key] <= VIOLATION_TARGET:
            f = (VIOLATION_TARGET - prev[key]) / (cur[key] - prev[key])
            best = prev["load"] + f * (cur["load"] - prev["load"])
        break
    return best


def client_ttft_s(simulated_s: float | None) -> float | None:
    """A simulated TTFT (s) as a client would see it: plus the gateway's overhead, which virtual time leaves out, as
    the physical floor (:func:`short_floor_s`) has it in (None: nothing measured). Every policy here is one of laps'
    gateway's, so each pays it."""
    return None if simulated_s is None else simulated_s + GATEWAY_OVERHEAD_S


def short_p90_target_s(best_short_p90_s: float, floor_s: float | None) -> float:
    """The most short-class P90 TTFT (s) the ``short_p90`` check allows laps at a load (module doc): twice the physical
    floor ``floor_s`` where the best baseline's ``best_short_p90_s`` is within twice it, else half the baseline's."""
    if floor_s is not None and best_short_p90_s <= 2 * floor_s:
        return 2 * floor_s
    return 0.5 * best_short_p90_s


def verdict(rows: list[dict], workload: str, saturation: float) -> dict:
    """The four checks of the module doc for one workload's rows (laps against the best baseline at each load)."""
    laps = {r["load"]: r for r in rows if r["policy"] == "laps"}
    base = {}
    for r in rows:
        if r["policy"] in BASELINES:
            base.setdefault(r["load"], []).append(r)
    key = OBJECTIVE.get(workload.split(" ")[0], "slo_violation_rate")  # of the knee and goodput
    out: dict = {"workload": workload, "saturation_load": saturation, "points": []}
    never_worse, short_ok, knee = True, True, None
    for load in sorted(laps):
        mine, others = laps[load], base.get(load, [])
        if not others:
            continue
        best = min(others, key=lambda r: r["slo_violation_rate"])
        best_len = min(r["length_slo_violation_rate"] for r in others)
        ok = (mine["slo_violation_rate"] <= best["slo_violation_rate"] + 0.005
              and mine["length_slo_violation_rate"] <= best_len + 0.005)
        never_worse &= ok
        timed = [r for r in others if r["short_ttft_p90_s"] is not None]
        short_of = min(timed, key=lambda r: r["short_ttft_p90_s"]) if timed else {}  # the baseline with the lowest short P90
        # the short P90s as a client sees them (client_ttft_s), as the floor and the target are
        short_best = client_ttft_s(short_of.get("short_ttft_p90_s"))
        short_mine = client_ttft_s(mine["short_ttft_p90_s"])
        floor = mine["short_floor_s"]
        s_ok = target = None
        if load >= 0.499 * saturation and short_best is not None and short_mine is not None:
            target = short_p90_target_s(short_best, floor)
            s_ok = short_mine <= target
            short_ok &= s_ok
        knee_best = min(others, key=lambda r: r[key])
        if knee is None and knee_best[key] >= VIOLATION_TARGET:
            knee = {"load": load, "laps": mine[key], "best": knee_best[key], "best_policy": knee_best["policy"],
                    "ok": mine[key] <= 0.6 * knee_best[key], "floor": _floor(mine, key)}
        out["points"].append({"load": load, "laps": mine["slo_violation_rate"], "best": best["slo_violation_rate"],
                              "best_policy": best["policy"], "laps_length": mine["length_slo_violation_rate"],
                              "best_length": best_len, "never_worse": ok, "laps_short_p90_client_s": short_mine,
                              "best_short_p90_client_s": short_best, "short_floor_s": floor, "short_target_s": target, "short_ok": s_ok,
                              "short_decode_floor_s": mine.get("short_decode_floor_s"),
                              # that baseline, and both sides' decoding (rows of older runs: None)
                              "best_short_policy": short_of.get("policy"),
                              "laps_tpot_p90_s": mine.get("tpot_p90_s"), "best_short_tpot_p90_s": short_of.get("tpot_p90_s"),
                              "laps_e2e_p90_s": mine.get("e2e_p90_s"), "best_short_e2e_p90_s": short_of.get("e2e_p90_s")})
    g_laps = goodput([r for r in rows if r["policy"] == "laps"], key)
    g_base = {p: goodput([r for r in rows if r["policy"] == p], key) for p in BASELINES}
    best_policy = max(g_base, key=g_base.get)
    need = 1.0 if workload == "shared-docs" else 1.2
    # None: the best baseline misses already at the lowest load (then laps passes if it meets any load at all)
    ratio = g_laps / g_base[best_policy] if g_base[best_policy] > 0 else None
    at_sat = [r for r in rows if r["policy"] == best_policy and abs(r["load"] - saturation) <= 1e-3 * saturation]
    out["prefill_busy_at_saturation"] = at_sat[0].get("prefill_busy_fraction") if at_sat else None
    out["prefill_load_at_saturation"] = at_sat[0].get("prefill_load") if at_sat else None
    floors = [r for r in rows if r["policy"] == "laps" and _floor(r, key) is not None]
    # the load where the floor itself reaches 5% (the top load run where it never does: a ceiling of at least that)
    g_floor = goodput(floors, "violation_floor") if floors and len(floors) == len(laps) else None
    out.update(never_worse=never_worse, knee=knee, short_p90=short_ok, objective=key,
               goodput={"laps_load": g_laps, "best_load": g_base[best_policy], "best_policy": best_policy,
                        "ratio": ratio, "needed": need, "ok": g_laps > 0 if ratio is None else ratio >= need,
                        "floor_load": g_floor, "floor_capped": g_floor is not None and g_floor >= max(laps),
                        "floor_ratio": g_floor / g_base[best_policy] if g_floor is not None and g_base[best_policy] > 0 else None},
               same_flags=against_control(rows, key))
    return out


def _floor(row: dict, key: str) -> float | None:
    """The row's violation floor where it bounds the verdict's objective (the fixed one), else None."""
    return row.get("violation_floor") if key == "slo_violation_rate" else None


def against_control(rows: list[dict], key: str) -> dict | None:
    """laps against :data:`CONTROL` alone (None without its rows): the most points by which laps' violations exceed
    its at any load (fixed and length-aware objective, positive: laps worse), both violation rates at the control's
    knee (its first load at 5% on ``key``), and their goodputs on ``key``."""
    laps = {r["load"]: r for r in rows if r["policy"] == "laps"}
    control = {r["load"]: r for r in rows if r["policy"] == CONTROL}
    loads = sorted(set(laps) & set(control))
    if not loads:
        return None
    worst = max(max(laps[x]["slo_violation_rate"] - control[x]["slo_violation_rate"],
                    laps[x]["length_slo_violation_rate"] - control[x]["length_slo_violation_rate"]) for x in loads)
    knee = next(({"load": x, "laps": laps[x][key], "control": control[x][key]} for x in loads
                 if control[x][key] >= VIOLATION_TARGET), None)
    g_laps, g_control = goodput(list(laps.values()), key), goodput(list(control.values()), key)
    return {"max_excess": worst, "knee": knee, "laps_goodput_load": g_laps, "control_goodput_load": g_control,
            "goodput_ratio": g_laps / g_control if g_control > 0 else None}


def arrivals_label(rows: list[dict]) -> str:
    """``, gamma arrivals (burstiness B)`` for a sweep's rows drawn with gamma gaps; empty for Poisson rows, a replayed
    trace's (burstiness None) and rows of runs from before the field."""
    burstiness = rows[0].get("burstiness") if rows else None  # one per sweep
    return "" if burstiness in (None, 1.0) else f", gamma arrivals (burstiness {burstiness:.15g})"


def sweep_plot(out: Path, workload: str, pd: bool) -> Path:
    """Where the sweep of ``workload`` (its PD run with ``pd``) draws its plot: beside ``out``, ``STEM_WORKLOAD[_pd].png``."""
    return beside(out, f"{Path(out).stem}_{workload}{'_pd' if pd else ''}.png")


def plot(rows: list[dict], path: Path, title: str, saturation: float) -> None:
    """Violations (fixed and length-aware) and short P90 TTFT against offered load (× least_load's saturation load);
    the first panel's title names the arrivals' burstiness where the rows are not Poisson."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    for policy in POLICIES:
        pts = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["load"])
        if not pts:
            continue
        style = dict(marker="o", linewidth=2.5 if policy == "laps" else 1.2, label=policy,
                     linestyle="--" if policy == CONTROL else "-")
        x = [r["load"] / saturation for r in pts]
        axes[0].plot(x, [100 * r["slo_violation_rate"] for r in pts], **style)
        axes[1].plot(x, [100 * r["length_slo_violation_rate"] for r in pts], **style)
        axes[2].plot(x, [1e3 * (r["short_ttft_p90_s"] or math.nan) for r in pts], **style)
    axes[0].set(ylabel=f"TTFT > {SLO_TTFT_S} s (%)", title=f"{title}{arrivals_label(rows)}: fixed objective")
    axes[1].set(ylabel="violations (%)", title=f"length-aware: {SLO_TTFT_S} s + {PER_1K_S} s/1k new tokens")
    axes[2].set(ylabel="short-class P90 TTFT (ms)", yscale="log", title="short requests")
    for ax in axes:
        ax.set_xlabel("offered load (× least_load's saturation load)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    try:
        with open_output(path) as f:
            fig.savefig(f, format="png", dpi=100)
    finally:
        plt.close(fig)


def sweep_label(workload: str, pd: bool) -> str:
    """A sweep's name in the verdict, the tables and the JSON's ``verdict``: the workload, `` (PD 6+2)`` for PD."""
    return f"{workload}{' (PD 6+2)' if pd else ''}"


def sweep(workload: str, pd: bool, loads: tuple[float, ...], duration_s: float, seed: int, pool: multiprocessing.pool.Pool,
          progress: Progress, seeds: int = 1, burstiness: float = 1.0) -> tuple[list[dict], dict]:
    """Saturation search (with ``seed``), then every policy at every load, each point with seeds ``seed`` …
    ``seed + seeds − 1`` averaged (:func:`mean_row`), then more loads while the goodput is still capped
    (:func:`extra_load`); the rows and the verdict. ``burstiness`` as for :func:`simulate_point`, the search's too."""
    label = sweep_label(workload, pd)
    task = progress.add_task(f"{label}: saturation", total=len(loads) * len(POLICIES))
    sat = saturation_load(workload, duration_s, seed, pd, pool, burstiness)
    progress.console.print(f"{label}: least_load saturates at load {sat:.3g}")
    progress.update(task, description=f"{label}: {len(POLICIES)} policies × {len(loads)} loads")
    key = OBJECTIVE.get(workload, "slo_violation_rate")
    rows: list[dict] = []
    multiples = list(loads)
    while multiples:
        pending = [[pool.apply_async(run_point, (workload, p, round(f * sat, 3), duration_s, seed + k, pd, burstiness))
                    for k in range(seeds)]
                   for p in POLICIES for f in multiples]
        for point in pending:
            r = mean_row([result.get() for result in point])
            rows.append(r)
            progress.console.print(f"  {label} {r['policy']:>15} load {r['load']:g}: {r['rate_rps']:.0f} req/s, "
                                   f"{100 * r['slo_violation_rate']:.2f}% ({100 * r['length_slo_violation_rate']:.2f}% "
                                   f"length-aware; short {_percent(r.get('short_slo_violation_rate'))}, long "
                                   f"{_percent(r.get('long_slo_violation_rate'))}), short P90 {1e3 * (r['short_ttft_p90_s'] or math.nan):.1f} ms (simulated), "
                                   f"floor {_percent(r.get('violation_floor'))}")
            progress.advance(task)
        more = extra_load(rows, key, max(multiples))
        multiples = [] if more is None else [more]
        if more is not None:
            progress.update(task, total=progress.tasks[task].total + len(POLICIES))
            progress.console.print(f"{label}: laps or a baseline still meets the objective at the top load; "
                                   f"adding {more:g}× the saturation load")
    return rows, verdict(rows, label, sat)


EXTRA_LOAD_STEP = 1.25
MAX_LOAD = 3.0


def extra_load(rows: list[dict], key: str, top: float) -> float | None:
    """The next multiple of the saturation load to run, or None: a goodput (and a knee) is only measured where
    violations (``key``) pass 5%, so while laps or any baseline still has ≤ 5% at the top multiple ``top``, the sweep
    goes on at ``top`` × :data:`EXTRA_LOAD_STEP` (two decimals), up to :data:`MAX_LOAD` × the saturation load."""
    at_top = [r for r in rows if r["policy"] in ("laps", *BASELINES) and r["load"] == max(x["load"] for x in rows)]
    capped = any((r[key] or 0.0) <= VIOLATION_TARGET for r in at_top)
    nxt = round(top * EXTRA_LOAD_STEP, 2)
    return nxt if capped and nxt <= MAX_LOAD + 1e-9 else None


def mean_row(runs: list[dict]) -> dict:
    """One row for a point run with several seeds: every numeric field the mean over the seeds that have it (None
    where none has), the rest from the first; ``seeds`` says how many."""
    row = dict(runs[0], seeds=len(runs))
    for key, value in runs[0].items():
        if key not in ("load", "burstiness") and (value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))):
            values = [r[key] for r in runs if r.get(key) is not None]
            row[key] = sum(values) / len(values) if values else None
    return row


def _percent(rate: float | None) -> str:
    """A violation rate as printed; ``None`` (no request of that class): n/a."""
    return "n/a" if rate is None else f"{100 * rate:.2f}%"


def _times(ratio: float | None) -> str:
    """A goodput ratio as printed; ``None`` (the other side meets no load at all): n/a."""
    return "n/a" if ratio is None else f"{ratio:.2f}×"


def _floor_cell(v: dict) -> str:
    """The verdict's violation floor as printed: at the knee and the goodput ceiling over the best baseline's."""
    knee, g = v["knee"], v["goodput"]
    at_knee = "no knee" if knee is None else _percent(knee.get("floor"))
    ceiling = "n/a" if g.get("floor_ratio") is None else f"{'≥ ' if g['floor_capped'] else ''}{_times(g['floor_ratio'])}"
    return f"{at_knee} / {ceiling}"


def _prefill_cell(v: dict) -> str:
    """The best baseline's prefill busy share and prefill load at the saturation load (n/a: rows of an older run)."""
    busy, load = v.get("prefill_busy_at_saturation"), v.get("prefill_load_at_saturation")
    return " / ".join(("n/a" if busy is None else f"{100 * busy:.0f}%", "n/a" if load is None else f"{load:.2f}"))


def short_miss_line(v: dict, p: dict) -> str:
    """A short-P90 miss as printed under the verdict: laps' short P90 and the target (twice the floor, or half the
    baseline's), the baseline with the lowest short P90, and what each side's decoding cost (TPOT P90, end-to-end
    P90; left out for rows of runs from before they were kept): where the baseline's TTFT was bought by deferring its
    decode passes, these say so."""
    target = p.get("short_target_s")
    floor = p.get("short_floor_s")
    basis = "twice the floor" if target is not None and floor is not None and target == 2 * floor else "half the baseline's"
    line = (f"  {v['workload']} at {p['load'] / v['saturation_load']:.2f}× short P90: laps {ms(p['laps_short_p90_client_s'], 2)} / "
            f"target {ms(target, 2)} ms ({basis}; {p.get('best_short_policy') or 'best baseline'} {ms(p['best_short_p90_client_s'], 2)} ms)")
    if p.get("laps_tpot_p90_s") is not None or p.get("best_short_tpot_p90_s") is not None:
        line += (f"; TPOT P90 {ms(p.get('laps_tpot_p90_s'))} / {ms(p.get('best_short_tpot_p90_s'))} ms, "
                 f"end-to-end P90 {ms(p.get('laps_e2e_p90_s'), 0)} / {ms(p.get('best_short_e2e_p90_s'), 0)} ms")
    bound = p.get("short_decode_floor_s")
    if bound is not None:
        line += (f"; a first token waits for a decode engine's pass: with the decode passes and cache hits of laps' run, "
                 f"the short P90 gets no lower than {ms(bound, 2)} ms"
                 f"{' (the target is below that)' if target is not None and target < bound else ''}")
    return line


def print_verdicts(verdicts: list[dict], console: Console) -> bool:
    table = Table(title=f"laps (examples/sim-h200x8.yaml) against the best baseline at each load; SLO {SLO_TTFT_S} s")
    for col in ("workload", "sat. load", "never worse (+0.5 pt)", "knee: laps / best", "goodput (× sat.) laps / best",
                "prefill busy / load at sat.", "short P90", "floor: at knee / goodput ceiling (est.)"):
        table.add_column(col, justify="right")
    all_ok = True
    for v in verdicts:
        knee = v["knee"]
        knee_s = "no knee" if knee is None else f"{100 * knee['laps']:.1f}% / {100 * knee['best']:.1f}% {'ok' if knee['ok'] else 'MISS'}"
        g = v["goodput"]
        all_ok &= v["never_worse"] and (knee is None or knee["ok"]) and g["ok"] and v["short_p90"]
        table.add_row(v["workload"], f"{v['saturation_load']:.3g}", "yes" if v["never_worse"] else "NO", knee_s,
                      f"{g['laps_load'] / v['saturation_load']:.2f} / {g['best_load'] / v['saturation_load']:.2f} ({g['best_policy']}) "
                      f"= {_times(g['ratio'])} {'ok' if g['ok'] else 'MISS'}",
                      _prefill_cell(v),
                      "ok" if v["short_p90"] else "MISS", _floor_cell(v))
    console.print(table)
    control = Table(title=f"laps against {CONTROL} (least_load to engines with laps' own flags): what the scheduling "
                          "alone buys; not part of the verdict")
    for col in ("workload", "laps − control, worst load (points)", "at the control's knee: laps / control", "goodput laps / control"):
        control.add_column(col, justify="right")
    for v in verdicts:
        c = v.get("same_flags")
        if c is None:
            control.add_row(v["workload"], "n/a", "n/a", "n/a")
            continue
        knee = c["knee"]
        control.add_row(v["workload"], f"{100 * c['max_excess']:+.2f}",
                        "no knee" if knee is None else f"{100 * knee['laps']:.1f}% / {100 * knee['control']:.1f}%",
                        _times(c["goodput_ratio"]))
    console.print(control)
    short_misses = [short_miss_line(v, p) for v in verdicts for p in v["points"] if p["short_ok"] is False]
    worse = [f"  {v['workload']} at {p['load'] / v['saturation_load']:.2f}× (load {p['load']:g}): laps {100 * p['laps']:.1f}% "
             f"(length-aware {100 * p['laps_length']:.1f}%) vs best {100 * p['best']:.1f}% "
             f"({p['best_policy']}; length-aware {100 * p['best_length']:.1f}%)"
             for v in verdicts for p in v["points"] if not p["never_worse"]]
    for heading, lines in ((f"short-P90 misses (each TTFT as a client sees it: simulated + the gateway's "
                            f"{ms(GATEWAY_OVERHEAD_S, 2)} ms):", short_misses),
                           ("worse than the best baseline by more than 0.5 points:", worse)):
        if lines:
            console.print(heading)
            for line in lines:
                console.print(line, soft_wrap=True)
    console.print("verdict: " + ("laps meets every target" if all_ok else "laps misses at least one target (rows above)"))
    return all_ok


def dominance_json(duration_s: float, rows: list[dict], verdicts: list[dict], ok: bool | None) -> dict:
    """The JSON: settings, every row, the verdicts so far and whether all targets are met (``None`` until the end)."""
    return {"slo_ttft_s": SLO_TTFT_S, "per_1k_new_tokens_s": PER_1K_S, "max_duration_s": duration_s, "rows": rows,
            "verdict": verdicts, "all_targets_met": ok}


def write_json(path: Path, data: dict) -> None:
    """``data`` as indented JSON at ``path``, through :func:`~loadgen.outputs.open_output`: a regular file (or one a link
    names) is written beside itself and renamed over, so an interrupted or failed write leaves the previous file whole
    and no partial one; a stream (``/dev/stdout``) is appended to.

    Raises:
        OSError: it cannot be written (a full disk).
    """
    with open_output(path) as f:
        f.write(json.dumps(data, indent=1).encode() + b"\n")


@dataclass(frozen=True)
class Claim:
    """What :func:`claim_out` made for ``--out``, for a run that ends with nothing to write to take back: the empty file
    (at a link's target; None where it was there, or for a stream) and the folders (innermost first)."""

    file: Path | None = None
    folders: tuple[Path, ...] = ()

    def release(self) -> None:
        """Remove the file if it is still empty, then each folder while it is empty; anything with something in it
        stays (a link to the file stays as it was)."""
        if self.file is not None and self.file.is_file() and self.file.stat().st_size == 0:
            self.file.unlink()
        remove_empty(self.folders)


def save(parser: argparse.ArgumentParser, console: Console, path: Path, data: dict, claim: Claim) -> bool:
    """:func:`write_json` a bench's finished JSON and say so; whether it was written: where it cannot be (a full disk,
    ``/dev/full``) one line says why, and what this run made for it is taken back (:meth:`Claim.release`)."""
    try:
        write_json(path, data)
    except OSError as err:
        print(f"{parser.prog}: cannot write {path}: {err.strerror or err}", file=sys.stderr)
        claim.release()
        return False
    console.print(f"wrote {path}")
    return True


def bench_console(width: int, out: Path | None) -> Console:
    """The console a bench prints its tables on: standard error where ``out`` (its JSON) goes to standard output, so
    that stays one JSON document (:func:`~loadgen.outputs.is_stdout`)."""
    return Console(width=width, stderr=out is not None and is_stdout(out))


def claim_out(parser: argparse.ArgumentParser, path: Path, plots: Sequence[Path] = ()) -> Claim:
    """Make sure ``path`` can take a bench's output before any simulation (not after hours of it): refused as ``laps
    simulate`` refuses an ``--out`` (:func:`~loadgen.outputs.check_output_path`), as are the ``plots`` to be written beside
    it (none beside a stream), else its folders made (at a link's target) and the file created empty if absent; what
    this call made (take it back with :meth:`Claim.release` if the run ends with nothing to write). A stream
    (:func:`~loadgen.outputs.is_stream`) is left as it is.

    Raises:
        SystemExit: through ``parser.error`` (exit 2) where ``path`` or a plot is refused or cannot be created; what
            this call made is taken back first.
    """
    try:
        check_output_path("--out", path)
        stream = is_stream(path)
        for png in () if stream else plots:
            check_output_path("--out's plot", png)
    except ValueError as err:
        parser.error(str(err))
    claim = Claim()
    if stream:
        return claim
    try:
        target = path.resolve()
        claim = Claim(None, make_folders(target.parent))
        if not target.exists():
            target.touch()
            claim = Claim(target, claim.folders)
    except OSError as err:  # made impossible since the check
        claim.release()
        parser.error(f"--out {path}: cannot be created ({err.strerror or err})")
    return claim


def stopped(parser: argparse.ArgumentParser, claim: Claim, err: BaseException, kept: str | None = None) -> int:
    """A bench run stopped by ``err`` before its whole output was written (call it from ``except BaseException``):
    what this run made for its output taken back (:func:`claim_out`) unless something was written to it (``kept``:
    what it holds, then). On Ctrl-C a line says so and the exit code is 130.

    Raises:
        BaseException: ``err`` again, unless it is a ``KeyboardInterrupt``.
    """
    if kept is None:
        claim.release()
    if not isinstance(err, KeyboardInterrupt):
        raise err
    print(f"{parser.prog}: interrupted; {kept or 'nothing written'}", file=sys.stderr)
    return 130


ROW_KEYS = ("workload", "policy", "pd", "load")  # what names a row
ROW_RATES = ("slo_violation_rate", "length_slo_violation_rate", "violation_floor")  # shares of a run's requests
ROW_NUMBERS = ("load", "rate_rps", "slo_violation_rate", "length_slo_violation_rate", "short_ttft_p90_s", "short_floor_s",
               "short_decode_floor_s", "tpot_p90_s", "e2e_p90_s", "prefill_busy_fraction", "prefill_load",
               "violation_floor")  # None or a number


def _finite_number(value) -> bool:
    """Whether a value read from JSON is a finite number (not a bool, a string, NaN, an infinity or an integer too large
    for a float)."""
    try:
        return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    except OverflowError:
        return False


def earlier_verdicts(parser: argparse.ArgumentParser, path: Path) -> tuple[dict, list[dict]]:
    """An earlier run's JSON (``--verdict-of``) and its verdicts computed again from its rows.

    Raises:
        SystemExit: through ``parser.error`` (exit 2): the file cannot be read or is no ``dominance.py`` JSON; it holds
            no verdict; a verdict's ``saturation_load`` is not a positive number; a workload lacks rows of laps or of
            every baseline, or has them at no common load; a row or verdict lacks a field, or a row's number
            (:data:`ROW_NUMBERS`) is not one.
    """
    try:
        if not path.is_file():
            parser.error(f"--verdict-of {path}: {'a directory' if path.is_dir() else 'no such file'}")
        earlier = json.loads(path.read_text())
        earlier["rows"], earlier["verdict"], earlier["max_duration_s"]  # noqa: B018 (keys checked here)
    except OSError as err:  # a folder that cannot be searched, a name too long
        parser.error(f"--verdict-of {path}: cannot be read ({err.strerror or err})")
    except (ValueError, KeyError, TypeError) as err:
        parser.error(f"--verdict-of {path}: not a dominance.py JSON ({type(err).__name__}: {err})")
    verdicts = []
    try:
        if not earlier["verdict"]:
            parser.error(f"--verdict-of {path}: no workload's verdict in it (a run writes one as each workload ends)")
        if not isinstance(earlier["rows"], list) or not isinstance(earlier["verdict"], list):
            parser.error(f"--verdict-of {path}: its rows and verdict must be lists")
        for i, r in enumerate(earlier["rows"]):
            if not isinstance(r, dict):
                parser.error(f"--verdict-of {path}: row {i} is not an object, got {reprlib.repr(r)}")
            if missing := [key for key in ROW_KEYS if key not in r]:
                parser.error(f"--verdict-of {path}: row {i} lacks {', '.join(missing)}")
            row = f"row {i} ({sweep_label(r['workload'], r['pd'])}, {r['policy']}, load {reprlib.repr(r['load'])})"
            for key in ROW_NUMBERS:  # loads, rates, latencies, shares: none below 0, no rate above 1
                value, most = r.get(key), 1 if key in ROW_RATES else math.inf
                if value is not None and not (_finite_number(value) and 0 <= value <= most):
                    parser.error(f"--verdict-of {path}: {row}: {key} must be a number "
                                 f"{'from 0 to 1' if most == 1 else '>= 0'}, got {reprlib.repr(value)}")
        for v in earlier["verdict"]:
            sat = v["saturation_load"]
            if not (_finite_number(sat) and sat > 0):
                parser.error(f"--verdict-of {path}: {v['workload']}: saturation_load must be a positive number, got {sat!r}")
            rows = [r for r in earlier["rows"] if sweep_label(r["workload"], r["pd"]) == v["workload"]]
            policies = {r["policy"] for r in rows}
            if "laps" not in policies or not policies & set(BASELINES):
                parser.error(f"--verdict-of {path}: {v['workload']}: a verdict needs rows of laps and of a baseline, "
                             f"found {', '.join(sorted(policies)) or 'no rows'}")
            verdicts.append(verdict(rows, v["workload"], float(sat)))
            if not verdicts[-1]["points"]:
                parser.error(f"--verdict-of {path}: {v['workload']}: no load has rows of both laps and a baseline")
    except (KeyError, TypeError, ValueError, OverflowError) as err:
        parser.error(f"--verdict-of {path}: a row or verdict lacks a field or holds one of the wrong type ({type(err).__name__}: {err})")
    return earlier, verdicts


def main(argv: list[str] | None = None) -> int:
    parser = doc_parser(__doc__)
    parser.add_argument("--out", type=output_file, help="JSON output; one PNG per workload goes next to it, none beside a stream "
                        "such as /dev/stdout, which takes the JSON once at the end (required unless --verdict-of)")
    parser.add_argument("--quick", action="store_true", help="3 workloads, 4 loads, at most 6 simulated s of arrivals per Poisson point")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, help="default: all (with --quick: %s)" % ", ".join(QUICK_WORKLOADS))
    parser.add_argument("--pd", action="store_true", help="also the PD runs (6 prefill + 2 decode) of mixed and docs")
    parser.add_argument("--duration", type=positive_float, help="most simulated seconds of arrivals per point (default: 10, --quick 6; "
                                                       "fewer where ~3,000 arrivals come sooner, at least 1.5; "
                                                       "a replayed workload replays its first ~3,000 requests at every load)")
    parser.add_argument("--jobs", type=positive_int, default=2, help="simulations in parallel (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="workload and arrival seed (default: %(default)s)")
    parser.add_argument("--seeds", type=positive_int, default=1, help="seeds per point, averaged (seed, seed+1, ...): one run's "
                                                             "noise in overload is ~1 point (default: %(default)s)")
    parser.add_argument("--burstiness", type=gamma_shape, default=1.0,
                        help="gamma shape of the Poisson workloads' arrival gaps, the same mean (1: Poisson; 0.25: bursts, "
                             "coefficient of variation 2; laps simulate --burstiness); replayed workloads keep their times "
                             "(default: %(default)s)")
    parser.add_argument("--verdict-of", type=Path, metavar="JSON", help="simulate nothing: the verdict of an earlier run's JSON")
    args = parser.parse_args(argv)
    console = bench_console(160, args.out)
    if args.verdict_of is not None:
        earlier, verdicts = earlier_verdicts(parser, args.verdict_of)
        claim = claim_out(parser, args.out) if args.out is not None else Claim()
        ok = print_verdicts(verdicts, console)
        if args.out is None:
            return 0 if ok else 1
        saved = save(parser, console, args.out, dominance_json(earlier["max_duration_s"], earlier["rows"], verdicts, ok), claim)
        return 0 if saved and ok else 1
    if args.out is None:
        parser.error("--out is required (unless --verdict-of)")
    workloads = args.workloads or (QUICK_WORKLOADS if args.quick else WORKLOADS)
    loads = QUICK_LOADS if args.quick else LOADS
    duration = args.duration or (QUICK_MAX_DURATION_S if args.quick else MAX_DURATION_S)
    runs = [(w, False) for w in workloads] + ([(w, True) for w in PD_WORKLOADS] if args.pd else [])
    replayed = [w for w in workloads if w in TRACE_RATE_RPS]
    if args.duration is not None and replayed:
        console.print(f"note: --duration does not bound {', '.join(replayed)}: a replayed workload replays its first "
                      f"~{REQUESTS_PER_POINT:,} requests at every load")
    all_rows, verdicts, written = [], [], []
    claim = claim_out(parser, args.out, [sweep_plot(args.out, w, pd) for w, pd in runs])
    try:
        with simulation_pool(args.jobs) as pool, Progress(console=console, transient=True) as progress:
            for workload, pd in runs:
                rows, v = sweep(workload, pd, loads, duration, args.seed, pool, progress, args.seeds, args.burstiness)
                all_rows += rows
                verdicts.append(v)
                if is_stream(args.out):  # no PNG beside a stream, and the JSON goes there once, whole, at the end
                    continue
                png = sweep_plot(args.out, workload, pd)
                writing = png
                try:
                    plot(rows, png, v["workload"], v["saturation_load"])
                    console.print(f"{v['workload']}: wrote {png}")
                    writing = args.out
                    write_json(args.out, dominance_json(duration, all_rows, verdicts, None))  # survives an interrupted run
                except OSError as err:  # a full disk, a name too long: one line; an earlier workload's JSON stays
                    print(f"{parser.prog}: cannot write {writing}: {err.strerror or err}", file=sys.stderr)
                    claim.release()
                    return 1
                written.append(v["workload"])
    except BaseException as err:  # what is written survives; an empty file this run made does not
        done = ", ".join(written)
        return stopped(parser, claim, err, f"{args.out} holds {done} (--verdict-of reads it)" if done else None)
    ok = print_verdicts(verdicts, console)
    return 0 if save(parser, console, args.out, dominance_json(duration, all_rows, verdicts, ok), claim) and ok else 1


if __name__ == "__main__":
    sys.exit(main())
