"""Sorted-F, MC-SF and FCFS backlog admission in the gateway, in virtual time, under Poisson overload.

    python bench/backlog_overload.py --out runs/backlog_overload.json           # ~1 min on 2 cores
    python bench/backlog_overload.py --out /tmp/quick.json --quick              # ~15 s

Deployment: one simulated engine (Qwen2.5-7B on one A100, the paper's GPU class) whose KV pool
is ``--max-total-tokens 16492``, the M of Wang, Ye, Zhou (arXiv 2508.06133); the gateway runs
``scheduling.policy: backlog`` with ``backlog.policy`` = sorted_f / mc_sf / fcfs, M read from the
engine core's ``max_total_tokens`` as the live gateway reads it from ``/v1/loads``.

Workload: the ``mixed`` data set (80% real chat turns from hh-rlhf and MT-Bench, 20% long
single-turn requests with Azure-trace prompt and output lengths) flattened into independent
single-turn requests (each user turn alone), arriving as a Poisson process, so every policy
serves the same requests (multi-turn closed-loop chats would let a faster policy send more
turns). Two settings:

* ``oracle``: ``ignore_eos`` and ``predictor: max_tokens``: every output is exactly its
  ``max_tokens`` (hh-rlhf: the real reply length; Azure: GeneratedTokens; MT-Bench: 256) and
  the scheduler knows it: the paper's known-length setting.
* ``predicted``: replies end where the simulated engine's EOS falls (lognormal, median 30
  tokens), capped by ``max_tokens``; the scheduler predicts ``min(prior 28, max_tokens)``
  (``predictor: history``; single-turn requests carry no reply history).

Capacity: μ = requests completed per second when the engine always has a backlog: a burst of
``--capacity-requests`` arrivals within 0.1 s under FCFS admission, μ = n / (last completion).
Arrival rate λ = ρ μ for ρ in ``--rho`` (default 1.7 and 2.9, the paper's overload points);
arrivals last ``--duration`` seconds and the run continues until every request is done.

Reference, ``paper_model``: the same ρ in the paper's own discrete-time model
(``policies.backlog_executor``: one token per running request per iteration, per-step memory
s_i + j, admission at the ramp's future peak, known lengths), ``--paper-n`` requests of the
offline reproduction's 80/20 LMSYS/arXiv lengths (``bench/sorted_f_table.workload``), Poisson
arrivals in iterations, μ = n / FCFS makespan of the same requests all at t = 0,
Sorted-F-Online (``SortedFOnline``, quantile solver) against MC-SF and FCFS, seconds from
``IterationTime``. It separates what the gateway and the engine model change from what the
online setting itself gives.

Output: mean end-to-end latency per setting, ρ and policy, the change of Sorted-F and FCFS vs
MC-SF next to the paper's (−15.1% at ρ 1.7, −40.0% at ρ 2.9, Sorted-F vs MC-SF), JSON, a rich
table, and a bar plot next to the JSON.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.progress import Progress  # noqa: E402
from rich.table import Table  # noqa: E402

from bench.dominance import bench_console, claim_out, save, stopped  # noqa: E402
from bench.sorted_f_table import workload as paper_lengths  # noqa: E402
from laps.config import Config, parse_config  # noqa: E402
from laps.doc_help import doc_parser  # noqa: E402
from laps.tokenizer import ChatTokenizer, load_tokenizer  # noqa: E402
from loadgen.cli import output_file  # noqa: E402
from loadgen.outputs import is_stream  # noqa: E402
from loadgen.runner import RequestRecord  # noqa: E402
from loadgen.simulate import simulate  # noqa: E402
from loadgen.workloads import Conversation, Workload, build_workload  # noqa: E402
from policies.backlog_baselines import fcfs_order, mc_sf_order  # noqa: E402
from policies.backlog_executor import AdmissionPolicy, IterationTime, StaticOrder, execute  # noqa: E402
from policies.sorted_f import SortedFOnline  # noqa: E402

PAPER_M_TOKENS = 16_492
PAPER_CHANGE_VS_MC_SF = {1.7: -0.151, 2.9: -0.400}
POLICIES = ("sorted_f", "mc_sf", "fcfs")
SETTINGS = {"oracle": ("max_tokens", True), "predicted": ("history", False)}  # name -> (predictor, ignore_eos)
NO_TIMEOUT_S = 1e9


def deployment(policy: str, predictor: str) -> Config:
    """One simulated A100 engine with M = 16,492 KV tokens behind ``policy: backlog``."""
    return parse_config({
        "sim": {"model": "qwen2.5-7b", "gpu": "a100"},
        "node": {"gpus": 1},
        "roles": {"backlog": {"pool": "short", "flags": {"max-total-tokens": PAPER_M_TOKENS}}},
        "engines": [{"name": "e0", "kind": "sim", "role": "backlog", "gpus": [0]}],
        "scheduling": {"policy": "backlog", "backlog": {"policy": policy, "predictor": predictor}},
    }, "backlog_overload")


def single_turns(workload: Workload) -> Workload:
    """``workload`` with every turn as its own single-turn request (the user message alone)."""
    def flat() -> Iterator[Conversation]:
        for c in workload.conversations:
            for k, turn in enumerate(c.turns):
                yield Conversation(f"{c.id}/{k}", c.source, (turn,))
    return Workload(f"{workload.name}-single-turn", flat(), timed=False, notes=workload.notes)


def run(policy: str, setting: str, rate: float, duration_s: float, seed: int, tok: ChatTokenizer) -> list[RequestRecord]:
    """One virtual run; every request of the arrival plan, completed."""
    predictor, ignore_eos = SETTINGS[setting]
    workload = single_turns(build_workload("mixed", random.Random(f"workload/{seed}"), tokenizer=tok, long_share=0.2))
    records = simulate(deployment(policy, predictor), workload, duration_s=duration_s, seed=seed, rate=rate,
                       ignore_eos=ignore_eos, request_timeout_s=NO_TIMEOUT_S, tokenizer=tok)
    failed = [r for r in records if not r.ok]
    if failed:
        raise RuntimeError(f"{policy}/{setting}: {len(failed)} requests failed, e.g. {failed[0].error}")
    return records


def capacity_rps(setting: str, requests: int, seed: int, tok: ChatTokenizer) -> float:
    """μ: requests per second the deployment completes with a standing backlog (FCFS; module doc)."""
    records = run("fcfs", setting, requests / 0.1, 0.1, seed, tok)
    return len(records) / max(r.end_s for r in records)


def paper_model_means(rho: float, n: int, seed: int) -> tuple[float, dict[str, float]]:
    """One seed of the ``paper_model`` reference (module doc): (μ per iteration, {policy: mean e2e s})."""
    s, o, _ = paper_lengths(seed, n, 0.2, PAPER_M_TOKENS)
    mu = n / execute(s, o, PAPER_M_TOKENS, fcfs_order(n)).finish.max()
    gaps = np.random.default_rng(seed + 1).exponential(1 / (rho * mu), n)
    arrival = np.floor(np.cumsum(gaps)).astype(np.int64)
    policies: dict[str, AdmissionPolicy] = {"sorted_f": SortedFOnline(s, o, PAPER_M_TOKENS),
                                            "mc_sf": StaticOrder(mc_sf_order(o)), "fcfs": StaticOrder(fcfs_order(n))}
    return mu, {name: float(IterationTime().latency_s(execute(s, o, PAPER_M_TOKENS, policy, arrival)).mean())
                for name, policy in policies.items()}


def summarise(rho: float, per_seed: list[dict[str, float]], requests: int) -> dict:
    """A result row: per-policy mean over seeds, per-seed values, changes vs MC-SF, the paper's figure."""
    means = {p: statistics.fmean(m[p] for m in per_seed) for p in POLICIES}
    return {"rho": rho, "requests": requests, "mean_e2e_s": means, "per_seed_mean_e2e_s": per_seed,
            "change_vs_mc_sf": {p: means[p] / means["mc_sf"] - 1 for p in POLICIES},
            "paper_sorted_f_change_vs_mc_sf": PAPER_CHANGE_VS_MC_SF.get(rho)}


