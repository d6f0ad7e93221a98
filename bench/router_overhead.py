"""What a gateway adds on top of the engines: laps vs the PyPI ``sglang-router`` (Rust) vs going direct.

    python bench/router_overhead.py --out runs/router_overhead.json            # a few minutes
    python bench/router_overhead.py --quick --out runs/router_overhead_quick.json
    python bench/router_overhead.py --targets direct laps --py-spy-laps runs/laps_profile.txt --out runs/ro.json
    python bench/router_overhead.py --targets direct laps --laps-workers 1 2 --out runs/router_overhead_workers.json

Two simulated SGLang engines (``python -m engines.sim``, one short-pool and one
long-pool role) run on loopback with ``--sim-zero-time``: forward passes take
no time, so what is left is HTTP, JSON, tokenization and scheduling. In one run,
against those same engine processes, the bench measures four targets one after
the other:

- ``direct``: the client spreads requests over the engines itself;
- ``laps``: ``laps serve`` with the engines as ``kind: external``. Policy
  --laps-policy, by default ``pools`` (length-aware placement that dispatches at
  once, so the figures are relay cost, not the ``laps`` policy's deliberate AWD
  wait of up to ``scheduling.laps.window_max_ms``). Tokenizer --laps-tokenizer,
  by default the built-in Qwen2.5 one: the model directory's ids exactly, ~6x
  faster per token than its Hugging Face tokenizer. --laps-workers 1 2 runs it
  once per ``gateway.workers`` value (``laps``, ``laps-2w``), with the CPU per
  request of each process (scheduler, workers) next to the total;
- ``router-rr`` / ``router-ca``: ``sglang-router`` with ``round_robin`` and with
  ``cache_aware``, launched as ``bench/router_compare.py`` launches it.

Per target:

- throughput: closed loops of 1, 32 and 256 concurrent clients for --phase-s
  seconds each, non-streaming chats: req/s and latency p50/p99; *added
  latency* = the target's minus direct's at the same concurrency; and
  streamed chats at 32 and 256 (``c32s``, ``c256s``; latency = TTFT);
- streaming TTFT (time to the first body bytes) at concurrency 1, on one
  kept-alive connection and on a fresh connection per request;
- large bodies: ~--big-kb KB prompts (real text; 8 distinct documents, each
  request its own question) streamed at concurrency --big-concurrency;
- gateway CPU per request: the gateway process's user+system CPU time
  (``/proc/PID/stat``) over each throughput phase divided by its requests;
  the client's own CPU share is reported too, to show whether the client was
  the bottleneck (it sends pre-serialised bodies over an aiohttp pool, uvloop).

Chats are real: hh-rlhf multi-turn conversations (each turn sent with its whole
history, assistant turns filled with real text of the recorded reply length,
capped at --max-reply-chars) and ShareGPT first turns, in conversation order;
each pass over the data gets its own system message so no cache hits across
passes. Every request asks ``max_tokens`` --max-tokens with ``ignore_eos``.
The assistant turns are not the engine's replies, so laps (which caches the
replies it relays) tokenizes each follow-up's previous assistant turn too: its
worst case.

Prints a table (with the machine's core count and load average: on a busy
machine throughput is provisional, ratios of back-to-back targets less so) and
writes to --out ``{"setup", "targets": {name: phases}, "laps_over_direct":
{"c1", "c32", "c256", "c32s", "c256s"}, "laps_over_router": {...}, "laps_over_router_by_policy":
{policy: {...}}}`` (throughput ratios; ``laps_over_router`` against the faster
router policy at each concurrency). --py-spy-laps attaches ``py-spy record``
(raw collapsed stacks) to the laps gateway during its phases (py-spy is not a
laps dependency: ``pip install py-spy``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import importlib.util
import itertools
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any
from pathlib import Path

import aiohttp
import numpy as np
import orjson
import yaml
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.dominance import Claim, bench_console, claim_out, save, stopped  # noqa: E402
from bench.router_compare import ROUTER_PACKAGE, ROUTER_VERSION, engine_config, flush_caches, laps_config, sglang_router  # noqa: E402
from engines.client import EngineClient  # noqa: E402
from engines.manager import EngineManager  # noqa: E402
from engines.tiny_model import write_tiny_qwen2_model  # noqa: E402
from laps.config import DEFAULT_CONFIG_PATH, Config, load_config, parse_config  # noqa: E402
from laps.demo import serving  # noqa: E402
from laps.doc_help import doc_parser  # noqa: E402
from laps.tokenizer import load_tokenizer  # noqa: E402
from loadgen.cli import output_file  # noqa: E402
from loadgen.outputs import is_stream  # noqa: E402
from loadgen.workloads import load_hh_rlhf, load_sharegpt, real_text_corpus  # noqa: E402

CONCURRENCIES = (1, 32, 256)
STREAM_CONCURRENCIES = (32, 256)  # streamed throughput phases c32s, c256s
THROUGHPUT_PHASES = (*(f"c{c}" for c in CONCURRENCIES), *(f"c{c}s" for c in STREAM_CONCURRENCIES))
ROUTER_TARGETS = {"router-rr": "round_robin", "router-ca": "cache_aware"}
TARGETS = ("direct", "laps", *ROUTER_TARGETS)
BIG_DOCUMENTS = 8
READY_TIMEOUT_S = 120.0
CHAT_PATH = "/v1/chat/completions"
HEADERS = {"Content-Type": "application/json"}
# Engine flags on top of the config's short-prefill / long-prefill roles: no model time, room for 256 clients
# and for ~55k-token prompts, quiet logs.
ZERO_TIME_FLAGS = {"sim-zero-time": True, "max-running-requests": 512, "context-length": 131072,
                   "max-total-tokens": 4_000_000, "log-level": "warning"}

console = Console(stderr=True)


# ---------------------------------------------------------------- workload

def chat_bodies(model: str, max_tokens: int, max_reply_chars: int, seed: int) -> Iterator[bytes]:
    """Endless pre-serialised chat requests: hh-rlhf turns with their histories and ShareGPT prompts (module doc)."""
    tokenizer = load_tokenizer()
    rng = random.Random(seed)
    filler = "\n\n".join(real_text_corpus())
    conversations = load_hh_rlhf(tokenizer) + load_sharegpt()
    rng.shuffle(conversations)
    for pass_no in itertools.count():
        for conv in conversations:
            messages = [{"role": "system", "content": f"You are a helpful assistant (session {pass_no}-{conv.id})."}]
            for turn in conv.turns:
                messages.append({"role": "user", "content": turn.content})
                yield orjson.dumps({"model": model, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True})
                start = rng.randrange(len(filler) - max_reply_chars)
                messages.append({"role": "assistant", "content": filler[start:start + min(max_reply_chars, 4 * turn.max_tokens)]})


def big_bodies(model: str, max_tokens: int, size_kb: int, seed: int) -> Iterator[bytes]:
    """Endless streaming requests of ~``size_kb`` KB: one of ``BIG_DOCUMENTS`` real-text documents plus a question."""
    rng = random.Random(seed)
    texts = real_text_corpus()
    documents = []
    for _ in range(BIG_DOCUMENTS):
        parts, size = [], 0
        while size < size_kb * 1000:
            parts.append(rng.choice(texts))
            size += len(parts[-1].encode())
        documents.append("\n\n".join(parts)[: size_kb * 1000])
    for n in itertools.count():
        content = f"{rng.choice(documents)}\n\nQuestion {n}: {rng.choice(texts)[:300]}"
        yield orjson.dumps({"model": model, "messages": [{"role": "user", "content": content}],
                            "max_tokens": max_tokens, "ignore_eos": True, "stream": True})


def streaming(body: bytes) -> bytes:
    """``body`` with ``"stream": true`` (bodies are serialised without it)."""
    return body[:-1] + b',"stream":true}'


# ---------------------------------------------------------------- measuring

@dataclass
class Phase:
    """One measured phase: requests, errors, wall time, latency (or TTFT) samples, CPU of gateway and client."""

    requests: int
    errors: int
    wall_s: float
    rps: float
    p50_ms: float | None
    p99_ms: float | None
    gateway_cpu_us_per_req: float | None
    client_cpu_share: float
    first_error: str | None = None
    process_cpu_us_per_req: dict[str, float] | None = None  # laps --workers: each process's (with its own children)


def process_cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of ``pid``, its threads and its live descendant processes (a server's worker
    processes: granian's, a tokenizer pool), from ``/proc/PID/stat``; None without a pid."""
    if pid is None:
        return None
    stats = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            stats[int(stat.parent.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))  # ppid, utime + stime
    family, grew = {pid}, True
    while grew:
        grown = family | {p for p, (ppid, _) in stats.items() if ppid in family}
        grew, family = grown != family, grown
    ticks = sum(stats[p][1] for p in family if p in stats)
    return ticks / os.sysconf("SC_CLK_TCK")


