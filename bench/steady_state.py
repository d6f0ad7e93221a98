"""laps and the router baselines at steady state: fixed rates, seconds of arrivals rather than a burst.

    python bench/steady_state.py --out runs/steady_state/steady.json                 # ~25 min on 2 cores
    python bench/steady_state.py --points chat-single:2000 mixed:300 --duration 15 --out runs/steady_state/s.json

``bench/dominance.py`` sizes each point to ~3,000 requests, so at the rates where short-prompt chat
saturates 8 H200s (thousands of requests per second) a point is 1.5 s of arrivals: a burst into idle
engines, before the decode batches that every request's reply builds up are there. This bench runs
the same deployments (laps as ``examples/sim-h200x8.yaml`` ships it, the baselines and the control
of ``bench/dominance.py``) for ``--duration`` seconds of arrivals at each ``WORKLOAD:RATE`` point
(conversations per second), so the engines are decoding as much as they will at that rate. Per point
and policy: violations of the 0.4 s TTFT objective and of the length-aware one, short-class P90 TTFT,
TTFT P50, TPOT P50 and P90, and the share of prompt tokens the engines found cached. It prints a table and
writes the rows as JSON. Replies end where ``bench/dominance.py``'s do, at the simulated engine's own end of text
(median 30 tokens) or ``max_tokens``; with ``--ignore-eos`` every reply runs to its ``max_tokens`` (``chat-single``'s
256, the issue's short-heavy mix). Then the engines are decode-bound: by the engine model's ``decode_s`` 8 engines
decode at most ~930 conversations/s of ``chat-single``'s with 256-token replies (``bench/decode_capacity.py
--workload chat-single --reply-tokens 256``), and past that the decode batches grow (TPOT with them)
while TTFT stays low until the request slots fill, so there TPOT, not TTFT, says who serves better.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from rich.table import Table  # noqa: E402

from dominance import BASELINES, CONTROL, PER_1K_S, SLO_TTFT_S, WORKLOADS, bench_console, claim_out, save, simulate_all, simulate_point, stopped  # noqa: E402
from laps.doc_help import doc_parser  # noqa: E402
from loadgen.cli import output_file, positive_float, positive_int  # noqa: E402
from loadgen.report import build_report, ms  # noqa: E402
from loadgen.workloads import TIMED_DATASETS  # noqa: E402

POLICIES = ("laps", *BASELINES, CONTROL)
DEFAULT_POINTS = ("chat-single:2000", "chat-single:4000", "mixed:300")


def point(text: str) -> tuple[str, float]:
    """``WORKLOAD:RATE`` (a Poisson workload of ``bench/dominance.py``, conversations per second) for argparse."""
    workload, colon, rate = text.partition(":")
    if not colon:
        raise argparse.ArgumentTypeError(f"{text!r}: expected WORKLOAD:RATE")
    if workload not in WORKLOADS or workload in TIMED_DATASETS:
        raise argparse.ArgumentTypeError(f"{text!r}: the workload must be one of "
                                         f"{', '.join(w for w in WORKLOADS if w not in TIMED_DATASETS)}")
    try:
        return workload, positive_float(rate)
    except argparse.ArgumentTypeError as err:
        raise argparse.ArgumentTypeError(f"{text!r}: RATE: {err}") from None


def run(workload: str, rate: float, policy: str, duration_s: float, seed: int, ignore_eos: bool = False) -> dict:
    """One (point, policy) run; its row (``ignore_eos``: every reply runs to its ``max_tokens``)."""
    records = simulate_point(workload, policy, rate, duration_s, seed, ignore_eos=ignore_eos)[1].records
    report = build_report(records, slo_ttft_s=SLO_TTFT_S, slo_ttft_per_1k_s=PER_1K_S)
    return {
        "workload": workload, "rate": rate, "policy": policy, "duration_s": duration_s, "requests": report["requests"]["sent"],
        "slo_violation_rate": report["slo"]["violation_rate"],
        "length_slo_violation_rate": report["length_slo"]["violation_rate"],
        "short_ttft_p90_s": report["by_class"]["short"]["ttft_s"]["p90"],
        "ttft_p50_s": report["ttft_s"]["p50"], "tpot_p50_s": report["tpot_s"]["p50"], "tpot_p90_s": report["tpot_s"]["p90"],
        "reply_tokens_p50": float(np.median(replies)) if (replies := [r.completion_tokens for r in records if r.ok]) else None,
        "cache_hit_rate_pct": report["bench_serving"]["cache_report"]["cache_hit_rate_pct"],
    }


def _percent(rate: float | None) -> str:  # None: no request in the run
    return "—" if rate is None else f"{100 * rate:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = doc_parser(__doc__)
    parser.add_argument("--out", type=output_file, required=True, help="JSON output")
    parser.add_argument("--points", nargs="+", type=point, default=[point(p) for p in DEFAULT_POINTS], metavar="WORKLOAD:RATE",
                        help="workload and conversation rate of each point (default: %s)" % " ".join(DEFAULT_POINTS))
    parser.add_argument("--duration", type=positive_float, default=15.0, help="seconds of arrivals per run (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="workload and arrival seed (default: %(default)s)")
    parser.add_argument("--jobs", type=positive_int, default=2, help="simulations in parallel (default: %(default)s)")
    parser.add_argument("--ignore-eos", action="store_true", help="every reply runs to its max_tokens (chat-single: 256)")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES), metavar="POLICY",
                        help="policies to run (default: all of %(choices)s)")
    args = parser.parse_args(argv)
    policies = [p for p in POLICIES if p in args.policies]
    claim = claim_out(parser, args.out)
    console = bench_console(170, args.out)
    try:
        rows = simulate_all(args.jobs, run, [(w, r, p, args.duration, args.seed, args.ignore_eos)
                                             for w, r in args.points for p in policies], console)
    except BaseException as err:
        return stopped(parser, claim, err)
    replies = "every reply to its max_tokens" if args.ignore_eos else "replies to the engine's end of text or max_tokens"
    table = Table(title=f"steady state: {args.duration:g} s of arrivals per run, seed {args.seed}, {replies}; TTFT objective {SLO_TTFT_S} s")
    for column in ("workload", "conv/s", "policy", "requests", "violations %", "length-aware %", "short P90 ms",
                   "TTFT P50 ms", "TPOT P50 ms", "TPOT P90 ms", "cached %"):
        table.add_column(column, justify="left" if column in ("workload", "policy") else "right")
    for r in rows:
        table.add_row(r["workload"], f"{r['rate']:g}", r["policy"], f"{r['requests']:,}", _percent(r["slo_violation_rate"]),
                      _percent(r["length_slo_violation_rate"]), ms(r["short_ttft_p90_s"]), ms(r["ttft_p50_s"]),
                      ms(r["tpot_p50_s"]), ms(r["tpot_p90_s"]), f"{r['cache_hit_rate_pct']:.1f}")
    console.print(table)
    data = {"duration_s": args.duration, "seed": args.seed, "ignore_eos": args.ignore_eos, "rows": rows}
    return 0 if save(parser, console, args.out, data, claim) else 1


if __name__ == "__main__":
    sys.exit(main())
