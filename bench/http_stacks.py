"""Which HTTP stack for the gateway's data plane: minimal relays on each stack, side by side, in one run.

    python bench/http_stacks.py --out runs/http_stacks.json            # ~8 minutes
    python bench/http_stacks.py --quick --out runs/http_stacks_quick.json
    python bench/http_stacks.py --servers granian --clients aiohttp-tuned pyreqwest --out runs/hs.json

The candidates (``bench/relay_stacks.py`` has the relays and what each name
means): servers ``aiohttp-web`` (as the gateway serves), ``aiohttp-lowlevel``,
``granian`` (Rust, RSGI); clients ``aiohttp-gateway`` (as the gateway's
engine client), ``aiohttp-tuned``, ``pyreqwest`` (Rust); loops ``asyncio`` and
``uvloop``; every combination. Each relay parses the chat request, picks an
engine round robin and relays the answer (whole, or SSE chunk by chunk): the
gateway's data plane without its scheduling, so the figures are the floor each
stack puts under the gateway.

The engines, the load and the CPU accounting are ``bench/router_overhead.py``'s:
two zero-time simulated SGLang engines (``--sim-zero-time``: forward passes take
no time), the same real multi-turn chats (``max_tokens`` --max-tokens,
``ignore_eos``), the same closed-loop aiohttp load generator on uvloop. Against
the same engine processes, --rounds times: direct, then each stack (a fresh
relay process each round; the stacks' order rotated by one each round so none
always runs at the same point of the machine's load), with these phases:

- ``c1``: --latency-requests non-streaming chats at concurrency 1; *added
  latency* p50 = the relay's p50 minus direct's, direct's measured again right
  before each stack (``direct_c1`` / ``direct_stream_keepalive``) so the two are
  back to back on a machine whose load drifts;
- ``c32`` / ``c256``: non-streaming, --phase-s seconds each: req/s;
- ``c32_stream`` / ``c256_stream``: streaming, --phase-s seconds each: req/s
  (completed streams);
- ``stream_keepalive``: --latency-requests streams at concurrency 1 on one
  kept-alive connection: time to the first body bytes, minus direct's (the
  PyPI ``sglang-router`` 0.3.2 holds each such stream's first chunk ~43 ms);
- relay CPU per request in every phase: user + system CPU of the relay's
  process tree (``/proc/PID/stat``; granian's worker process included) over the
  phase, divided by its requests. req/s on a shared 2-core machine depends on
  what else runs; CPU µs per request less so, though under a load average of
  6-8 it too moves by a third from one run to the next (contention, and how
  many requests each loop turn batches): hence rounds and medians.

Prints a table of medians over the rounds (with the machine's core count and
load average) and writes to --out ``{"setup", "direct": target, "stacks":
{"server / client / loop": target}, "ranking"}``; a target is ``{"median":
{phase: {"rps", "p50_ms", "gateway_cpu_us_per_req"}}, "added_p50_ms": {"c1",
"stream_keepalive"}, "errors", "first_error", "loadavg_1min": [per round],
"rounds": [{phase: bench/router_overhead.py's Phase}]}``; ``"ranking"``: the
stacks by mean CPU µs per request over the throughput phases, least first.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.dominance import bench_console, claim_out, save  # noqa: E402
from bench.relay_stacks import CLIENTS, LOOPS, SERVERS  # noqa: E402
from bench.router_overhead import READY_TIMEOUT_S, Phase, chat_bodies, run_live, run_phase, streaming, work_folder, zero_time_config  # noqa: E402
from engines.client import EngineClient  # noqa: E402
from engines.manager import EngineManager  # noqa: E402
from engines.tiny_model import write_tiny_qwen2_model  # noqa: E402
from laps.config import DEFAULT_CONFIG_PATH, load_config  # noqa: E402
from laps.doc_help import doc_parser  # noqa: E402
from loadgen.cli import output_file  # noqa: E402

RELAY_SCRIPT = Path(__file__).resolve().parent / "relay_stacks.py"
RELAY_START_TIMEOUT_S = 60.0
THROUGHPUT_PHASES = ("c32", "c256", "c32_stream", "c256_stream")
LATENCY_PHASES = ("c1", "stream_keepalive")

console = Console(stderr=True)


def stack_name(server: str, client: str, loop: str) -> str:
    return f"{server} / {client} / {loop}"


@contextlib.contextmanager
def relay_process(server: str, client: str, loop: str, engine_urls: Sequence[str], log_path: Path) -> Iterator[tuple[str, int]]:
    """``bench/relay_stacks.py`` for one stack in a child process; yields its URL and pid once it answers HTTP.

    Raises:
        RuntimeError: it exited or did not answer within ``RELAY_START_TIMEOUT_S`` (its log named).
    """
    log = log_path.open("wb")
    proc = subprocess.Popen([sys.executable, str(RELAY_SCRIPT), "--server", server, "--client", client, "--loop", loop,
                             "--engines", ",".join(engine_urls)], stdout=subprocess.PIPE, stderr=log, start_new_session=True)
    try:
        line = proc.stdout.readline().decode()
        if not line.startswith("relay ready on "):
            raise RuntimeError(f"relay {stack_name(server, client, loop)} did not start; see {log_path}")
        yield f"http://127.0.0.1:{int(line.split()[-1])}", proc.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


async def wait_answering(url: str, timeout_s: float) -> None:
    """Until ``url`` answers any HTTP request (granian's worker starts after its port is chosen).

    Raises:
        RuntimeError: no answer within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=1)):
                    return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s")


