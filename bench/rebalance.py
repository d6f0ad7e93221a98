"""Pool rebalancing: the pressure controller against static short/long splits on a shifting mix, in virtual time.

    python bench/rebalance.py --out runs/rebalance/rebalance.json           # default: see --help
    python bench/rebalance.py --out runs/rebalance/quick.json --quick       # shorter phases, three static splits

Deployment: 8 simulated engines (Qwen2.5-7B on H200s, ``policy_compare``'s
``laps`` deployment, TTFT SLO 0.4 s). Workload
(:func:`loadgen.workloads.shifting_workload`): real chats with a small share
of long documents, then a document-heavy phase, then chats again, at one
conversation rate throughout. Runs:

* every static split in ``--splits`` (short-prefill engines; the rest
  long-prefill), no controller; by default 1, 2, 4, 6 and 7 short engines
  (3 and 5 lie between their neighbours and cost another two runs);
* the controller (``controller.enabled``) starting from ``--start-short``
  short engines, deciding every ``--interval-s``, with ``--cooldown-s``
  between moves and ``controller.sim_restart_s`` (40 s) of downtime per move.

A request unanswered after 30 s times out (a violation, as it would be
anyway). The JSON holds ``controller``, ``best_static`` and ``worst_static`` (lowest
and highest SLO violation rate) with ``slo_violation_rate``, ``ttft_p90_s``,
per-phase violation rates, and for the controller ``moves``, the move log,
``restart_engine_s`` and ``drain_engine_s``; ``static`` has every split; the
PNG next to it shows pool sizes and rolling P90 TTFT over time for the
controller and the best static split.
"""

from __future__ import annotations

import random
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.progress import Progress  # noqa: E402
from rich.table import Table  # noqa: E402

from bench.dominance import bench_console, claim_out, save, stopped  # noqa: E402
from bench.policy_compare import SLO_TTFT_S, deployment  # noqa: E402
from laps.config import Config, parse_config  # noqa: E402
from laps.doc_help import doc_parser  # noqa: E402
from laps.tokenizer import load_tokenizer  # noqa: E402
from loadgen.cli import non_negative_float, output_file, positive_float, positive_int, share  # noqa: E402
from loadgen.outputs import is_stream  # noqa: E402
from loadgen.report import build_report  # noqa: E402
from loadgen.runner import RequestRecord, plan_arrivals  # noqa: E402
from loadgen.virtual import VirtualRun  # noqa: E402
from loadgen.workloads import chat_docs_chat, shifting_workload  # noqa: E402

ENGINES = 8
ROLLING_WINDOW_S = 20.0  # P90 TTFT over the requests that started in the last 20 s
ROLLING_STEP_S = 5.0
# A request unanswered after 30 s is withdrawn (a violation either way): this keeps an overloaded split's queue,
# and so its simulation time, bounded.
REQUEST_TIMEOUT_S = 30.0


def config_for(n_short: int, controller: dict | None) -> Config:
    """``policy_compare``'s 8-engine ``laps`` deployment with ``n_short`` short engines, plus a ``controller`` section."""
    config = deployment(ENGINES, "laps", n_short)
    if controller is None:
        return config
    return parse_config({**config.model_dump(mode="json", exclude_none=True), "controller": {"enabled": True, **controller}}, "rebalance")


def rolling_p90_s(records: list[RequestRecord], end_s: float) -> list[tuple[float, float | None]]:
    """``(t, P90 TTFT of the successes that started in (t - ROLLING_WINDOW_S, t])`` every ``ROLLING_STEP_S``."""
    import numpy as np

    starts = np.array([r.start_s for r in records if r.ok and r.ttft_s is not None])
    ttfts = np.array([r.ttft_s for r in records if r.ok and r.ttft_s is not None])
    points = []
    for t in np.arange(ROLLING_STEP_S, end_s + 1e-9, ROLLING_STEP_S):
        window = ttfts[(starts > t - ROLLING_WINDOW_S) & (starts <= t)]
        points.append((float(t), float(np.percentile(window, 90)) if window.size else None))
    return points