def listening_pid(port: int) -> int | None:
    """The pid of this user's process that listens on loopback TCP ``port`` (from ``/proc/net/tcp``), or None."""
    return min(listening_pids(port), default=None)


def listening_pids(port: int) -> set[int]:
    """The pids of this user's processes that listen on loopback TCP ``port`` (several with ``SO_REUSEPORT``)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{cols[9]}]")
    pids = set()
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (pid_dir / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in inodes:
                        pids.add(int(pid_dir.name))
    return pids


def laps_processes(port: int) -> tuple[int | None, dict[str, int] | None]:
    """The laps gateway listening on ``port``: its top pid and, with several workers, ``{process: pid}`` of its
    scheduler and workers (``worker-<pid>``; :mod:`gateway.workers`), else None."""
    workers = listening_pids(port)
    if len(workers) < 2:
        return min(workers, default=None), None
    supervisor = int(Path(f"/proc/{min(workers)}/stat").read_text().rsplit(")", 1)[1].split()[1])  # the workers' parent
    parts = {f"worker-{pid}": pid for pid in sorted(workers)}
    for task in Path(f"/proc/{supervisor}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if int(child) not in workers and b"spawn_main" in cmdline:  # not multiprocessing's resource tracker
                parts["scheduler"] = int(child)
    return supervisor, parts


async def _one(session: aiohttp.ClientSession, url: str, body: bytes, stream: bool) -> tuple[float, str | None]:
    """Send ``body``; seconds to the whole answer (or to the first body bytes when ``stream``), and an error or None."""
    t0 = time.perf_counter()
    try:
        async with session.post(url, data=body, headers=HEADERS) as resp:
            if stream:
                first = None
                async for _ in resp.content.iter_any():
                    first = first or time.perf_counter()
                elapsed = (first or time.perf_counter()) - t0
            else:
                await resp.read()
                elapsed = time.perf_counter() - t0
            return elapsed, None if resp.status == 200 else f"HTTP {resp.status}"
    except (aiohttp.ClientError, asyncio.TimeoutError) as err:
        return time.perf_counter() - t0, repr(err)


async def run_phase(urls: Sequence[str], bodies: Iterator[bytes], concurrency: int, *, duration_s: float | None = None,
                    requests: int | None = None, stream: bool = False, fresh_connections: bool = False,
                    gateway_pid: int | None = None, processes: dict[str, int] | None = None) -> Phase:
    """A closed loop of ``concurrency`` clients over ``urls`` (round robin) for ``duration_s`` or ``requests`` in all;
    CPU per request of ``gateway_pid`` (with its descendants) and of each of ``processes``."""
    connector = aiohttp.TCPConnector(limit=0, force_close=fresh_connections)
    timeout = aiohttp.ClientTimeout(total=300)
    samples: list[float] = []
    errors: list[str] = []
    counter = itertools.count()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        parts0 = {name: process_cpu_s(pid) for name, pid in (processes or {}).items()}
        cpu0, ru0, t0 = process_cpu_s(gateway_pid), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        end = t0 + duration_s if duration_s is not None else float("inf")

        async def client() -> None:
            while time.perf_counter() < end:
                i = next(counter)
                if requests is not None and i >= requests:
                    return
                elapsed, error = await _one(session, urls[i % len(urls)] + CHAT_PATH, next(bodies), stream)
                (errors.append(error) if error else samples.append(elapsed))

        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall_s = time.perf_counter() - t0
        cpu1, ru1 = process_cpu_s(gateway_pid), resource.getrusage(resource.RUSAGE_SELF)
        parts1 = {name: process_cpu_s(pid) for name, pid in (processes or {}).items()}
    done = len(samples) + len(errors)
    by_process = {name: (parts1[name] - parts0[name]) / done * 1e6 for name in parts0} if processes and done else None
    client_cpu = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
    p50, p99 = (np.percentile(samples, [50, 99]) * 1e3).tolist() if samples else (None, None)
    return Phase(done, len(errors), wall_s, len(samples) / wall_s, p50, p99,
                 None if cpu0 is None or not done else (cpu1 - cpu0) / done * 1e6, client_cpu / wall_s,
                 errors[0] if errors else None, by_process)


async def measure_target(name: str, urls: Sequence[str], gateway_pid: int | None, args: argparse.Namespace,
                         chats: Iterator[bytes], bigs: Iterator[bytes], progress: Progress,
                         processes: dict[str, int] | None = None) -> dict[str, Phase]:
    """All phases of one target (see the module doc); ``processes``: its processes to account CPU to one by one."""
    stream_chats = map(streaming, chats)
    plan = [(f"c{c}", dict(bodies=chats, concurrency=c, duration_s=args.phase_s)) for c in CONCURRENCIES] + [
        (f"c{c}s", dict(bodies=stream_chats, concurrency=c, duration_s=args.phase_s, stream=True)) for c in STREAM_CONCURRENCIES] + [
        ("stream_keepalive", dict(bodies=stream_chats, concurrency=1, requests=args.stream_requests, stream=True)),
        ("stream_fresh", dict(bodies=stream_chats, concurrency=1, requests=args.stream_requests, stream=True,
                              fresh_connections=True)),
        (f"big_c{args.big_concurrency}", dict(bodies=bigs, concurrency=args.big_concurrency,
                                              requests=args.big_concurrency * args.big_waves, stream=True)),
    ]
    await run_phase(urls, chats, 8, requests=100)  # warm-up: connections, caches, lazy imports
    task = progress.add_task(f"{name}", total=len(plan))
    phases = {}
    for label, kwargs in plan:
        progress.update(task, description=f"{name}: {label}")
        phases[label] = await run_phase(urls, gateway_pid=gateway_pid, processes=processes, **kwargs)
        if phases[label].errors:
            console.print(f"[red]{name} {label}: {phases[label].errors} errors, first: {phases[label].first_error}[/red]")
        progress.advance(task)
    return phases


@contextlib.contextmanager
def py_spy(pid: int | None, out: Path | None) -> Iterator[None]:
    """``py-spy record`` (raw collapsed stacks to ``out``) attached to ``pid`` while the block runs; no-op without ``out``."""
    if out is None or pid is None:
        yield
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([shutil.which("py-spy") or "py-spy", "record", "--pid", str(pid), "--format", "raw", "--rate", "250",
                             "--output", str(out), "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)


# ---------------------------------------------------------------- setup and report

def zero_time_config(base: Config, model_dir: Path, log_dir: Path) -> Config:
    """Two zero-time simulated engines (``sp0`` short pool, ``lp0`` long pool) on free ports (module doc).

    ``model.path`` is unset: engines (and laps, unless --laps-tokenizer model) use the built-in Qwen2.5
    tokenizer, whose ids equal ``model_dir``'s; only sglang-router is pointed at ``model_dir``.
    """
    data = base.model_dump(mode="json")
    for name, like in (("overhead-short", "short-prefill"), ("overhead-long", "long-prefill")):
        data["roles"][name] = {**data["roles"][like], "flags": {**data["roles"][like]["flags"], **ZERO_TIME_FLAGS}}
    config = engine_config(parse_config(data, "router_overhead"), model_dir, 2, 1, "overhead-short", "overhead-long", log_dir)
    return config.model_copy(update={"model": config.model.model_copy(update={"path": None})})


async def bench(args: argparse.Namespace, work: Path) -> dict:
    """Start the engines, measure every target against them, stop everything; the result JSON."""
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    model_dir, log_dir = work / "model", work / "logs"
    await asyncio.to_thread(write_tiny_qwen2_model, model_dir)
    config = zero_time_config(load_config(args.config), model_dir, log_dir)
    model = config.model.name
    console.print("loading the data sets ...")
    chats = chat_bodies(model, args.max_tokens, args.max_reply_chars, args.seed)
    bigs = big_bodies(model, args.max_tokens, args.big_kb, args.seed)
    await asyncio.to_thread(next, chats)  # loads the files
    manager = EngineManager(config, ready_timeout_s=READY_TIMEOUT_S)
    targets: dict[str, dict[str, Phase]] = {}
    async with aiohttp.ClientSession() as session, EngineClient() as engine_client:
        try:
            urls = await manager.start(engine_client)
            engine_urls = list(urls.values())
            with Progress(console=console, transient=False) as progress:
                for name in args.targets:
                    await flush_caches(session, engine_urls)
                    if name == "direct":
                        targets[name] = await measure_target(name, engine_urls, None, args, chats, bigs, progress)
                    elif name == "laps":
                        for workers in args.laps_workers:
                            await flush_caches(session, engine_urls)
                            config_path = work / "laps.yaml"
                            deployment = laps_config(config, urls, args.laps_policy)
                            deployment["gateway"]["workers"] = workers
                            if args.laps_tokenizer == "model":
                                deployment["model"]["path"] = str(model_dir)
                            config_path.write_text(yaml.safe_dump(deployment, sort_keys=False))
                            with serving(config_path) as url:
                                pid, processes = laps_processes(int(url.rsplit(":", 1)[1]))
                                with py_spy(pid, args.py_spy_laps):
                                    targets[laps_target(workers)] = await measure_target(laps_target(workers), [url], pid, args, chats, bigs,
                                                                                         progress, processes)
                    else:
                        with sglang_router(ROUTER_TARGETS[name], engine_urls, model_dir, log_dir / f"{name}.log", 300) as url:
                            pid = listening_pid(int(url.rsplit(":", 1)[1]))
                            targets[name] = await measure_target(name, [url], pid, args, chats, bigs, progress)
        finally:
            await manager.stop()
    result = {
        "setup": {
            "cpu_cores": os.cpu_count(), "loadavg_at_end": os.getloadavg(), "python": sys.version.split()[0],
            "sglang_router_version": importlib.metadata.version(ROUTER_PACKAGE) if any(t in ROUTER_TARGETS for t in args.targets) else None,
            "laps_policy": args.laps_policy, "laps_tokenizer": args.laps_tokenizer, "laps_workers": args.laps_workers, "phase_s": args.phase_s, "stream_requests": args.stream_requests,
            "big_kb": args.big_kb, "big_concurrency": args.big_concurrency, "big_requests": args.big_concurrency * args.big_waves,
            "max_tokens": args.max_tokens, "engines": 2, "engine_flags": ZERO_TIME_FLAGS, "seed": args.seed,
        },
        "targets": {name: {label: asdict(p) for label, p in phases.items()} for name, phases in targets.items()},
    }
    result.update(ratios(result["targets"]))
    return result


def laps_target(workers: int) -> str:
    """The result's name of the laps target with ``workers`` gateway workers: ``laps`` for one, else ``laps-<N>w``."""
    return "laps" if workers == 1 else f"laps-{workers}w"