def latency_plan(args: argparse.Namespace, chats: Iterator[bytes]) -> dict[str, dict]:
    """The concurrency-1 phases: non-streaming, and streaming on one kept-alive connection (module doc)."""
    return {"c1": dict(bodies=chats, concurrency=1, requests=args.latency_requests),
            "stream_keepalive": dict(bodies=map(streaming, chats), concurrency=1, requests=args.latency_requests, stream=True)}


async def run_plan(urls: Sequence[str], pid: int | None, plan: dict[str, dict], prefix: str = "") -> dict[str, Phase]:
    """Each phase of ``plan`` (``{label: run_phase keyword arguments}``) in order, keyed ``prefix + label``."""
    phases = {}
    for label, kwargs in plan.items():
        phases[prefix + label] = phase = await run_phase(urls, gateway_pid=pid, **kwargs)
        if phase.errors:
            console.print(f"[red]{prefix}{label}: {phase.errors} errors, first: {phase.first_error}[/red]")
    return phases


async def measure(urls: Sequence[str], pid: int | None, args: argparse.Namespace, chats: Iterator[bytes]) -> dict[str, Phase]:
    """The phases of one target (module doc), after a warm-up."""
    stream_chats = map(streaming, chats)
    plan = {
        "c1": latency_plan(args, chats)["c1"],
        "c32": dict(bodies=chats, concurrency=32, duration_s=args.phase_s),
        "c256": dict(bodies=chats, concurrency=256, duration_s=args.phase_s),
        "c32_stream": dict(bodies=stream_chats, concurrency=32, duration_s=args.phase_s, stream=True),
        "c256_stream": dict(bodies=stream_chats, concurrency=256, duration_s=args.phase_s, stream=True),
        "stream_keepalive": latency_plan(args, chats)["stream_keepalive"],
    }
    await run_phase(urls, chats, 8, requests=100)  # warm-up: connections, lazy imports
    return await run_plan(urls, pid, plan)


