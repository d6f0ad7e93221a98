"""Every scheduling policy, in virtual time, swept over request rate up to saturation.

    python bench/policy_compare.py --engines 1 --dataset mixed --out runs/policy_compare/n1_mixed.json
    python bench/policy_compare.py --engines 8 --dataset hh-rlhf --out runs/policy_compare/n8_chat.json

Deployments (simulated Qwen2.5-7B engines on H200s, TTFT SLO 0.4 s):
* ``laps`` and ``pools``: ``--short-engines`` engines short-prefill (default
  half), the rest long-prefill (one engine: the ``mixed`` role, temporal mode);
* the router baselines ``least_load`` (unified FCFS), ``round_robin``,
  ``cache_aware``, ``bucket``: every engine runs SGLang's defaults (``fcfs``);
* ``sglang-spf`` and ``sglang-hrrn``: least-load routing to engines running
  ``--schedule-policy shortest-prefill-first`` / ``hrrn``, what SGLang 0.5.23
  offers for free.
With one engine the router baselines coincide, so only ``laps``,
``least_load``, ``sglang-spf`` and ``sglang-hrrn`` run.

For each policy and conversation-arrival rate it writes a row
``{policy, conv_rate, rate_rps, slo_violation_rate, ttft_p50_s, ttft_p90_s,
mean_prefill_latency_s, short_ttft_p90_s}`` (``rate_rps`` is the achieved
request rate; ``mean_prefill_latency_s`` is the mean TTFT, arrival to first
token: queueing plus prefill), prints a table, and draws violation rate and
P90 TTFT against rate next to the JSON.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402
from rich.progress import Progress  # noqa: E402
from rich.table import Table  # noqa: E402

from laps.config import Config, load_config, parse_config  # noqa: E402
from laps.doc_help import doc_parser  # noqa: E402
from laps.tokenizer import load_tokenizer  # noqa: E402
from loadgen.report import build_report  # noqa: E402
from loadgen.simulate import simulate  # noqa: E402
from loadgen.workloads import build_workload  # noqa: E402

SLO_TTFT_S = 0.4
# The shipped roles (short-prefill, long-prefill, mixed) plus plain SGLang engines for the baselines.
ROLES = {
    **{name: role.model_dump() for name, role in load_config().roles.items()},
    "sglang-default": {"pool": "short", "flags": {}},
    "sglang-spf": {"pool": "short", "flags": {"schedule-policy": "shortest-prefill-first"}},
    "sglang-hrrn": {"pool": "short", "flags": {"schedule-policy": "hrrn"}},
}
# policy name -> (scheduling.policy, role of every engine, or None for the short/long split)
POLICIES = {
    "laps": ("laps", None),
    "pools": ("pools", None),
    "least_load": ("least_load", "sglang-default"),
    "round_robin": ("round_robin", "sglang-default"),
    "cache_aware": ("cache_aware", "sglang-default"),
    "bucket": ("bucket", "sglang-default"),
    "sglang-spf": ("least_load", "sglang-spf"),
    "sglang-hrrn": ("least_load", "sglang-hrrn"),
}
SINGLE_ENGINE = ("laps", "least_load", "sglang-spf", "sglang-hrrn")
# Conversation arrivals per second per engine; the sweep stops once a policy is saturated.
RATES_PER_ENGINE = (5, 10, 20, 30, 40, 60, 80)


def deployment(n_engines: int, policy: str, short_engines: int | None = None) -> Config:
    """The simulated deployment ``policy`` runs on (see the module docstring)."""
    scheduling_policy, role = POLICIES[policy]
    if role is not None:
        roles = [role] * n_engines
    elif n_engines == 1:
        roles = ["mixed"]
    else:
        n_short = n_engines // 2 if short_engines is None else short_engines
        roles = ["short-prefill"] * n_short + ["long-prefill"] * (n_engines - n_short)
    return parse_config({
        "model": {"name": "Qwen2.5-7B-Instruct"},
        "slo": {"ttft_s": SLO_TTFT_S},
        "sim": {"model": "qwen2.5-7b", "gpu": "h200"},
        "scheduling": {"policy": scheduling_policy},
        "roles": {name: ROLES[name] for name in set(roles)},
        "engines": [{"name": f"e{i}", "kind": "sim", "role": r, "gpus": [i]} for i, r in enumerate(roles)],
    }, f"policy_compare[{policy}]")


def run_point(policy: str, n_engines: int, dataset: str, conv_rate: float, duration_s: float, seed: int, short_engines: int | None) -> dict:
    """Simulate one (policy, rate) point; the row for the JSON."""
    tokenizer = load_tokenizer()
    workload = build_workload(dataset, random.Random(f"workload/{seed}"), tokenizer=tokenizer)
    config = deployment(n_engines, policy, short_engines)
    records = simulate(config, workload, duration_s=duration_s, seed=seed, rate=conv_rate, tokenizer=tokenizer)
    report = build_report(records, slo_ttft_s=SLO_TTFT_S)
    split = [config.pool(e) for e in config.engines]
    return {
        "policy": policy if POLICIES[policy][1] is not None or n_engines == 1 else f"{policy} {split.count('short')}s/{split.count('long')}l",
        "conv_rate": conv_rate,
        "rate_rps": report["throughput_rps"],
        "requests": report["requests"]["sent"],
        "slo_violation_rate": report["slo"]["violation_rate"],
        "ttft_p50_s": report["ttft_s"]["p50"],
        "ttft_p90_s": report["ttft_s"]["p90"],
        "mean_prefill_latency_s": report["ttft_s"]["mean"],
        "short_ttft_p90_s": report["by_class"]["short"]["ttft_s"]["p90"],
    }


def plot_rate_panels(ax1, ax2, rows: list[dict], title: str, x_key: str = "rate_rps",
                     x_label: str = "request rate (req/s)") -> None:
    """Draw violation rate (``ax1``) and P90 TTFT (``ax2``) against ``rows[i][x_key]``, one line per policy in ``rows``.

    ``x_key``: the row field on the x-axis (default: the achieved request rate, ``rate_rps``; ``conv_rate`` is the
    offered conversation rate); ``x_label`` names it on both axes.
    """
    for policy in dict.fromkeys(r["policy"] for r in rows):
        pts = [r for r in rows if r["policy"] == policy]
        ax1.plot([r[x_key] for r in pts], [100 * r["slo_violation_rate"] for r in pts], marker="o", label=policy)
        ax2.plot([r[x_key] for r in pts], [1e3 * (r["ttft_p90_s"] or 0) for r in pts], marker="o", label=policy)
    ax1.set(xlabel=x_label, ylabel="TTFT SLO violations (%)", title=f"{title}: SLO {SLO_TTFT_S} s")
    ax2.set(xlabel=x_label, ylabel="P90 TTFT (ms)", yscale="log", title=f"{title}: P90 TTFT")
    ax2.axhline(1e3 * SLO_TTFT_S, color="red", linestyle="--", linewidth=1)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Violation rate and P90 TTFT against achieved request rate, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    plot_rate_panels(ax1, ax2, rows, title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = doc_parser(__doc__)
    parser.add_argument("--engines", type=int, default=1, help="engines in the deployment (default: %(default)s)")
    parser.add_argument("--dataset", default="mixed", help="workload, as for laps simulate (default: %(default)s)")
    parser.add_argument("--duration", type=float, default=30.0, help="simulated seconds per point (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="workload and arrival seed (default: %(default)s)")
    parser.add_argument("--policies", nargs="+", choices=list(POLICIES), help="default: all that differ at this size")
    parser.add_argument("--short-engines", type=int, help="short-prefill engines for laps and pools (default: half)")
    parser.add_argument("--out", type=Path, required=True, help="JSON output; the PNG goes next to it")
    args = parser.parse_args(argv)
    policies = args.policies or (list(SINGLE_ENGINE) if args.engines == 1 else list(POLICIES))
    rows: list[dict] = []
    with Progress(transient=True) as progress:
        task = progress.add_task("simulating", total=len(policies) * len(RATES_PER_ENGINE))
        for policy in policies:
            for per_engine in RATES_PER_ENGINE:
                row = run_point(policy, args.engines, args.dataset, per_engine * args.engines, args.duration, args.seed, args.short_engines)
                rows.append(row)
                progress.advance(task)
                if row["slo_violation_rate"] > 0.5:  # saturated: higher rates only fail more
                    progress.advance(task, len(RATES_PER_ENGINE) - RATES_PER_ENGINE.index(per_engine) - 1)
                    break
    table = Table(title=f"{args.engines} engine(s), {args.dataset}, TTFT SLO {SLO_TTFT_S} s, {args.duration:.0f} simulated s per point")
    for col in ("policy", "conv/s", "req/s", "SLO viol.", "TTFT p50 ms", "p90 ms", "mean ms", "short p90 ms"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["policy"], f"{r['conv_rate']:g}", f"{r['rate_rps']:.1f}", f"{100 * r['slo_violation_rate']:.1f}%",
                      *(f"{1e3 * (r[k] or 0):.1f}" for k in ("ttft_p50_s", "ttft_p90_s", "mean_prefill_latency_s", "short_ttft_p90_s")))
    Console(width=150).print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"engines": args.engines, "dataset": args.dataset, "slo_ttft_s": SLO_TTFT_S, "rows": rows}, indent=1))
    plot(rows, args.out.with_suffix(".png"), f"{args.engines} engine(s), {args.dataset}")
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