def ratios(targets: dict[str, dict[str, dict]]) -> dict:
    """laps's throughput over direct's and over the routers' in each throughput phase, and with N workers over one
    (None where a target did not run)."""
    def rps(name: str, phase: str) -> float | None:
        return targets.get(name, {}).get(phase, {}).get("rps") or None

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else a / b

    by_policy = {policy: {phase: ratio(rps("laps", phase), rps(name, phase)) for phase in THROUGHPUT_PHASES}
                 for name, policy in ROUTER_TARGETS.items() if name in targets}
    best_router = {phase: max((rps(n, phase) for n in ROUTER_TARGETS if rps(n, phase)), default=None) for phase in THROUGHPUT_PHASES}
    return {
        "laps_over_direct": {phase: ratio(rps("laps", phase), rps("direct", phase)) for phase in THROUGHPUT_PHASES},
        "laps_over_router": {phase: ratio(rps("laps", phase), best_router[phase]) for phase in THROUGHPUT_PHASES},
        "laps_over_router_by_policy": by_policy,
        "laps_workers_over_one": {name: {phase: ratio(rps(name, phase), rps("laps", phase)) for phase in THROUGHPUT_PHASES}
                                  for name in targets if name.startswith("laps-")},
    }


def _f(v: float | None, fmt: str = "{:.2f}") -> str:
    return "—" if v is None else fmt.format(v)