async def bench(args: argparse.Namespace, work: Path) -> dict:
    """Start the engines; --rounds times, direct then every stack (in an order rotated each round); stop everything;
    the result JSON."""
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    loadavg_at_start = os.getloadavg()
    model_dir, log_dir = work / "model", work / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    await asyncio.to_thread(write_tiny_qwen2_model, model_dir)
    config = zero_time_config(load_config(args.config), model_dir, log_dir)
    console.print("loading the data sets ...")
    chats = chat_bodies(config.model.name, args.max_tokens, args.max_reply_chars, args.seed)
    await asyncio.to_thread(next, chats)  # loads the files
    manager = EngineManager(config, ready_timeout_s=READY_TIMEOUT_S)
    combos = list(itertools.product(args.servers, args.clients, args.loops))
    rounds: dict[str, list[dict]] = {"direct": [], **{stack_name(*combo): [] for combo in combos}}
    loadavg: dict[str, list[float]] = {name: [] for name in rounds}
    async with EngineClient() as engine_client:
        try:
            engine_urls = list((await manager.start(engine_client)).values())
            for n in range(args.rounds):
                console.print(f"round {n + 1} of {args.rounds}: direct ...")
                loadavg["direct"].append(os.getloadavg()[0])
                rounds["direct"].append(as_dicts(await measure(engine_urls, None, args, chats)))
                for server, client, loop in combos[n % len(combos):] + combos[:n % len(combos)]:
                    name = stack_name(server, client, loop)
                    console.print(f"round {n + 1} of {args.rounds}: {name} ...")
                    loadavg[name].append(os.getloadavg()[0])
                    with relay_process(server, client, loop, engine_urls, log_dir / f"relay-{server}-{client}-{loop}.log") as (url, pid):
                        await wait_answering(url, RELAY_START_TIMEOUT_S)
                        paired = await run_plan(engine_urls, None, latency_plan(args, chats), prefix="direct_")
                        rounds[name].append(as_dicts({**await measure([url], pid, args, chats), **paired}))
        finally:
            await manager.stop()
    targets = {name: {**summary(target_rounds), "loadavg_1min": loadavg[name], "rounds": target_rounds}
               for name, target_rounds in rounds.items()}
    result = {
        "setup": {"cpu_cores": os.cpu_count(), "loadavg_at_start": loadavg_at_start, "loadavg_at_end": os.getloadavg(),
                  "python": sys.version.split()[0], "rounds": args.rounds, "phase_s": args.phase_s,
                  "latency_requests": args.latency_requests, "max_tokens": args.max_tokens, "engines": 2, "seed": args.seed,
                  "versions": package_versions()},
        "direct": targets.pop("direct"),
        "stacks": targets,
    }
    result["ranking"] = ranking(result["stacks"])
    return result


def as_dicts(phases: dict[str, Phase]) -> dict[str, dict]:
    return {label: asdict(phase) for label, phase in phases.items()}


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summary(rounds: list[dict[str, dict]]) -> dict:
    """A target's rounds in a few figures: per phase the median over rounds of req/s, latency p50 and CPU µs per
    request (``"median"``); the median of each round's added latency p50 over direct's just before it (``"added_p50_ms"``,
    only where there is a paired direct phase); all errors."""
    median = {label: {key: _median([r[label][key] for r in rounds]) for key in ("rps", "p50_ms", "gateway_cpu_us_per_req")}
              for label in rounds[0] if not label.startswith("direct_")}
    added = {label: _median([None if r[label]["p50_ms"] is None or r[f"direct_{label}"]["p50_ms"] is None
                             else r[label]["p50_ms"] - r[f"direct_{label}"]["p50_ms"] for r in rounds])
             for label in LATENCY_PHASES if f"direct_{label}" in rounds[0]}
    errors = sum(phase["errors"] for r in rounds for phase in r.values())
    first_error = next((phase["first_error"] for r in rounds for phase in r.values() if phase["first_error"]), None)
    return {"median": median, "added_p50_ms": added, "errors": errors, "first_error": first_error}


