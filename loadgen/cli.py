"""``laps loadgen`` and ``laps simulate``: shared workload flags, the runs with their progress bars, the report files."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from engines.manager import sim_model
from laps.config import DEFAULT_CONFIG_PATH, load_config, parse_config
from laps.tokenizer import ChatTokenizer, load_tokenizer
from loadgen.outputs import check_output_path, is_stdout
from loadgen.report import build_report, plot_path, print_report, write_report, write_trace
from loadgen.runner import THINK_DISTRIBUTIONS, LoadgenError, RequestRecord, discover_context_tokens, run_loadgen
from loadgen.simulate import simulate_run
from loadgen.workloads import (
    BURSTINESS_RANGE, DATASETS, DEFAULT_MAX_TOKENS, TIMED_DATASETS, TRACE_FORMATS, Workload, build_workload,
)
from policies.registry import POLICIES

DESCRIPTION = """\
Open-loop load of real chats against an OpenAI-compatible server (the laps gateway, SGLang, ...).
Conversations arrive at --rate per second, as a Poisson process or, with --burstiness, in bursts or more
evenly (or at the trace's own times for azure-conv, code-burst, replay:PATH, mooncake:PATH and azure:PATH);
each turn is streamed, and the next turn follows the received answer after a think time, with the real
history. Reports TTFT, TPOT and E2E per class (x-laps-class header) as a table, as JSON at --out and as a
TTFT CDF plot next to it (.png)."""

EPILOG = """\
examples:
  laps loadgen --url http://127.0.0.1:8000 --dataset mixed --rate 2 --duration 60 --out runs/mixed.json --trace-out runs/mixed.jsonl
  laps loadgen --url http://127.0.0.1:8000 --dataset azure-conv --duration 300 --time-scale 0.5 --out runs/azure.json
  laps loadgen --url http://127.0.0.1:8000 --dataset replay:runs/mixed.jsonl --duration 60 --out runs/replay.json
  laps loadgen --url http://127.0.0.1:30000 --dataset mooncake:conversation_trace.jsonl --duration 600 --time-scale 0.5 --max-requests 2000

datasets: hh-rlhf (multi-turn red-team chats; offensive text), mtbench (2 turns), arena, sharegpt
(single turn), azure-conv (Azure 2023 trace replay, exact prompt token counts), mixed (hh-rlhf + mtbench
chats with --long-share long requests of 1k-14k tokens), docs (mixed with half the requests long;
--long-share does not apply), chat-single (first turns of hh-rlhf, arena, sharegpt and mtbench, single
turn), shared-docs (10k-30k-token documents asked 3-8 questions each, interleaved), code-burst (bursty
code completion's lengths on chat text: 1 h at 5.5 req/s mean, prompts ~1,500 tokens, replies ~13;
timed), replay:PATH (a --trace-out file); trace files: mooncake:PATH (Mooncake JSONL: times, exact lengths, equal hash ids as
equal 512-token blocks), azure:PATH (Azure LLM inference CSV, 2023 or 2024), sharegpt:PATH (ShareGPT JSON
or JSONL conversations, multi-turn, recorded reply lengths, or first-turn prompts; arriving at --rate),
lengths:PATH (a CSV of prompt and output token counts, num_prefill_tokens,num_decode_tokens or
input_tokens,output_tokens: single-turn requests of real text cut to those lengths; arriving at --rate).

exit status: 0 when every request succeeded, 1 when any failed, the run could not start or an output could not be written
after it, 2 for bad arguments (an output path refused before the run too), 130 after a Ctrl-C (no report written)."""


def _number(text: str, kind: type) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {'an integer' if kind is int else 'a number'}: {text!r}") from None
    if kind is float and not math.isfinite(value):  # an integer is finite (and may pass a float's range)
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse ``type``: a number > 0 (else :class:`argparse.ArgumentTypeError`, so exit status 2)."""
    value = _number(text, float)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def output_file(text: str) -> Path:
    """argparse ``type``: a file's path; one that can only name a folder (empty, ending in ``/``, ``.`` or ``..``) is
    refused (:class:`argparse.ArgumentTypeError`, so exit status 2)."""
    if os.path.basename(text) in ("", ".", ".."):  # as given: Path("x/.") would read "x"
        raise argparse.ArgumentTypeError(f"{text!r} names a folder, not a file")
    return Path(text)


def http_url(text: str) -> str:
    """argparse ``type``: a server's base URL, ``http://`` or ``https://`` with a host (and a port from 1 to 65535 if
    any); else :class:`argparse.ArgumentTypeError`, so exit status 2."""
    try:
        parts = urlsplit(text)
        valid = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
    except ValueError:  # a port that is no number or past 65535
        valid = False
    if not valid:
        raise argparse.ArgumentTypeError(f"not an http:// or https:// URL with a host: {text!r}")
    return text


def gamma_shape(text: str) -> float:
    """argparse ``type``: a gamma shape within :data:`~loadgen.workloads.BURSTINESS_RANGE` (else
    :class:`argparse.ArgumentTypeError`, so exit status 2)."""
    value = _number(text, float)
    low, high = BURSTINESS_RANGE
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"must be between {low:g} (bursts, CV 10) and {high:g} (nearly even), got {text}")
    return value


