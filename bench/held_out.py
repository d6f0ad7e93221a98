"""laps and the router baselines on a trace file that ``bench/dominance.py`` never uses: is laps still never worse?

    python bench/held_out.py --dataset mooncake:/work/shared/data/mooncake_fast25_conversation_trace.jsonl.gz \\
        --loads 3 6 9 12 15 --out runs/held_out/mooncake.json          # ~25 min on 2 cores

laps' rules were chosen on ``bench/dominance.py``'s workloads, so a check on traffic it never saw says more
about traffic we do not have. This bench runs the same deployments (laps as ``examples/sim-h200x8.yaml`` ships
it, the baselines of ``bench/dominance.py`` with SGLang's default flags, and its control: least load to engines
with laps' own flags, which says how much of laps' edge is its engine flags) on a trace file, ``FORMAT:PATH`` as
``laps simulate --dataset`` takes it. A timed trace (``mooncake:``, ``azure:``) replays its first
``--requests`` (2,000) requests at each speed-up in ``--loads``; a ``sharegpt:`` or ``lengths:`` file arrives at
each rate in ``--loads`` (conversations per second) for max(1.5, ``--requests`` (3,000) / rate) simulated seconds, as
a Poisson process or, with ``--burstiness``, with gamma gaps (bursts below 1).
Every reply runs to the output length the file gives (``ignore_eos``, as SGLang's ``bench_serving`` sends by
default; 256 tokens where a ShareGPT file records no reply), not to the simulated engine's own end of text (median
30 tokens). Requests whose prompt plus output pass the engines' 32,768-token context are left out. Per point and
policy: violations of the fixed 0.4 s objective and of the length-aware one (0.4 s + 0.06 s per 1,000 new prompt
tokens), short-class and overall P90 TTFT, P50 TPOT. The table marks the loads where laps is worse than the best
baseline by more than 0.5 points on either objective (``bench/dominance.py``'s "never worse"; the control is not a
baseline there).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rich.table import Table  # noqa: E402

from dominance import BASELINES, CONTROL, PER_1K_S, SLO_TTFT_S, bench_console, claim_out, point_config, save, simulate_all, stopped  # noqa: E402
from laps.doc_help import doc_parser  # noqa: E402
from laps.tokenizer import load_tokenizer  # noqa: E402
from loadgen.cli import gamma_shape, output_file, positive_float, positive_int  # noqa: E402
from loadgen.report import build_report, ms  # noqa: E402
from loadgen.simulate import simulate_run  # noqa: E402
from loadgen.workloads import TRACE_FORMATS, build_workload  # noqa: E402

POLICIES = ("laps", *BASELINES, CONTROL)
CONTEXT_TOKENS = 32768  # the simulated engines' context length (Qwen2.5-7B)
MARGIN = 0.005  # never worse: at most the best baseline's violations plus 0.5 points


def trace(text: str) -> str:
    """``FORMAT:PATH`` of a trace file for argparse (that the file exists; :func:`main` reads it)."""
    kind, colon, path = text.partition(":")
    if not colon or not path or kind not in TRACE_FORMATS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected FORMAT:PATH with FORMAT one of {', '.join(TRACE_FORMATS)}")
    if not Path(path).exists():
        raise argparse.ArgumentTypeError(f"{text!r}: no such file {path}")
    if not Path(path).is_file():
        raise argparse.ArgumentTypeError(f"{text!r}: {path} is not a file")
    return text


def run(dataset: str, policy: str, load: float, requests: int, seed: int, burstiness: float = 1.0) -> dict:
    """One (load, policy) point; its row (``burstiness``: the arrivals' gamma shape, 1 = Poisson; untimed files only)."""
    tokenizer = load_tokenizer()
    workload = build_workload(dataset, random.Random(f"workload/{seed}"), tokenizer=tokenizer, max_context_tokens=CONTEXT_TOKENS)
    config = point_config(policy, pd=False)
    if workload.timed:
        records = simulate_run(config, workload, duration_s=float("inf"), seed=seed, time_scale=1.0 / load,
                               tokenizer=tokenizer, max_requests=requests, ignore_eos=True).records
    else:
        records = simulate_run(config, workload, duration_s=max(1.5, requests / load), seed=seed, rate=load,
                               burstiness=burstiness, tokenizer=tokenizer, ignore_eos=True).records
    report = build_report(records, slo_ttft_s=SLO_TTFT_S, slo_ttft_per_1k_s=PER_1K_S)
    return {"policy": policy, "load": load, "requests": report["requests"]["sent"],
            "slo_violation_rate": report["slo"]["violation_rate"],
            "length_slo_violation_rate": report["length_slo"]["violation_rate"],
            "short_ttft_p90_s": report["by_class"]["short"]["ttft_s"]["p90"], "ttft_p90_s": report["ttft_s"]["p90"],
            "tpot_p50_s": report["tpot_s"]["p50"]}


def worse_than_best(rows: list[dict], load: float) -> list[str]:
    """The objectives on which laps is worse than the best baseline at ``load`` by more than :data:`MARGIN`
    (the baselines: :data:`dominance.BASELINES`; the control is not one)."""
    at = [r for r in rows if r["load"] == load]
    laps = next(r for r in at if r["policy"] == "laps")
    return [name for name, key in (("fixed", "slo_violation_rate"), ("length-aware", "length_slo_violation_rate"))
            if laps[key] > min(r[key] for r in at if r["policy"] in BASELINES) + MARGIN]


def main(argv: list[str] | None = None) -> int:
    parser = doc_parser(__doc__, prog=Path(__file__).name)
    parser.add_argument("--dataset", type=trace, required=True, help="FORMAT:PATH, FORMAT one of " + ", ".join(TRACE_FORMATS))
    parser.add_argument("--loads", type=positive_float, nargs="+", required=True,
                        help="speed-ups of a timed trace, or conversations per second of a sharegpt: or lengths: file")
    parser.add_argument("--requests", type=positive_int,
                        help="size of a point: a timed trace's first N requests (default: 2000), or N / rate seconds, "
                             "at least 1.5 s, of arrivals of conversations (default: 3000)")
    parser.add_argument("--seed", type=int, default=0, help="workload and arrival seed (default: %(default)s)")
    parser.add_argument("--burstiness", type=gamma_shape, default=1.0,
                        help="a sharegpt: or lengths: file's arrival gaps: gamma of this shape, mean 1/rate (1: Poisson; "
                             "0.25: bursts, coefficient of variation 2), as laps simulate --burstiness; a timed trace "
                             "refuses it (default: %(default)s)")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES), metavar="POLICY",
                        help="policies to run (default: all of %(choices)s): laps and one baseline at least; the last is "
                             "the control, not a baseline")
    parser.add_argument("--jobs", type=positive_int, default=2, help="simulations in parallel (default: %(default)s)")
    parser.add_argument("--out", type=output_file, required=True, help="JSON output")
    args = parser.parse_args(argv)
    loads = sorted(set(args.loads))
    policies = [p for p in POLICIES if p in args.policies]
    if "laps" not in policies or not any(p in BASELINES for p in policies):
        parser.error("--policies must name laps and at least one baseline: " + ", ".join(BASELINES))
    try:  # the file once here, so a bad one stops the bench before any simulation (each run reads it again)
        workload = build_workload(args.dataset, random.Random(f"workload/{args.seed}"), tokenizer=load_tokenizer(),
                                  max_context_tokens=CONTEXT_TOKENS)
    except ValueError as err:  # the trace's reader refuses the file (its message names the file and line)
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    if workload.timed and args.burstiness != 1.0:
        print(f"{parser.prog}: error: --burstiness: {args.dataset} is a timed trace, replayed at its own times", file=sys.stderr)
        return 2
    claim = claim_out(parser, args.out)
    console = bench_console(150, args.out)
    requests = args.requests or (2000 if workload.timed else 3000)
    for note in workload.notes:
        console.print(f"note: {note}", highlight=False)
    try:
        rows = simulate_all(args.jobs, run, [(args.dataset, p, load, requests, args.seed, args.burstiness)
                                             for load in loads for p in policies], console)
    except BaseException as err:
        return stopped(parser, claim, err)
    load_name = "speed-up" if workload.timed else "conv/s"  # a trace replayed at its times, or at a rate
    arrivals = "" if workload.timed else f", burstiness {args.burstiness:g}"
    table = Table(title=f"{args.dataset}, seed {args.seed}{arrivals}\nviolations (%) of 0.4 s (fixed) and of 0.4 s + "
                        f"{PER_1K_S:g} s per 1k new tokens (length-aware); P90 TTFT (ms) of the short class (-: none) "
                        "and of all; P50 TPOT (ms)")
    for column in (load_name, "policy", "requests", "fixed %", "length-aware %", "short P90", "P90", "TPOT P50", "laps worse"):
        table.add_column(column, justify="left" if column in ("policy", "laps worse") else "right")
    for load in loads:
        worse = ", ".join(worse_than_best(rows, load)) or "no"
        for r in (r for r in rows if r["load"] == load):
            table.add_row(f"{load:g}", r["policy"], f"{r['requests']:,}", f"{100 * r['slo_violation_rate']:.2f}",
                          f"{100 * r['length_slo_violation_rate']:.2f}", ms(r["short_ttft_p90_s"], 0), ms(r["ttft_p90_s"], 0),
                          ms(r["tpot_p50_s"]),
                          worse if r["policy"] == "laps" else "")
    console.print(table)
    data = {"dataset": args.dataset, "seed": args.seed, "burstiness": None if workload.timed else args.burstiness,
            "requests": requests, "notes": workload.notes, "rows": rows}
    return 0 if save(parser, console, args.out, data, claim) else 1


if __name__ == "__main__":
    sys.exit(main())