def mean_e2e_s(records: list[RequestRecord]) -> float:
    return sum(r.e2e_s for r in records) / len(records)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(results)
    fig, axes = plt.subplots(1, len(settings), figsize=(5 * len(settings), 3.6), squeeze=False)
    for ax, setting in zip(axes[0], settings):
        rows = results[setting]["by_rho"]
        width = 0.8 / len(POLICIES)
        for j, policy in enumerate(POLICIES):
            xs = [i + (j - 1) * width for i in range(len(rows))]
            ax.bar(xs, [row["mean_e2e_s"][policy] for row in rows], width, label=policy)
        ax.set_xticks(range(len(rows)), [f"ρ = {row['rho']:g}" for row in rows])
        ax.set_ylabel("mean end-to-end latency (s)")
        ax.set_title(f"{setting}, M = {PAPER_M_TOKENS:,} tokens")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = doc_parser(__doc__, epilog=None)
    parser.add_argument("--out", type=output_file, required=True,
                        help="JSON results path (a PNG plot is written next to it, none beside a stream such as /dev/stdout)")
    parser.add_argument("--rho", type=float, nargs="+", default=[1.7, 2.9], help="overload factors λ/μ (default: %(default)s)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per run, virtual time (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="first seed (default: %(default)s)")
    parser.add_argument("--seeds", type=int, default=1,
                        help="seeds per point (arrivals and workload order); means are averaged (default: %(default)s)")
    parser.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), default=list(SETTINGS),
                        help="oracle (exact output lengths) and/or predicted (default: both)")
    parser.add_argument("--capacity-requests", type=int, default=1000, help="burst size of the capacity measurement (default: %(default)s)")
    parser.add_argument("--paper-n", type=int, default=2000, help="requests of the paper-model reference (default: %(default)s; 0 skips it)")
    parser.add_argument("--quick", action="store_true", help="20 s of arrivals, a 400-request capacity burst, --paper-n 500")
    args = parser.parse_args(argv)
    if args.quick:
        args.duration, args.capacity_requests, args.paper_n = 20.0, 400, min(args.paper_n, 500)
    png = args.out.with_suffix(".png")
    claim = claim_out(parser, args.out, [png])  # before the runs, not after minutes of them
    console = bench_console(150, args.out)
    tok = load_tokenizer(None)
    seeds = range(args.seed, args.seed + args.seeds)
    results: dict = {}
    started = time.perf_counter()
    try:
        with Progress(console=console) as progress:
            runs = len(args.settings) * (1 + len(args.rho) * len(POLICIES) * len(seeds)) + bool(args.paper_n) * len(args.rho) * len(seeds)
            task = progress.add_task("runs", total=runs)
            for setting in args.settings:
                mu = capacity_rps(setting, args.capacity_requests, args.seed, tok)
                progress.advance(task)
                rows = []
                for rho in args.rho:
                    per_seed, requests = [], 0
                    for seed in seeds:
                        means = {}
                        for policy in POLICIES:
                            progress.update(task, description=f"{setting} ρ={rho:g} seed {seed} {policy}")
                            records = run(policy, setting, rho * mu, args.duration, seed, tok)
                            means[policy] = mean_e2e_s(records)
                            progress.advance(task)
                        per_seed.append(means)
                        requests += len(records)
                    rows.append({**summarise(rho, per_seed, requests), "rate_rps": rho * mu})
                results[setting] = {"capacity_rps": mu, "by_rho": rows}
            if args.paper_n:
                rows = []
                for rho in args.rho:
                    per_seed = []
                    for seed in seeds:
                        progress.update(task, description=f"paper model ρ={rho:g} seed {seed}, n = {args.paper_n}")
                        mu, means = paper_model_means(rho, args.paper_n, seed)
                        per_seed.append(means)
                        progress.advance(task)
                    rows.append(summarise(rho, per_seed, args.paper_n * len(seeds)))
                results["paper_model"] = {"capacity_rps": mu, "by_rho": rows}
    except BaseException as err:
        return stopped(parser, claim, err)
    out = {"config": {"m_tokens": PAPER_M_TOKENS, "duration_s": args.duration, "seeds": list(seeds),
                      "capacity_requests": args.capacity_requests, "workload": "mixed (long_share 0.2), single-turn",
                      "engine": "sim qwen2.5-7b / a100, max-total-tokens 16492"},
           "settings": results, "wall_s": time.perf_counter() - started}
    if not save(parser, console, args.out, out, claim):
        return 1
    stream = is_stream(args.out)
    if not stream:
        plot(results, png)

    table = Table(title=f"Mean end-to-end latency, M = {PAPER_M_TOKENS:,} tokens (vs MC-SF; paper: Sorted-F vs MC-SF)")
    for col in ("setting", "μ req/s (paper model: per iteration)", "ρ", "requests", *POLICIES, "Sorted-F vs MC-SF", "paper", "FCFS vs MC-SF"):
        table.add_column(col, justify="right")
    for setting, res in results.items():
        for row in res["by_rho"]:
            paper = row["paper_sorted_f_change_vs_mc_sf"]
            table.add_row(setting, f"{res['capacity_rps']:.3g}", f"{row['rho']:g}", str(row["requests"]),
                          *(f"{row['mean_e2e_s'][p]:.2f} s" for p in POLICIES),
                          f"{row['change_vs_mc_sf']['sorted_f']:+.1%}", "—" if paper is None else f"{paper:+.1%}",
                          f"{row['change_vs_mc_sf']['fcfs']:+.1%}")
    console.print(table)
    console.print(f"{'' if stream else f'wrote {png} '}({out['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