def non_negative_float(text: str) -> float:
    """argparse ``type``: a number >= 0 (else :class:`argparse.ArgumentTypeError`, so exit status 2)."""
    value = _number(text, float)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def int_range(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``low`` and, unless ``high`` is None, <= ``high`` (else
    :class:`argparse.ArgumentTypeError`, so exit status 2)."""

    def integer(text: str) -> int:
        value = int(_number(text, int))
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}" if high is None else f"must be in [{low}, {high}], got {text}")
        return value

    return integer


positive_int = int_range(1)
# Every laps command's --seed: an unsigned 64-bit integer, the widest the report's JSON writer (orjson) takes; none
# negative, as random.Random(-n) (calibrate's) draws what random.Random(n) does.
seed_value = int_range(0, 2**64 - 1)


def share(text: str) -> float:
    """argparse ``type``: a share, a number in [0, 1] (else :class:`argparse.ArgumentTypeError`, so exit status 2)."""
    value = _number(text, float)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def add_workload_arguments(parser: argparse.ArgumentParser, default_out: Path, context_default: str) -> None:
    """The flags ``laps loadgen`` and ``laps simulate`` share: what load to send and where the report goes.

    ``context_default`` says in ``--help`` where ``--max-context-tokens`` comes from when not given.
    """
    traces = ", ".join(f"{k}:PATH" for k in TRACE_FORMATS)
    parser.add_argument(
        "--dataset", default="mixed", metavar="NAME",
        help=f"one of {', '.join(DATASETS)}, replay:PATH or a trace file {traces} (default: %(default)s)"
    )
    parser.add_argument("--rate", type=positive_float, help="conversation arrivals per second (on average); required except for trace replay")
    parser.add_argument("--burstiness", type=gamma_shape, default=1.0,
                        help="arrival gaps drawn from a gamma distribution of this shape with mean 1/--rate: 1 is Poisson, "
                             "below 1 bursts (0.25: coefficient of variation 2), above 1 more even; as vllm bench serve's "
                             "--burstiness; trace replay keeps its own times (default: %(default)s)")
    parser.add_argument("--duration", type=positive_float, default=60.0, help="seconds during which conversations and turns may start (default: %(default)s)")
    parser.add_argument("--seed", type=seed_value, default=0, help="seed of the workload and of the arrival process (default: %(default)s)")
    parser.add_argument("--out", type=output_file, default=default_out, help="report JSON; the TTFT plot goes next to it, the same name with .png (none beside a device or a FIFO, e.g. /dev/stdout) (default: %(default)s)")
    parser.add_argument("--trace-out", type=output_file, help="also write every request record as JSONL (replay with --dataset replay:PATH)")
    parser.add_argument("--think-time-s", type=non_negative_float, default=1.0, help="mean pause between an answer and the next turn (default: %(default)s)")
    parser.add_argument("--think-dist", choices=THINK_DISTRIBUTIONS, default="exp", help="think time: exponential or fixed (default: %(default)s)")
    parser.add_argument("--time-scale", type=positive_float, default=1.0, help="multiply trace arrival times (0.5 = twice as fast; default: %(default)s)")
    parser.add_argument("--max-requests", type=positive_int, help="send at most this many requests (turns), whatever --duration allows")
    parser.add_argument("--max-context-tokens", type=positive_int, metavar="TOKENS",
                        help="leave out trace requests whose prompt plus output tokens pass this context, counted in the report "
                             f"(default: {context_default})")
    parser.add_argument("--long-share", type=share, default=0.2, help="mixed: expected share of requests that are long (default: %(default)s)")
    parser.add_argument(
        "--max-tokens", type=positive_int, default=DEFAULT_MAX_TOKENS, help="output tokens to request where the data has no length (default: %(default)s)"
    )
    parser.add_argument("--ignore-eos", action="store_true", help="send ignore_eos=true so outputs run to max_tokens (SGLang extension)")
    parser.add_argument("--request-timeout-s", type=positive_float, default=300.0, help="give up on one request after this long (default: %(default)s)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar and no table (the JSON is still written)")


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the load generator's flags (and its description and examples) to ``parser``."""
    parser.description = DESCRIPTION
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--url", type=http_url, required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", help="model name to request (default: the first id from GET URL/v1/models)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="client key sent as Authorization: Bearer, for a gateway with gateway.api_keys "
                             "(default: the OPENAI_API_KEY environment variable; none when unset)")
    parser.add_argument("--tokenizer", type=Path, help="HF model directory whose tokenizer counts tokens (default: built-in Qwen2.5)")
    parser.add_argument("--slo-ttft-s", type=positive_float, default=0.4, help="TTFT service-level objective in seconds (default: %(default)s)")
    parser.add_argument("--slo-per-1k-new-tokens-s", type=non_negative_float,
                        help="also report the length-aware objective: --slo-ttft-s plus this many seconds per 1,000 new prompt tokens")
    add_workload_arguments(parser, Path("runs/loadgen.json"), "the server's max_model_len from GET /v1/models "
                           "when it lists one (SGLang and the laps gateway do), else no limit")