def run_one(n_short: int, controller: dict | None, rate: float, phase_s: float, shares: tuple[float, float], seed: int) -> dict:
    """Simulate one deployment on the shifting workload; its figures (JSON-ready)."""
    tokenizer = load_tokenizer()
    phases = chat_docs_chat(phase_s, phase_s, phase_s, *shares)
    duration_s = sum(p.duration_s for p in phases)
    workload = shifting_workload(random.Random(f"workload/{seed}"), rate=rate, phases=phases, tokenizer=tokenizer)
    plan = plan_arrivals(workload, duration_s=duration_s, rng=random.Random(f"arrivals/{seed}"))
    virtual = VirtualRun(config_for(n_short, controller), tokenizer, request_timeout_s=REQUEST_TIMEOUT_S)
    records = virtual.run(plan, duration_s)
    report = build_report(records, slo_ttft_s=SLO_TTFT_S)
    by_phase = []
    for i in range(len(phases)):
        inside = [r for r in records if i * phase_s <= r.start_s < (i + 1) * phase_s]
        by_phase.append(build_report(inside, slo_ttft_s=SLO_TTFT_S)["slo"]["violation_rate"] if inside else None)
    row = {
        "run": f"controller from {n_short}/{ENGINES - n_short}" if controller else f"static {n_short}/{ENGINES - n_short}",
        "short_engines": n_short,
        "requests": report["requests"]["sent"],
        "errors": report["requests"]["errors"],
        "slo_violation_rate": report["slo"]["violation_rate"],
        "ttft_p90_s": report["ttft_s"]["p90"],
        "short_ttft_p90_s": report["by_class"]["short"]["ttft_s"]["p90"],
        "violation_rate_by_phase": by_phase,
        "rolling_ttft_p90_s": rolling_p90_s(records, duration_s),
    }
    row["pool_sizes"] = [(0.0, n_short, ENGINES - n_short)]  # serving engines (short, long) over time
    if controller:
        row["pool_sizes"] += [(c["t"], c["pool_size_short"], c["pool_size_long"]) for c in virtual.control_log if c["t"] <= duration_s]
        row.update(moves=len(virtual.moves), move_log=virtual.moves, restart_engine_s=virtual.restart_engine_s,
                   drain_engine_s=virtual.drain_engine_s)
    else:
        row["pool_sizes"].append((duration_s, n_short, ENGINES - n_short))
    return row


