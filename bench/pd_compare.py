"""Prefill–decode disaggregated deployments in virtual time: LAPS vs the router baselines, and the KV-transfer burst.

    python bench/pd_compare.py --out runs/pd_compare/pd.json           # ~2.5 min on 2 cores
    python bench/pd_compare.py --out /tmp/pd_quick.json --quick        # ~1 min

Eight simulated Qwen2.5-7B engines on H200s (the LAPS paper's setting):

* ``PD 4P+4D`` and ``PD 6P+2D``: prefill engines feed decode engines over the
  ``--link`` (:mod:`engines.sim.kv_transfer`), run by
  :class:`loadgen.virtual_pd.VirtualPDRun`. ``laps`` runs twice: prefill
  engines half ``short-prefill``, half ``long-prefill`` (the authors' fork),
  and a quarter short (``laps_splits``); ``round_robin``, ``bucket``
  (the SGLang router's PD prefill policy) and ``cache_aware`` route over
  prefill engines with SGLang's default flags. Decode engines run SGLang's
  defaults; the decode engine is the least loaded (``scheduling.decode_placement``).
* ``DP 8`` (reference, no PD): eight whole engines as in
  ``bench/policy_compare.py`` (``round_robin`` is SGLang's data-parallel
  dispatch; ``laps`` 4 short + 4 long).

Online: the ``mixed`` workload (multi-turn hh-rlhf and MT-Bench chats, 20% long
Azure-trace requests), Poisson conversation arrivals at each ``--rates`` value,
TTFT SLO 0.4 s. TTFT is the client's first text token: in PD, the token the
prefill engine sampled, streamed by the decode engine once the KV arrived.
Each row: ``{setup, policy, conv_rate, rate_rps, slo_violation_rate,
ttft_p50_s, ttft_p90_s, short_ttft_p90_s, transfer_ms_mean, transfer_inflation_mean,
transfer_inflation_p90, burst_mean}`` (transfer fields in PD only: a transfer's
inflation is its time over its time alone on an idle link; ``burst_mean`` is the
mean number of transfers a prefill engine started at the same instant).

Offline (deadline-free distillation, ``offline`` in the JSON): ``--offline-requests``
ShareGPT first-turn prompts all sent at t = 0 with 1,024-token outputs
(``ignore_eos``) to PD 4P+4D; the end-to-end time is when the last one ends
(LAPS with a one-hour TTFT target, i.e. no deadlines).

Burst (the paper's open question D2, ``burst`` in the JSON): LAPS 1s/3l on PD 4P+4D at
the lowest rate (below saturation, so TTFT differences are the links') with each link preset, once with shared links (transfers leaving
one engine together share its port) and once with unshared links (every
transfer alone on the link): transfer inflation and the TTFT they cost.

Writes the JSON, prints the tables, and draws violation rate and P90 TTFT
against the offered conversation rate per setup next to the JSON.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402
from rich.progress import Progress  # noqa: E402
from rich.table import Table  # noqa: E402

from bench.policy_compare import POLICIES, ROLES, SLO_TTFT_S, deployment, plot_rate_panels  # noqa: E402
from engines.sim.kv_transfer import LINKS  # noqa: E402
from laps.config import Config, parse_config  # noqa: E402
from laps.doc_help import doc_parser  # noqa: E402
from laps.tokenizer import load_tokenizer  # noqa: E402
from loadgen.report import build_report, ms  # noqa: E402
from loadgen.runner import Arrival, plan_arrivals  # noqa: E402
from loadgen.virtual import VirtualRun  # noqa: E402
from loadgen.virtual_pd import VirtualPDRun  # noqa: E402
from loadgen.workloads import build_workload  # noqa: E402

SETUPS = {"PD 4P+4D": (4, 4), "PD 6P+2D": (6, 2), "DP 8": (8, 0)}
"""Setup -> (prefill or whole engines, decode engines)."""
PD_POLICIES = ("laps", "round_robin", "bucket", "cache_aware")
DP_POLICIES = ("laps", "round_robin")
ROUTER_POLICIES = ("bucket", "cache_aware")
DECODE_ROLE = {"pool": "decode", "flags": {}}
OFFLINE_MAX_TOKENS = 1024
OFFLINE_TTFT_S = 3600.0  # deadline-free: no request is ever urgent
TRANSFER_NOTE = ("inflation = a KV transfer's time over its time alone on an idle link (1 = no contention), mean over "
                 "transfers; burst = transfers the same prefill engine started at the same instant, mean per transfer "
                 "(1 = never batched).")
PAPER = {
    "violations_8_instances": "LAPS 0% vs SGLang router 4.7% (8 instances)",
    "vs_data_parallel": "SLO violations -28% vs plain data parallel",
    "offline_e2e": "7.3-8.3% shorter end-to-end time (distillation, 4P+4D, 1K outputs)",
}


def pd_deployment(n_prefill: int, n_decode: int, policy: str, link: str, ttft_s: float = SLO_TTFT_S,
                  short_prefill: int | None = None) -> Config:
    """The PD deployment ``policy`` runs on (module doc): prefill roles as in ``bench/policy_compare.py``, then decode.

    ``short_prefill``: LAPS's short-prefill engines (default: half the prefill engines).
    """
    _, role = POLICIES[policy]
    if role is not None:
        prefill = [role] * n_prefill
    else:
        n_short = n_prefill // 2 if short_prefill is None else short_prefill
        prefill = ["short-prefill"] * n_short + ["long-prefill"] * (n_prefill - n_short)
    roles = prefill + ["decode"] * n_decode
    role_defs = {name: ROLES[name] for name in set(prefill)} | {"decode": DECODE_ROLE}
    return parse_config({
        "model": {"name": "Qwen2.5-7B-Instruct"},
        "slo": {"ttft_s": ttft_s},
        "sim": {"model": "qwen2.5-7b", "gpu": "h200"},
        "scheduling": {"policy": POLICIES[policy][0]},
        "pd": {"link": link},
        "roles": role_defs,
        "engines": [{"name": f"e{i}", "kind": "sim", "role": r, "gpus": [i]} for i, r in enumerate(roles)],
    }, f"pd_compare[{policy}]")


def transfer_stats(run: VirtualPDRun) -> dict:
    """Transfer time, inflation over an idle link, and burst size of a finished PD run."""
    done = run.transfers
    if not done:
        return {"transfers": 0}
    inflation = sorted(t.inflation for t in done)
    bursts = Counter((t.src, t.start_s) for t in done)
    return {
        "transfers": len(done),
        "transfer_ms_mean": 1e3 * statistics.fmean(t.end_s - t.start_s for t in done),
        "transfer_ms_max": 1e3 * max(t.end_s - t.start_s for t in done),
        "transfer_inflation_mean": statistics.fmean(inflation),
        "transfer_inflation_p90": inflation[int(0.9 * (len(inflation) - 1))],
        "burst_mean": statistics.fmean(bursts[(t.src, t.start_s)] for t in done),  # per transfer
    }


def laps_splits(n_prefill: int) -> list[int]:
    """LAPS's short-prefill engine counts tried on ``n_prefill`` prefill engines: half (the authors' fork), and a quarter.

    (DP 8 runs the half split only: it is the reference, not the subject.)
    """
    return sorted({n_prefill // 2, max(1, n_prefill // 4)}, reverse=True)


def online_point(setup: str, policy: str, conv_rate: float, duration_s: float, seed: int, link: str,
                 shared_links: bool = True, short_prefill: int | None = None) -> dict:
    """Simulate one (setup, policy, rate) point; the row for the JSON (``policy`` "laps" gets its split, e.g. "laps 1s/3l")."""
    tokenizer = load_tokenizer()
    workload = build_workload("mixed", random.Random(f"workload/{seed}"), tokenizer=tokenizer)
    plan = plan_arrivals(workload, duration_s=duration_s, rng=random.Random(f"arrivals/{seed}"), rate=conv_rate)
    n_prefill, n_decode = SETUPS[setup]
    if n_decode:
        config = pd_deployment(n_prefill, n_decode, policy, link, short_prefill=short_prefill)
        run: VirtualRun = VirtualPDRun(config, tokenizer, shared_links=shared_links)
    else:
        config = deployment(n_prefill, policy, short_prefill)
        run = VirtualRun(config, tokenizer)
    records = run.run(plan, duration_s)
    report = build_report(records, slo_ttft_s=SLO_TTFT_S)
    pools = [config.pool(e) for e in config.engines]
    label = f"{policy} {pools.count('short')}s/{pools.count('long')}l" if policy == "laps" else policy
    row = {
        "setup": setup, "policy": label, "conv_rate": conv_rate, "rate_rps": report["throughput_rps"],
        "requests": report["requests"]["sent"], "errors": report["requests"]["errors"],
        "slo_violation_rate": report["slo"]["violation_rate"],
        "ttft_p50_s": report["ttft_s"]["p50"], "ttft_p90_s": report["ttft_s"]["p90"],
        "short_ttft_p90_s": report["by_class"]["short"]["ttft_s"]["p90"],
    }
    if isinstance(run, VirtualPDRun):
        row |= {"link": link, "shared_links": shared_links, **transfer_stats(run)}
    return row


def offline_point(policy: str, n_requests: int, seed: int, link: str, short_prefill: int | None = None) -> dict:
    """All ``n_requests`` ShareGPT prompts at t = 0 with 1,024-token outputs on PD 4P+4D; the row."""
    tokenizer = load_tokenizer()
    workload = build_workload("sharegpt", random.Random(f"workload/{seed}"), tokenizer=tokenizer,
                              default_max_tokens=OFFLINE_MAX_TOKENS)
    convs = [next(workload.conversations) for _ in range(n_requests)]
    plan = [Arrival(0.0, conv, ()) for conv in convs]
    config = pd_deployment(4, 4, policy, link, ttft_s=OFFLINE_TTFT_S, short_prefill=short_prefill)
    run = VirtualPDRun(config, tokenizer, ignore_eos=True, request_timeout_s=1e6)
    records = run.run(plan, 1.0)
    ok = [r for r in records if r.ok]
    return {
        "setup": "PD 4P+4D offline", "policy": policy if short_prefill is None else f"{policy} {short_prefill}s/{4 - short_prefill}l",
        "requests": len(records), "errors": len(records) - len(ok),
        "e2e_makespan_s": max(r.end_s for r in records),
        "prefill_done_s": max(r.start_s + r.ttft_s for r in ok if r.ttft_s is not None),
        "output_tokens_per_s": sum(r.completion_tokens or 0 for r in ok) / max(r.end_s for r in records),
        **transfer_stats(run),
    }


def plot(rows: list[dict], path: Path) -> None:
    """Violation rate and P90 TTFT against the offered conversation rate, one panel pair per setup.

    (The offered rate, not the achieved req/s: a follow-up turn waits for the reply before it, so a slower policy
    sends fewer turns in the same run and the achieved rate of one offered load differs between rows.)
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setups = list(dict.fromkeys(r["setup"] for r in rows))
    fig, axes = plt.subplots(2, len(setups), figsize=(4.6 * len(setups), 7.5), squeeze=False)
    for col, setup in enumerate(setups):
        plot_rate_panels(axes[0][col], axes[1][col], [r for r in rows if r["setup"] == setup], setup,
                         x_key="conv_rate", x_label="offered conversation rate (conv/s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def headline(rows: list[dict]) -> list[dict]:
    """Per setup and rate: LAPS's violation rate beside the best router baseline's and DP round robin's, with ratios."""
    out = []
    by_key = {(r["setup"], r["policy"], r["conv_rate"]): r for r in rows}
    for setup in ("PD 4P+4D", "PD 6P+2D"):
        for rate in sorted({r["conv_rate"] for r in rows if r["setup"] == setup}):
            routers = [by_key[k] for k in ((setup, p, rate) for p in ROUTER_POLICIES) if k in by_key]
            dp = by_key.get(("DP 8", "round_robin", rate))
            if not routers:
                continue
            best = min(routers, key=lambda r: r["slo_violation_rate"])
            for laps in (r for r in rows if r["setup"] == setup and r["conv_rate"] == rate and r["policy"].startswith("laps")):
                out.append({
                    "setup": setup, "conv_rate": rate, "laps_policy": laps["policy"], "laps": laps["slo_violation_rate"],
                    "best_router": best["policy"], "router": best["slo_violation_rate"],
                    "dp_round_robin": dp["slo_violation_rate"] if dp else None,
                    "laps_vs_dp_change": (laps["slo_violation_rate"] / dp["slo_violation_rate"] - 1)
                    if dp and dp["slo_violation_rate"] > 0 else None,
                })
    return out


def main(argv: list[str] | None = None) -> int:
    parser = doc_parser(__doc__)
    parser.add_argument("--out", type=Path, required=True, help="JSON output; the PNG goes next to it")
    parser.add_argument("--rates", type=float, nargs="+", default=[120.0, 200.0],
                        help="conversation arrivals per second on the 8 engines (default: %(default)s)")
    parser.add_argument("--duration", type=float, default=10.0, help="simulated seconds per point (default: %(default)s)")
    parser.add_argument("--link", choices=list(LINKS), default="infiniband", help="KV link of the PD rows (default: %(default)s)")
    parser.add_argument("--offline-requests", type=int, default=400, help="requests of the offline case (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="workload and arrival seed (default: %(default)s)")
    parser.add_argument("--jobs", type=int, default=2, help="simulations run in parallel (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="one rate (120), 6 s per point, 200 offline requests, burst on tcp only")
    args = parser.parse_args(argv)
    rates, duration, n_offline, burst_links = args.rates, args.duration, args.offline_requests, list(LINKS)
    if args.quick:
        rates, duration, n_offline, burst_links = [120.0], 6.0, 200, ["tcp"]
    burst_rate = min(rates)

    jobs: list[tuple[str, tuple]] = []
    for setup, (n_prefill, n_decode) in SETUPS.items():
        for policy in (PD_POLICIES if n_decode else DP_POLICIES):
            for short in (laps_splits(n_prefill) if policy == "laps" and n_decode else [None]):
                for rate in rates:
                    jobs.append(("online", (setup, policy, rate, duration, args.seed, args.link, True, short)))
    for link in burst_links:
        for shared in (True, False):
            jobs.append(("burst", ("PD 4P+4D", "laps", burst_rate, duration, args.seed, link, shared, 1)))
    for policy in PD_POLICIES:
        for short in (laps_splits(4) if policy == "laps" else [None]):
            jobs.append(("offline", (policy, n_offline, args.seed, args.link, short)))

    results: dict[str, list[dict]] = {"online": [], "burst": [], "offline": []}
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool, Progress(transient=True) as progress:
        task = progress.add_task("simulating", total=len(jobs))
        futures = [(kind, pool.submit(offline_point if kind == "offline" else online_point, *params)) for kind, params in jobs]
        for kind, future in futures:
            results[kind].append(future.result())
            progress.advance(task)
    rows, burst, offline = results["online"], results["burst"], results["offline"]

    console = Console(width=150)
    table = Table(title=f"8 engines, mixed workload, TTFT SLO {SLO_TTFT_S} s, {duration:g} simulated s per point, "
                        f"PD link {args.link}", caption_justify="left",
                  caption=f"conv/s = offered conversation arrivals; req/s = requests achieved. PD rows only: xfer ms = mean "
                          f"KV-transfer time; {TRANSFER_NOTE}")
    for col in ("setup", "policy", "conv/s", "req/s", "SLO viol.", "TTFT p50 ms", "p90 ms", "short p90 ms", "xfer ms",
                "inflation", "burst"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["setup"], r["policy"], f"{r['conv_rate']:g}", f"{r['rate_rps']:.1f}", _pct(r["slo_violation_rate"]),
                      ms(r["ttft_p50_s"]), ms(r["ttft_p90_s"]), ms(r["short_ttft_p90_s"]),
                      f"{r['transfer_ms_mean']:.3f}" if "transfer_ms_mean" in r else "—",
                      f"{r['transfer_inflation_mean']:.2f}" if "transfer_inflation_mean" in r else "—",
                      f"{r['burst_mean']:.2f}" if "burst_mean" in r else "—")
    console.print(table)
    heads = headline(rows)
    table = Table(title="SLO violations: LAPS vs the best SGLang-router policy and DP round robin (paper: 0% vs 4.7%; -28% vs DP)")
    for col in ("setup", "conv/s", "LAPS split", "LAPS", "best router", "router", "DP 8 round robin", "LAPS vs DP"):
        table.add_column(col, justify="right")
    for h in heads:
        table.add_row(h["setup"], f"{h['conv_rate']:g}", h["laps_policy"], _pct(h["laps"]), h["best_router"], _pct(h["router"]),
                      _pct(h["dp_round_robin"]), "—" if h["laps_vs_dp_change"] is None else f"{100 * h['laps_vs_dp_change']:+.0f}%")
    console.print(table)
    table = Table(title=f"KV-transfer burst (D2): LAPS on PD 4P+4D at {burst_rate:g} conv/s, shared vs unshared links",
                  caption_justify="left",
                  caption=f"shared: transfers leaving one engine together share its port; unshared: each alone on the link. "
                          f"p90 = P90 inflation; {TRANSFER_NOTE}")
    for col in ("link", "GB/s", "links", "xfer ms mean", "xfer ms max", "inflation mean", "p90", "burst", "TTFT p90 ms", "SLO viol."):
        table.add_column(col, justify="right")
    for r in burst:
        table.add_row(r["link"], f"{LINKS[r['link']].bandwidth_bytes_per_s / 1e9:g}", "shared" if r["shared_links"] else "unshared",
                      f"{r['transfer_ms_mean']:.3f}", f"{r['transfer_ms_max']:.2f}", f"{r['transfer_inflation_mean']:.2f}",
                      f"{r['transfer_inflation_p90']:.2f}", f"{r['burst_mean']:.2f}", ms(r["ttft_p90_s"]), _pct(r["slo_violation_rate"]))
    console.print(table)
    table = Table(title=f"Offline distillation: {n_offline} ShareGPT prompts at t=0, {OFFLINE_MAX_TOKENS}-token outputs, "
                        "PD 4P+4D (paper: LAPS 7.3-8.3% shorter)")
    for col in ("policy", "end-to-end s", "vs round_robin", "last first token s", "output tok/s", "errors"):
        table.add_column(col, justify="right")
    rr = next(r["e2e_makespan_s"] for r in offline if r["policy"] == "round_robin")
    for r in offline:
        r["e2e_vs_round_robin"] = r["e2e_makespan_s"] / rr - 1
        table.add_row(r["policy"], f"{r['e2e_makespan_s']:.2f}", f"{100 * r['e2e_vs_round_robin']:+.1f}%",
                      f"{r['prefill_done_s']:.2f}", f"{r['output_tokens_per_s']:.0f}", str(r["errors"]))
    console.print(table)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {"engines": 8, "setups": SETUPS, "dataset": "mixed", "rates_conv_per_s": rates, "duration_s": duration,
              "seed": args.seed, "slo_ttft_s": SLO_TTFT_S, "link": args.link,
              "link_bytes_per_s": {name: spec.bandwidth_bytes_per_s for name, spec in LINKS.items()},
              "offline": {"requests": n_offline, "max_tokens": OFFLINE_MAX_TOKENS, "dataset": "sharegpt", "ignore_eos": True},
              "quick": args.quick}
    args.out.write_text(json.dumps({"rows": rows, "headline": heads, "burst": burst, "offline": offline,
                                    "paper": PAPER, "config": config}, indent=1))
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