def load_workload(args: argparse.Namespace, tokenizer: ChatTokenizer, context_tokens: int | None) -> Workload:
    """The workload the shared flags name, from ``random.Random(f"workload/{seed}")``; trace requests past
    ``context_tokens`` (prompt plus output) are left out and counted.

    Raises:
        ValueError: as :func:`~loadgen.workloads.build_workload`.
    """
    return build_workload(args.dataset, random.Random(f"workload/{args.seed}"), tokenizer=tokenizer,
                          default_max_tokens=args.max_tokens, long_share=args.long_share, max_context_tokens=context_tokens)


def workload_meta(args: argparse.Namespace, workload: Workload) -> dict:
    """The report's description of the load (``dataset``, ``rate``, ``seed``, durations, think times, notes,
    ``max_requests``, and ``trace_rows`` {read, over_context, context_tokens} for trace files)."""
    ignored = []
    if workload.timed and args.rate is not None:
        ignored.append(f"--rate {args.rate:g} ignored: {args.dataset} replays its own arrival times")
    if workload.timed and args.burstiness != 1.0:
        ignored.append(f"--burstiness {args.burstiness:g} ignored: {args.dataset} replays its own arrival times")
    if not workload.timed and args.time_scale != 1.0:
        ignored.append(f"--time-scale {args.time_scale:g} ignored: {args.dataset} arrives at --rate, not at a trace's times")
    return {
        "dataset": args.dataset,
        "rate": None if workload.timed else args.rate,
        "burstiness": None if workload.timed else args.burstiness,
        "time_scale": args.time_scale if workload.timed else None,
        "seed": args.seed,
        "configured_duration_s": args.duration,
        "think_time_s": args.think_time_s,
        "think_dist": args.think_dist,
        "ignore_eos": args.ignore_eos,
        "max_requests": args.max_requests,
        **({} if workload.rows is None else {"trace_rows": workload.rows.to_dict()}),
        "notes": workload.notes + ignored,
    }


def _run_arguments(args: argparse.Namespace, workload: Workload, on_record: Callable[[RequestRecord], None]) -> dict:
    """The keyword arguments that a live run (:func:`~loadgen.runner.run_loadgen`) and a virtual one
    (:func:`~loadgen.simulate.simulate_run`) take alike from the workload flags (:func:`add_workload_arguments`)."""
    return {
        "duration_s": args.duration,
        "seed": args.seed,
        "rate": None if workload.timed else args.rate,
        "burstiness": args.burstiness,
        "time_scale": args.time_scale,
        "think_time_s": args.think_time_s,
        "think_dist": args.think_dist,
        "request_timeout_s": args.request_timeout_s,
        "on_record": on_record,
        "max_requests": args.max_requests,
    }