def plot(controller: dict, best: dict, path: Path, phase_s: float, title: str) -> None:
    """Short-pool size and rolling P90 TTFT over time: the controller against the best static split."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    for row, colour in ((controller, "tab:blue"), (best, "tab:orange")):
        t, short, long = zip(*row["pool_sizes"])
        ax1.step(t, short, where="post", color=colour, label=f"{row['run']}: short engines")
        ax1.step(t, long, where="post", color=colour, linestyle="--", label=f"{row['run']}: long engines")
        pts = [(x, y) for x, y in row["rolling_ttft_p90_s"] if y is not None]
        ax2.plot([x for x, _ in pts], [1e3 * y for _, y in pts], color=colour, label=row["run"])
    for ax in (ax1, ax2):
        for k in (1, 2):
            ax.axvline(k * phase_s, color="grey", linewidth=0.8)
        ax.grid(alpha=0.3)
    ax1.set(ylabel="engines serving", title=title)
    ax1.legend(fontsize=7, ncol=2)
    ax2.axhline(1e3 * SLO_TTFT_S, color="red", linestyle=":", linewidth=1, label="TTFT SLO")
    ax2.set(xlabel="simulated time (s); phases: chat | documents | chat", ylabel=f"P90 TTFT, last {ROLLING_WINDOW_S:g} s (ms)", yscale="log")
    ax2.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax2.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax2.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = doc_parser(__doc__)
    parser.add_argument("--out", type=output_file, required=True, help="JSON output; the PNG goes next to it, none beside a stream "
                        "such as /dev/stdout")
    parser.add_argument("--rate", type=positive_float, default=150.0, help="conversations per second, all phases (default: %(default)s)")
    parser.add_argument("--phase-s", type=positive_float, default=120.0, help="simulated seconds per phase (default: %(default)s)")
    parser.add_argument("--chat-long-share", type=share, default=0.05, help="long share of requests in the chat phases (default: %(default)s)")
    parser.add_argument("--docs-long-share", type=share, default=0.5, help="long share of requests in the document phase (default: %(default)s)")
    parser.add_argument("--splits", default="1,2,4,6,7", help="static splits: short engines, comma-separated (default: %(default)s)")
    parser.add_argument("--start-short", type=positive_int, default=4, help="the controller's initial short engines (default: %(default)s)")
    parser.add_argument("--interval-s", type=positive_float, default=2.0, help="controller decision interval (default: %(default)s)")
    parser.add_argument("--cooldown-s", type=non_negative_float, default=20.0, help="controller cooldown after a move (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="workload and arrival seed (default: %(default)s)")
    parser.add_argument("--jobs", type=positive_int, default=2, help="simulations run in parallel (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="60 s phases and static splits 2, 4, 6 only")
    args = parser.parse_args(argv)
    phase_s = 60.0 if args.quick else args.phase_s
    splits = [2, 4, 6] if args.quick else [int(k) for k in args.splits.split(",")]
    if not all(1 <= k < ENGINES for k in [*splits, args.start_short]):
        parser.error(f"short engines must lie in 1..{ENGINES - 1}")
    controller = {"interval_s": args.interval_s, "cooldown_s": args.cooldown_s}
    shares = (args.chat_long_share, args.docs_long_share)
    jobs = [(args.start_short, controller)] + [(k, None) for k in splits]
    png = args.out.with_suffix(".png")
    claim = claim_out(parser, args.out, [png])  # before the runs, not after minutes of them
    rows: list[dict] = []
    try:
        with Progress(transient=True) as progress, ProcessPoolExecutor(max_workers=args.jobs) as pool:
            task = progress.add_task(f"simulating {len(jobs)} runs of {3 * phase_s:g} s", total=len(jobs))
            futures = [pool.submit(run_one, k, c, args.rate, phase_s, shares, args.seed) for k, c in jobs]
            for future in as_completed(futures):
                rows.append(future.result())
                progress.advance(task)
    except BaseException as err:
        return stopped(parser, claim, err)
    static = sorted((r for r in rows if "moves" not in r), key=lambda r: r["short_engines"])
    ctrl = next(r for r in rows if "moves" in r)
    rank = sorted(static, key=lambda r: (r["slo_violation_rate"], r["ttft_p90_s"] or 0.0))
    best, worst = rank[0], rank[-1]

    table = Table(title=f"{ENGINES} engines, shifting mix at {args.rate:g} conv/s, phases of {phase_s:g} s "
                        f"(long share {shares[0]:g} → {shares[1]:g} → {shares[0]:g}), TTFT SLO {SLO_TTFT_S} s")
    for col in ("run", "requests", "SLO viol.", "chat", "docs", "chat again", "P90 TTFT ms", "short P90 ms", "moves", "restart eng·s"):
        table.add_column(col, justify="right")
    for r in [*static, ctrl]:
        mark = " (best)" if r is best else " (worst)" if r is worst else ""
        table.add_row(r["run"] + mark, str(r["requests"]), f"{100 * r['slo_violation_rate']:.1f}%",
                      *(f"{100 * v:.1f}%" if v is not None else "-" for v in r["violation_rate_by_phase"]),
                      f"{1e3 * (r['ttft_p90_s'] or 0):.0f}", f"{1e3 * (r['short_ttft_p90_s'] or 0):.0f}",
                      str(r.get("moves", "-")), f"{r['restart_engine_s']:.0f}" if "moves" in r else "-")
    console = bench_console(150, args.out)
    console.print(table)
    for name, other in (("best", best), ("worst", worst)):
        console.print(f"controller vs {name} static ({other['run']}): SLO violations {100 * ctrl['slo_violation_rate']:.1f}% vs "
                      f"{100 * other['slo_violation_rate']:.1f}%, P90 TTFT {1e3 * (ctrl['ttft_p90_s'] or 0):.0f} ms vs "
                      f"{1e3 * (other['ttft_p90_s'] or 0):.0f} ms")
    moves = ", ".join(f"{m['engine']} {m['from_pool']}→{m['to_pool']} at {m['start_s']:.0f} s" for m in ctrl["move_log"])
    console.print(f"controller moves: {moves or 'none'}")
    meta = {"engines": ENGINES, "rate_conv_s": args.rate, "phase_s": phase_s, "long_shares": [shares[0], shares[1], shares[0]],
            "slo_ttft_s": SLO_TTFT_S, "request_timeout_s": REQUEST_TIMEOUT_S, "start_short": args.start_short, "controller": controller,
            "restart_s": config_for(args.start_short, controller).controller.sim_restart_s, "seed": args.seed, "splits": splits}
    if not save(parser, console, args.out, {"config": meta, "controller": ctrl, "best_static": best, "worst_static": worst, "static": static}, claim):
        return 1
    if not is_stream(args.out):
        plot(ctrl, best, png, phase_s, f"{ENGINES} engines, {args.rate:g} conv/s: controller vs best static split")
        console.print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