def print_table(result: dict, out: Console) -> None:
    """One column per target; added latency and TTFT overhead against direct; laps's throughput ratios (on ``out``)."""
    s, targets = result["setup"], result["targets"]
    table = Table(title=f"gateway overhead: {s['cpu_cores']} CPU cores (load avg {s['loadavg_at_end'][0]:.1f}), "
                        f"2 zero-time sim engines, chats max_tokens {s['max_tokens']}, laps policy {s['laps_policy']}, "
                        f"laps tokenizer {s['laps_tokenizer']}")
    table.add_column("")
    for name in targets:
        table.add_column(name, justify="right")
    direct = targets.get("direct", {})

    def row(label: str, fn) -> None:
        table.add_row(label, *(fn(phases) for phases in targets.values()))

    def delta(phases: dict, phase: str, key: str) -> str:
        base = direct.get(phase, {}).get(key)
        v = phases.get(phase, {}).get(key)
        return "—" if base is None or v is None else f"{v - base:+.2f}"

    for c in THROUGHPUT_PHASES:  # c32s, c256s: streamed, latency = TTFT
        row(f"{c}: req/s", lambda p, c=c: _f(p[c]["rps"], "{:.0f}"))
        row(f"{c}: latency p50 / p99 (ms)", lambda p, c=c: f"{_f(p[c]['p50_ms'])} / {_f(p[c]['p99_ms'])}")
        row(f"{c}: added p50 / p99 (ms)", lambda p, c=c: f"{delta(p, c, 'p50_ms')} / {delta(p, c, 'p99_ms')}")
        row(f"{c}: gateway CPU (µs/req)", lambda p, c=c: _f(p[c]["gateway_cpu_us_per_req"], "{:.0f}"))
        row(f"{c}: client CPU share", lambda p, c=c: _f(p[c]["client_cpu_share"], "{:.0%}"))
        if any(p[c].get("process_cpu_us_per_req") for p in targets.values()):
            row(f"{c}: CPU µs/req by process", lambda p, c=c: ", ".join(
                f"{n.split('-')[0]} {v:.0f}" for n, v in (p[c].get("process_cpu_us_per_req") or {}).items()) or "—")
    for phase, label in (("stream_keepalive", "TTFT kept-alive"), ("stream_fresh", "TTFT fresh conn")):
        row(f"{label} p50 / p99 (ms)", lambda p, phase=phase: f"{_f(p[phase]['p50_ms'])} / {_f(p[phase]['p99_ms'])}")
        row(f"{label} overhead p50 (ms)", lambda p, phase=phase: delta(p, phase, "p50_ms"))
    big = f"big_c{s['big_concurrency']}"
    row(f"{s['big_kb']} KB c{s['big_concurrency']}: TTFT p50 / p99 (ms)",
        lambda p: f"{_f(p[big]['p50_ms'], '{:.0f}')} / {_f(p[big]['p99_ms'], '{:.0f}')}")
    row(f"{s['big_kb']} KB: TTFT p50 vs direct",
        lambda p: "—" if not direct.get(big, {}).get("p50_ms") or p[big]["p50_ms"] is None else f"{p[big]['p50_ms'] / direct[big]['p50_ms']:.2f}×")
    row("errors", lambda p: str(sum(ph["errors"] for ph in p.values())))
    out.print(table)
    for key in ("laps_over_direct", "laps_over_router"):
        out.print(f"{key}: " + ", ".join(f"{c} {_f(v)}×" for c, v in result[key].items()))
    for name, by_c in result["laps_workers_over_one"].items():
        out.print(f"{name} over laps (1 worker): " + ", ".join(f"{c} {_f(v)}×" for c, v in by_c.items()))