class Interrupted(KeyboardInterrupt):
    """A Ctrl-C during a run, before its report was written (none is); the message says how many requests had
    finished (``done``: :func:`_progress_bar`'s counts)."""

    def __init__(self, done: dict[str, int]) -> None:
        super().__init__(f"interrupted after {done['ok'] + done['errors']} requests had finished ({done['errors']} failed); "
                         "no report written")


def _progress_bar(args: argparse.Namespace, console: Console, unit: str) -> tuple[Progress, TaskID, Callable[[RequestRecord], None], dict[str, int]]:
    """A progress bar over ``args.duration`` (in ``unit``), the record callback that counts ok/errors on it, and those
    counts (``{"ok": N, "errors": N}``).

    Disabled with ``--quiet`` or when ``console`` is not a terminal.
    """
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn(f"{{task.completed:.0f}}/{{task.total:.0f}} {unit}"),
        TimeElapsedColumn(),
        console=console,
        disable=args.quiet or not console.is_terminal,
    )
    task = progress.add_task("starting", total=args.duration)
    done = {"ok": 0, "errors": 0}

    def on_record(rec: RequestRecord) -> None:
        done["ok" if rec.ok else "errors"] += 1
        progress.update(task, description=f"{done['ok']} ok, {done['errors']} errors")

    return progress, task, on_record, done


def check_output_paths(out: Path | None, trace_out: Path | None = None) -> None:
    """Refuse ``--out`` (``out``, and the PNG beside it, :func:`~loadgen.report.plot_path`) and ``--trace-out``
    (``trace_out``) before the run, not after it: each as :func:`check_output_path`, and no two outputs one file (one
    name, a link, a hard link, one pipe) nor one where another needs a folder. A device (/dev/null, a terminal) may take
    more than one output. A refused run leaves no file or folder behind.

    Raises:
        ValueError: as :func:`check_output_path`; two outputs are one file, or one needs the other's path as its
            folder; the message names the flag and the path.
    """
    outputs = [("--out", lambda: out)] if out is not None else []
    outputs += [("--out's plot", lambda: plot_path(out))] if out is not None else []
    outputs += [("--trace-out", lambda: trace_out)] if trace_out is not None else []
    seen: dict[object, tuple[str, Path]] = {}
    for flag, path_of in outputs:
        try:
            path = path_of()
        except OSError as err:  # the plot's name, beside an --out that cannot be looked up
            raise ValueError(f"{flag} {out}: cannot be written ({err.strerror or err})") from None
        if path is None:  # no plot beside a stream
            continue
        identity = check_output_path(flag, path)
        if identity in seen:
            raise ValueError(f"{flag} {path}: the same file as {seen[identity][0]}; give each output its own name")
        for other, (other_flag, other_path) in seen.items():  # new files only: an existing one's folders exist
            if isinstance(identity, Path) and isinstance(other, Path) and identity in other.parents:
                raise ValueError(f"{flag} {path}: {other_flag} {other_path} needs it as a folder")
            if isinstance(identity, Path) and isinstance(other, Path) and other in identity.parents:
                raise ValueError(f"{flag} {path}: needs {other_flag} {other_path} as a folder")
        if identity is not None:
            seen[identity] = flag, path


def write_outputs(args: argparse.Namespace, report: dict, records: list[RequestRecord], console: Console) -> None:
    """Write the report JSON and PNG (and the trace with ``--trace-out``); print the table (to standard error where an
    output goes to standard output) and the workload's notes (e.g. an argument the dataset ignores) unless ``--quiet``.

    Raises:
        LoadgenError: a file cannot be written (a full disk), naming it.
    """
    written: list[Path] = []
    png = plot_path(args.out)
    try:
        write_report(report, records, args.out, written)
        if args.trace_out is not None:
            write_trace(records, args.trace_out)
            written.append(args.trace_out)
    except OSError as err:  # after the run (a full disk): one line, not a traceback, saying what was written before
        if png is not None and png not in written:  # written in this order: the plot, the JSON, the trace
            flag, path = "--out's plot", png
        elif args.out not in written:
            flag, path = "--out", args.out
        else:
            flag, path = "--trace-out", args.trace_out
        raise LoadgenError(f"cannot write {flag} {path}: {err.strerror or err}"
                           + (f" (written: {', '.join(map(str, written))})" if written else "")) from None
    if not args.quiet:  # the table to standard error where the JSON goes to standard output (one document there)
        print_report(report, Console(stderr=any(p is not None and is_stdout(p) for p in (args.out, args.trace_out))))
        for note in report.get("notes", []):
            console.print(f"note: {note}", markup=False, highlight=False)
        console.print("wrote " + " and ".join(str(p) for p in sorted(written, key=lambda p: p != args.out)))  # the JSON first