def package_versions() -> dict[str, str | None]:
    import importlib.metadata

    versions = {}
    for name in ("aiohttp", "granian", "pyreqwest", "uvloop"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def mean_cpu_us(median: dict[str, dict]) -> float | None:
    """Mean relay CPU µs per request over the throughput phases' medians (None if a phase has none)."""
    values = [median[label]["gateway_cpu_us_per_req"] for label in THROUGHPUT_PHASES]
    return None if None in values else sum(values) / len(values)


def ranking(stacks: dict[str, dict]) -> list[dict]:
    """The stacks by mean CPU µs per request over the throughput phases, least first, with their req/s (medians)."""
    rows = [{"stack": name, "cpu_us_per_req": mean_cpu_us(target["median"]),
             **{f"{label}_rps": target["median"][label]["rps"] for label in THROUGHPUT_PHASES}} for name, target in stacks.items()]
    return sorted(rows, key=lambda row: float("inf") if row["cpu_us_per_req"] is None else row["cpu_us_per_req"])


def _f(v: float | None, fmt: str) -> str:
    return "—" if v is None else fmt.format(v)


def print_table(result: dict, out: Console) -> None:
    """One row per stack (and direct), medians over the rounds: req/s, CPU µs per request, added latency at
    concurrency 1, kept-alive TTFT (on ``out``)."""
    s, direct = result["setup"], result["direct"]
    table = Table(title=f"HTTP stacks: {s['cpu_cores']} CPU cores (load avg {s['loadavg_at_start'][0]:.1f} at start, "
                        f"{s['loadavg_at_end'][0]:.1f} at end), 2 zero-time sim engines, chats max_tokens {s['max_tokens']}, "
                        f"medians of {s['rounds']} rounds of {s['phase_s']:g} s per throughput phase")
    table.add_column("server / client / loop", no_wrap=True)
    for label in THROUGHPUT_PHASES:
        table.add_column(f"req/s {label.replace('_stream', 's')}", justify="right")
    for label in THROUGHPUT_PHASES:
        table.add_column(f"CPU µs {label.replace('_stream', 's')}", justify="right")
    table.add_column("c1 +p50 ms", justify="right")
    table.add_column("kept-alive TTFT +p50 ms", justify="right")
    table.add_column("errors", justify="right")
    table.add_column("load", justify="right")

    def load(target: dict) -> str:
        return f"{statistics.mean(target['loadavg_1min']):.1f}"

    m = direct["median"]
    table.add_row("direct", *(_f(m[label]["rps"], "{:.0f}") for label in THROUGHPUT_PHASES), *("—",) * 4,
                  f"{m['c1']['p50_ms']:.2f} p50", f"{m['stream_keepalive']['p50_ms']:.2f} p50", str(direct["errors"]), load(direct))
    for name, target in result["stacks"].items():
        m = target["median"]
        table.add_row(name, *(_f(m[label]["rps"], "{:.0f}") for label in THROUGHPUT_PHASES),
                      *(_f(m[label]["gateway_cpu_us_per_req"], "{:.0f}") for label in THROUGHPUT_PHASES),
                      *(_f(target["added_p50_ms"][label], "{:+.2f}") for label in LATENCY_PHASES), str(target["errors"]), load(target))
    out.print("c32s / c256s: streaming; CPU µs: the relay's process tree per request; +p50: over direct measured just before")
    out.print(table)
    best = result["ranking"][0] if result["ranking"] else None
    if best:
        out.print(f"least CPU per request: {best['stack']} ({best['cpu_us_per_req']:.0f} µs mean over {', '.join(THROUGHPUT_PHASES)})")


def build_parser() -> argparse.ArgumentParser:
    parser = doc_parser(__doc__, split=False)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG_PATH,
                        help="deployment YAML whose short-prefill / long-prefill roles give the engines (default: %(default)s)")
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS), help="servers to measure (default: all)")
    parser.add_argument("--clients", nargs="+", choices=CLIENTS, default=list(CLIENTS), help="clients to measure (default: all)")
    parser.add_argument("--loops", nargs="+", choices=LOOPS, default=list(LOOPS), help="event loops to measure (default: both)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="times every target is measured, the stacks' order rotated each round; the table shows medians "
                             "(default: %(default)s)")
    parser.add_argument("--phase-s", type=float, default=1.0, help="seconds per throughput phase (default: %(default)s)")
    parser.add_argument("--latency-requests", type=int, default=100,
                        help="requests of the concurrency-1 phases (c1, stream_keepalive) (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per request, ignore_eos (default: %(default)s)")
    parser.add_argument("--max-reply-chars", type=int, default=2000, help="cap on a history's assistant turn (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the chats (default: %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="under a minute: uvloop only, 1 round, --phase-s 0.3, --latency-requests 30 (a smoke run, not a record)")
    parser.add_argument("--out", type=output_file, required=True,
                        help="result JSON; engine and relay logs go to its path without .json (for a stream such as "
                             "/dev/stdout: to a new temporary folder)")
    return parser


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.phase_s, args.latency_requests, args.loops = 1, 0.3, 30, ["uvloop"]
    if min(args.rounds, args.phase_s, args.latency_requests, args.max_tokens) <= 0:
        parser.error("--rounds, --phase-s, --latency-requests and --max-tokens must be > 0")
    claim = claim_out(parser, args.out)  # before the engines start, not after minutes of rounds
    work = work_folder(parser, args.out, claim)
    result = run_live(parser, claim, bench(args, work))
    if isinstance(result, int):
        return result
    print_table(result, bench_console(max(220, Console().width), args.out))
    return 0 if save(parser, console, args.out, result, claim) else 1


if __name__ == "__main__":
    sys.exit(main())