def plot(result: dict, path: Path) -> None:
    """Two panels: req/s per target at each concurrency, and gateway CPU per request."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = result["targets"]
    fig, (ax_rps, ax_cpu) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(len(targets), 1)
    for i, (name, phases) in enumerate(targets.items()):
        xs = [k + i * width for k in range(len(THROUGHPUT_PHASES))]
        ax_rps.bar(xs, [phases[c]["rps"] for c in THROUGHPUT_PHASES], width, label=name)
        ax_cpu.bar(xs, [phases[c]["gateway_cpu_us_per_req"] or 0 for c in THROUGHPUT_PHASES], width, label=name)
    for ax, label in ((ax_rps, "requests / s"), (ax_cpu, "gateway CPU µs / request")):
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(THROUGHPUT_PHASES))], list(THROUGHPUT_PHASES))
        ax.set_ylabel(label)
    ax_rps.legend()
    s = result["setup"]
    fig.suptitle(f"gateway overhead, {s['cpu_cores']} CPU cores (load avg {s['loadavg_at_end'][0]:.1f}), zero-time sim engines")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    parser = doc_parser(__doc__, split=False)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG_PATH,
                        help="deployment YAML whose short-prefill / long-prefill roles and scheduling are used (default: %(default)s)")
    parser.add_argument("--targets", nargs="+", choices=TARGETS, default=list(TARGETS), help="what to measure, in order (default: all)")
    parser.add_argument("--laps-policy", default="pools",
                        help="laps scheduling.policy (default: %(default)s, which dispatches at once; 'laps' holds short "
                             "prefills up to its AWD window, window_max_ms, on purpose)")
    parser.add_argument("--laps-workers", type=int, nargs="+", default=[1], metavar="N",
                        help="gateway.workers of the laps target, one run each (e.g. 1 2; N > 1 is named laps-<N>w; default: 1)")
    parser.add_argument("--laps-tokenizer", choices=("builtin", "model"), default="builtin",
                        help="laps's tokenizer: the built-in Qwen2.5 one, or the model directory's HF tokenizer (default: %(default)s)")
    parser.add_argument("--phase-s", type=float, default=8.0, help="seconds per throughput phase (default: %(default)s)")
    parser.add_argument("--stream-requests", type=int, default=200, help="requests per TTFT phase (default: %(default)s)")
    parser.add_argument("--big-kb", type=int, default=220, help="size of the large prompts in KB (default: %(default)s)")
    parser.add_argument("--big-concurrency", type=int, default=150, help="concurrency of the large prompts (default: %(default)s)")
    parser.add_argument("--big-waves", type=int, default=2, help="large requests per client (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per request, ignore_eos (default: %(default)s)")
    parser.add_argument("--max-reply-chars", type=int, default=2000, help="cap on a history's assistant turn (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the chat and large prompts (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="short phases: --phase-s 3, --stream-requests 60, --big-waves 1")
    parser.add_argument("--py-spy-laps", type=Path, help="record a py-spy profile (raw collapsed stacks) of the laps gateway here")
    parser.add_argument("--out", type=output_file, required=True,
                        help="result JSON, and a plot next to it (.png); engine and router logs go to its path without .json "
                             "(for a stream such as /dev/stdout: no plot, the logs in a new temporary folder)")
    return parser


def work_folder(parser: argparse.ArgumentParser, out: Path, claim: Claim) -> Path:
    """Where the tiny model and the logs (engines, gateway or relays) go, made now (before any run): ``out``'s path without its
    suffix, or a new temporary folder where ``out`` is a stream (``/dev/stdout``; named on standard error).

    Raises:
        SystemExit: through ``parser.error`` (exit 2) where ``out`` has no suffix (the folder would be ``out`` itself)
            or the folder cannot be made; what :func:`~bench.dominance.claim_out` made is taken back first.
    """
    if is_stream(out):
        work = Path(tempfile.mkdtemp(prefix=f"{Path(parser.prog).stem}-"))
        console.print(f"logs in {work}")
        return work
    if not out.suffix:
        claim.release()
        parser.error(f"--out {out}: needs a suffix (.json), as the logs go to its path without it")
    work = out.with_suffix("").resolve()
    try:
        work.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        claim.release()
        parser.error(f"--out {out}: its log folder {work} cannot be made ({err.strerror or err})")
    return work


def run_live(parser: argparse.ArgumentParser, claim: Claim, run: Coroutine[Any, Any, dict]) -> dict | int:
    """A live bench's ``run`` under uvloop: its result, or the exit code where it failed (1: a ``RuntimeError``, said in
    one red line) or was stopped (130 on Ctrl-C or SIGTERM, :func:`~bench.dominance.stopped`); what
    :func:`~bench.dominance.claim_out` made is taken back then."""
    import uvloop

    try:
        return uvloop.run(run)
    except BaseException as err:
        if isinstance(err, RuntimeError):
            claim.release()
            console.print(f"[red]{Path(parser.prog).stem}: {err}[/red]")
            return 1
        return stopped(parser, claim, KeyboardInterrupt() if isinstance(err, asyncio.CancelledError) else err)


def main() -> int:
    """Check the arguments, sglang-router and --out, run the bench, print the table, write the JSON."""
    parser = build_parser()
    args = parser.parse_args()
    if args.quick:
        args.phase_s, args.stream_requests, args.big_waves = 3.0, 60, 1
    if min(args.phase_s, args.stream_requests, args.big_kb, args.big_concurrency, args.big_waves, args.max_tokens) <= 0:
        parser.error("--phase-s, --stream-requests, --big-kb, --big-concurrency, --big-waves and --max-tokens must be > 0")
    if any(t in ROUTER_TARGETS for t in args.targets) and importlib.util.find_spec("sglang_router") is None:
        print(f"router_overhead: the PyPI package {ROUTER_PACKAGE} is not installed in {sys.executable}; install it with\n"
              f"  pip install -e '.[bench]'     (or: pip install {ROUTER_PACKAGE}=={ROUTER_VERSION})", file=sys.stderr)
        return 1
    if args.py_spy_laps and shutil.which("py-spy") is None:
        parser.error("--py-spy-laps needs py-spy on PATH (pip install py-spy)")
    png = args.out.with_suffix(".png")
    claim = claim_out(parser, args.out, [png])  # before the engines start, not after minutes of phases
    work = work_folder(parser, args.out, claim)
    result = run_live(parser, claim, bench(args, work))
    if isinstance(result, int):
        return result
    print_table(result, bench_console(max(150, Console().width), args.out))
    if not save(parser, console, args.out, result, claim):
        return 1
    if not is_stream(args.out):
        plot(result, png)
        console.print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