async def run(args: argparse.Namespace) -> dict:
    """Run the load described by ``args`` (see :func:`configure_parser`), write the files and return the report.

    Raises:
        LoadgenError: the server could not be reached or lists no model.
        ValueError: inconsistent arguments (e.g. no ``--rate`` for a Poisson dataset), or an output path that cannot
            be written (:func:`check_output_paths`).
        Interrupted: a Ctrl-C (under :func:`asyncio.run`) before the report was written.
    """
    check_output_paths(args.out, args.trace_out)
    console = Console(stderr=True)
    progress, task, on_record, done = _progress_bar(args, console, "elapsed s")
    try:
        context = args.max_context_tokens
        if context is None and args.dataset.partition(":")[0] in (*TRACE_FORMATS, *TIMED_DATASETS):
            context = await discover_context_tokens(args.url, args.api_key)
        workload = await asyncio.to_thread(load_workload, args, load_tokenizer(args.tokenizer), context)

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
                    model=args.model,
                    extra_body={"ignore_eos": True} if args.ignore_eos else None,
                    api_key=args.api_key,
                    **_run_arguments(args, workload, on_record),
                )
            finally:
                ticker.cancel()
    except asyncio.CancelledError:  # a Ctrl-C: asyncio.run cancels this task (and then raises KeyboardInterrupt)
        raise Interrupted(done) from None
    meta = {"mode": "live", "url": args.url, **workload_meta(args, workload)}
    report = build_report(records, slo_ttft_s=args.slo_ttft_s, slo_ttft_per_1k_s=args.slo_per_1k_new_tokens_s, meta=meta)
    write_outputs(args, report, records, console)
    return report


def main(args: argparse.Namespace) -> int:
    """Run ``laps loadgen``; exit status 0 if every request succeeded, 1 if any failed, the run could not start or an
    output could not be written after it, 2 for bad arguments, 130 for a Ctrl-C before the report was written (one line
    says how many requests had finished; none is written)."""
    try:
        report = asyncio.run(run(args))
    except Interrupted as err:
        print(f"laps loadgen: {err}", file=sys.stderr)
        return 128 + signal.SIGINT
    except LoadgenError as err:
        print(f"laps loadgen: {err}", file=sys.stderr)
        return 1
    except ValueError as err:
        print(f"laps loadgen: {err}", file=sys.stderr)
        return 2
    return 0 if report["requests"]["errors"] == 0 else 1


SIMULATE_DESCRIPTION = """\
The whole deployment of --config in virtual time: the gateway's policies (classifier, prefix index,
scheduler) in front of its engines, each an SGLang 0.5.23 engine model (its role's flags, the config's
simulated model and GPU); no sockets, no processes. Same workloads, flags and report JSON as laps
loadgen, plus the scheduler's counters (key "scheduler": for laps its short batches by trigger,
spill-overs between pools, requests sent to a prefill in flight), the controller's moves (key
"controller", with controller.enabled) and the KV transfers (key "kv_transfer", with pd:), all also
printed; a progress bar in simulated seconds; the same seed gives the same report. --policy
overrides scheduling.policy (checked like the file)."""

SIMULATE_EPILOG = """\
examples:
  laps simulate --config config.yaml --dataset mixed --rate 2 --duration 600 --policy laps --seed 0 --out runs/sim/laps.json
  laps simulate --dataset hh-rlhf --rate 20 --duration 300 --policy round_robin --out runs/sim/rr.json
  laps simulate --dataset replay:runs/mixed.jsonl --duration 60 --out runs/sim/replay.json
  laps simulate --dataset mooncake:conversation_trace.jsonl --duration 120 --max-requests 500 --out runs/sim/mooncake.json

exit status: 0 when every request succeeded, 1 when any failed or an output could not be written after the run, 2 for
bad arguments or configuration (an output path refused before the run too), 130 after a Ctrl-C (no report written)."""


