"""``laps loadgen``: flags, the run with its progress bar, and the report files."""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from laps.tokenizer import load_tokenizer
from loadgen.report import build_report, print_report, write_report, write_trace
from loadgen.runner import THINK_DISTRIBUTIONS, LoadgenError, RequestRecord, run_loadgen
from loadgen.workloads import DATASETS, DEFAULT_MAX_TOKENS, build_workload

DESCRIPTION = """\
Open-loop load of real chats against an OpenAI-compatible server (the laps gateway, SGLang, ...).
Conversations arrive as a Poisson process at --rate per second (or at the trace's own times for
azure-conv and replay:PATH); each turn is streamed, and the next turn follows the received answer
after a think time, with the real history. Reports TTFT, TPOT and E2E per class (x-laps-class header)
as a table, as JSON at --out and as a TTFT CDF plot next to it (.png)."""

EPILOG = """\
examples:
  laps loadgen --url http://127.0.0.1:8000 --dataset mixed --rate 2 --duration 60 --out runs/mixed.json --trace-out runs/mixed.jsonl
  laps loadgen --url http://127.0.0.1:8000 --dataset azure-conv --duration 300 --time-scale 0.5 --out runs/azure.json
  laps loadgen --url http://127.0.0.1:8000 --dataset replay:runs/mixed.jsonl --duration 60 --out runs/replay.json

datasets: hh-rlhf (multi-turn red-team chats; offensive text), mtbench (2 turns), arena, sharegpt
(single turn), azure-conv (Azure 2023 trace replay, exact prompt token counts), mixed (hh-rlhf + mtbench
chats with --long-share long requests of 1k-14k tokens), replay:PATH (a --trace-out file).
exit status: 0 when every request succeeded, 1 when any failed or the run could not start, 2 for bad arguments."""


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the load generator's flags (and its description and examples) to ``parser``."""
    parser.description = DESCRIPTION
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument(
        "--dataset", default="mixed", metavar="NAME", help=f"one of {', '.join(DATASETS)} or replay:PATH (default: %(default)s)"
    )
    parser.add_argument("--rate", type=float, help="conversation arrivals per second (Poisson); required except for trace replay")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds during which conversations and turns may start (default: %(default)s)")
    parser.add_argument("--slo-ttft-s", type=float, default=0.4, help="TTFT service-level objective in seconds (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload and of the arrival process (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("runs/loadgen.json"), help="report JSON; the PNG goes next to it (default: %(default)s)")
    parser.add_argument("--trace-out", type=Path, help="also write every request record as JSONL (replay with --dataset replay:PATH)")
    parser.add_argument("--model", help="model name to request (default: the first id from GET URL/v1/models)")
    parser.add_argument("--think-time-s", type=float, default=1.0, help="mean pause between an answer and the next turn (default: %(default)s)")
    parser.add_argument("--think-dist", choices=THINK_DISTRIBUTIONS, default="exp", help="think time: exponential or fixed (default: %(default)s)")
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiply trace arrival times (0.5 = twice as fast; default: %(default)s)")
    parser.add_argument("--long-share", type=float, default=0.2, help="mixed: expected share of requests that are long (default: %(default)s)")
    parser.add_argument(
        "--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="output tokens to request where the data has no length (default: %(default)s)"
    )
    parser.add_argument("--ignore-eos", action="store_true", help="send ignore_eos=true so outputs run to max_tokens (SGLang extension)")
    parser.add_argument("--request-timeout-s", type=float, default=300.0, help="give up on one request after this long (default: %(default)s)")
    parser.add_argument("--tokenizer", type=Path, help="HF model directory whose tokenizer counts tokens (default: built-in Qwen2.5)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar and no table (the JSON is still written)")


async def run(args: argparse.Namespace) -> dict:
    """Run the load described by ``args`` (see :func:`configure_parser`), write the files and return the report.

    Raises:
        LoadgenError: the server could not be reached or lists no model.
        ValueError: inconsistent arguments (e.g. no ``--rate`` for a Poisson dataset).
    """
    workload = await asyncio.to_thread(
        build_workload,
        args.dataset,
        random.Random(f"workload/{args.seed}"),
        tokenizer=load_tokenizer(args.tokenizer),
        default_max_tokens=args.max_tokens,
        long_share=args.long_share,
    )
    console = Console(stderr=True)
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=args.quiet or not console.is_terminal,
    )
    done = {"ok": 0, "errors": 0}
    task = progress.add_task("starting", total=args.duration)

    def on_record(rec: RequestRecord) -> None:
        done["ok" if rec.ok else "errors"] += 1
        progress.update(task, description=f"{done['ok']} ok, {done['errors']} errors")

    async def tick() -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        while True:
            progress.update(task, completed=min(args.duration, loop.time() - t0))
            await asyncio.sleep(0.25)

    with progress:
        ticker = asyncio.create_task(tick())
        try:
            records = await run_loadgen(
                args.url,
                workload,
                duration_s=args.duration,
                seed=args.seed,
                rate=None if workload.timed else args.rate,
                model=args.model,
                time_scale=args.time_scale,
                think_time_s=args.think_time_s,
                think_dist=args.think_dist,
                request_timeout_s=args.request_timeout_s,
                extra_body={"ignore_eos": True} if args.ignore_eos else None,
                on_record=on_record,
            )
        finally:
            ticker.cancel()
    meta = {
        "dataset": args.dataset,
        "url": args.url,
        "rate": None if workload.timed else args.rate,
        "time_scale": args.time_scale if workload.timed else None,
        "seed": args.seed,
        "configured_duration_s": args.duration,
        "think_time_s": args.think_time_s,
        "think_dist": args.think_dist,
        "notes": workload.notes
        + ([f"--rate {args.rate} ignored: {args.dataset} replays its own arrival times"] if workload.timed and args.rate else []),
    }
    report = build_report(records, slo_ttft_s=args.slo_ttft_s, meta=meta)
    json_path, png_path = write_report(report, records, args.out)
    if args.trace_out is not None:
        write_trace(records, args.trace_out)
    if not args.quiet:
        print_report(report, Console())
        console.print(f"wrote {json_path} and {png_path}" + (f" and {args.trace_out}" if args.trace_out else ""))
    return report


def main(args: argparse.Namespace) -> int:
    """Run ``laps loadgen``; exit status 0 if every request succeeded, 1 if any failed or the run could not start, 2 for bad arguments."""
    try:
        report = asyncio.run(run(args))
    except LoadgenError as err:
        print(f"laps loadgen: {err}", file=sys.stderr)
        return 1
    except ValueError as err:
        print(f"laps loadgen: {err}", file=sys.stderr)
        return 2
    return 0 if report["requests"]["errors"] == 0 else 1