def configure_simulate_parser(parser: argparse.ArgumentParser) -> None:
    """Add ``laps simulate``'s flags (and its description and examples) to ``parser``."""
    parser.description = SIMULATE_DESCRIPTION
    parser.epilog = SIMULATE_EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG_PATH, help="deployment YAML (default: %(default)s)")
    parser.add_argument("--policy", choices=sorted(POLICIES), help="scheduling policy (default: the config's scheduling.policy)")
    parser.add_argument("--slo-ttft-s", type=positive_float, help="TTFT objective of the report (default: the config's slo.ttft_s)")
    parser.add_argument("--serving-latency-ms", type=non_negative_float, default=0.0,
                        help="HTTP and tokenization latency per request, half on the way in, half on the way back "
                             "(default: %(default)s)")
    parser.add_argument("--serving-latency-per-1k-ms", type=non_negative_float, default=0.0,
                        help="more serving latency on the way in per 1,000 new (uncached) prompt tokens: tokenizing "
                             "and moving the prompt (default: %(default)s; bench/live_vs_virtual.py measures both)")
    add_workload_arguments(parser, Path("runs/simulate.json"), "the smallest context length of the simulated engines")


def run_simulation(args: argparse.Namespace) -> dict:
    """Simulate the run ``args`` describe (see :func:`configure_simulate_parser`), write the files, return the report.

    Raises:
        ConfigError: the configuration cannot be used.
        ValueError: inconsistent arguments, an output path that cannot be written (:func:`check_output_paths`), or a
            role the engine model cannot run.
        Interrupted: a Ctrl-C before the report was written.
    """
    check_output_paths(args.out, args.trace_out)
    console = Console(stderr=True)
    progress, task, on_record, done = _progress_bar(args, console, "simulated s")
    try:
        config = load_config(args.config)
        if args.policy is not None:
            data = config.model_dump(exclude_unset=True)  # validated again: a policy may not fit the deployment
            data.setdefault("scheduling", {})["policy"] = args.policy
            config = parse_config(data, f"{args.config} with --policy {args.policy}")
        tokenizer = load_tokenizer(config.model.path)
        context = args.max_context_tokens
        if context is None:
            context = min(sim_model(config, engine).config.context_length for engine in config.engines)
        workload = load_workload(args, tokenizer, context)

        def on_progress(sim_time: float) -> None:
            progress.update(task, completed=min(args.duration, sim_time))

        wall = time.perf_counter()
        with progress:
            virtual = simulate_run(
                config,
                workload,
                ignore_eos=args.ignore_eos,
                serving_latency_s=args.serving_latency_ms / 1e3,
                serving_latency_per_1k_s=args.serving_latency_per_1k_ms / 1e3,
                tokenizer=tokenizer,
                on_progress=on_progress,
                **_run_arguments(args, workload, on_record),
            )
        wall = time.perf_counter() - wall
    except KeyboardInterrupt:
        raise Interrupted(done) from None
    records = virtual.records
    meta = {
        "mode": "virtual",
        "config": str(args.config),
        "policy": config.scheduling.policy,
        "engines": [{"name": e.name, "kind": e.kind, "role": e.role, "gpus": len(e.gpus) or 1} for e in config.engines],
        "sim": {"model": config.sim.model, "gpu": config.sim.gpu},
        "serving_latency_ms": args.serving_latency_ms,
        "serving_latency_per_1k_ms": args.serving_latency_per_1k_ms,
        **workload_meta(args, workload),
    }
    report = {**build_report(records, slo_ttft_s=config.slo.ttft_s if args.slo_ttft_s is None else args.slo_ttft_s,
                             slo_ttft_per_1k_s=config.slo.ttft_per_1k_new_tokens_s, meta=meta), **virtual.summary()}
    write_outputs(args, report, records, console)
    if not args.quiet:
        end = max((r.end_s for r in records), default=0.0)
        console.print(f"simulated {end:.1f} s in {wall:.2f} s of wall time ({end / max(wall, 1e-9):.1f} simulated s per s)")
    return report


def simulate_main(args: argparse.Namespace) -> int:
    """Run ``laps simulate``; exit status 0 if every request succeeded, 1 if any failed or an output could not be
    written after the run, 2 for bad arguments, 130 for a Ctrl-C before the report was written (one line says how many
    requests had finished; none is written)."""
    try:
        report = run_simulation(args)
    except Interrupted as err:
        print(f"laps simulate: {err}", file=sys.stderr)
        return 128 + signal.SIGINT
    except LoadgenError as err:  # the outputs could not be written after the run
        print(f"laps simulate: {err}", file=sys.stderr)
        return 1
    except ValueError as err:
        print(f"laps simulate: {err}", file=sys.stderr)
        return 2
    return 0 if report["requests"]["errors"] == 0 else 1
