"""Round trip of a scheduling decision over the worker→scheduler channel, and what it means for 16 and 64 cores.

    python bench/sched_channel_rtt.py --out runs/sched_channel_rtt.json
    python bench/sched_channel_rtt.py --quick --out runs/sched_channel_rtt_quick.json
    python bench/sched_channel_rtt.py --worker-cpu-us 300 --cores 16 64 128 --out runs/scr.json

A scheduler process (``gateway/sched_channel.py``'s ``ChannelServer`` on a
Unix socket, uvloop) answers decision calls; this process (uvloop) is one
gateway worker calling it. The handler does no scheduling (it reads the
request and returns a fixed decision), so the figures are the channel's own:
msgpack encoding, framing, the socket, both event loops. A decision request
carries what a worker knows of a request: rid, prompt length, --keys prefix
block keys (64-bit ints; the scheduler owns the prefix index, so it gets the
chain), max_tokens, stream, priority, arrival time; the decision names the
engine, the class and the estimated cached tokens.

Phases:

- ``c1``: --calls calls one after the other: round trip p50 / p99 (µs);
- ``c32`` / ``c256``: that many calls in flight for --phase-s seconds:
  calls/s, round trip p50 / p99, and CPU µs per call on each side (user +
  system CPU of each process over the phase / calls; frames that arrive
  together are decoded and answered as a batch, so this falls with load);
- ``notes``: one-way notes (``first_token`` / ``complete``, what a worker
  tells after a decision) in bursts of 64, each burst followed by one call, for
  --phase-s seconds: notes/s and CPU µs per note on each side (the calls' share
  counted in, so a slight overestimate).

CPU time comes in 10 ms clock ticks: keep phases at a second or more.

Cost model (printed and in the JSON under ``"cost_model"``): --worker-cpu-us
is the gateway's whole CPU per request in one process today (HTTP,
validation, tokenization, relay and the decision: ``bench/router_overhead.py``);
split up, a worker spends that minus --decision-us plus its side of one call
and --notes-per-request notes, and the one scheduler process spends
--decision-us (``bench/decision_cost.py``) plus its side of the call and the
notes. One process alone: 10⁶ / --worker-cpu-us req/s at most. With C cores for laps, one runs the scheduler and C − 1 run workers:
req/s = min((C − 1) · 10⁶ / worker µs, 10⁶ / scheduler µs), the channel's share
from the batched phases (c256, notes: a saturated scheduler reads many frames
at once), and, as the pessimistic bound, every call and note at c1's
scheduler CPU per call. Engines' own CPU
is not in C (SGLang's scheduler processes busy-poll a core per GPU: give laps
what is left).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import orjson
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.router_overhead import process_cpu_s  # noqa: E402
from gateway.sched_channel import ChannelClient, ChannelServer, Peer  # noqa: E402
from laps.doc_help import doc_parser  # noqa: E402

DECISION = {"engine": "sp0", "class": "short", "cached_tokens": 1024, "wait_s": 0.0}
SERVER_READY_TIMEOUT_S = 30.0
NOTE_BURST = 64
console = Console(stderr=True)


def decide(message: dict, peer: Peer) -> dict | None:
    """The scheduler stub: reads the request as a real one would, answers a fixed decision; notes get None."""
    if message["op"] != "decide":
        return None
    return {**DECISION, "rid": message["rid"], "prompt_tokens": message["prompt_tokens"]}


def serve(path: str) -> None:
    """The scheduler process: serve :func:`decide` on ``path`` until SIGTERM."""
    import uvloop

    async def run() -> None:
        server = ChannelServer(path, decide)
        await server.start()
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        print("ready", flush=True)
        await stop.wait()
        await server.close()

    uvloop.run(run())


def decision_request(n: int, keys: int) -> dict:
    return {"op": "decide", "rid": f"{n:032x}", "prompt_tokens": 1500 + n % 500, "keys": [(n * 7919 + k) * 2654435761 % 2**63 for k in range(keys)],
            "max_tokens": 256, "stream": True, "priority": None, "arrival_s": 1234.5 + n * 1e-3}


async def closed_loop(client: ChannelClient, messages: list[dict], concurrency: int, server_pid: int, *,
                      duration_s: float | None = None, calls: int | None = None) -> dict:
    """``concurrency`` callers in a loop for ``duration_s`` or ``calls`` in all: calls/s, round trip, CPU per call."""
    samples: list[float] = []
    counter = itertools.count()
    cpu0, ru0, t0 = process_cpu_s(server_pid), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    end = t0 + duration_s if duration_s is not None else float("inf")

    async def caller() -> None:
        while time.perf_counter() < end:
            i = next(counter)
            if calls is not None and i >= calls:
                return
            s = time.perf_counter()
            await client.call(messages[i % len(messages)])
            samples.append(time.perf_counter() - s)

    await asyncio.gather(*(caller() for _ in range(concurrency)))
    wall_s = time.perf_counter() - t0
    cpu1, ru1 = process_cpu_s(server_pid), resource.getrusage(resource.RUSAGE_SELF)
    p50, p99 = (np.percentile(samples, [50, 99]) * 1e6).tolist()
    worker_cpu = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
    return {"calls": len(samples), "wall_s": wall_s, "calls_per_s": len(samples) / wall_s, "rtt_p50_us": p50, "rtt_p99_us": p99,
            "worker_cpu_us_per_call": worker_cpu / len(samples) * 1e6, "scheduler_cpu_us_per_call": (cpu1 - cpu0) / len(samples) * 1e6}


async def notes_phase(client: ChannelClient, duration_s: float, server_pid: int) -> dict:
    """Notes in bursts of ``NOTE_BURST`` for ``duration_s``, then one call (the channel is ordered, so every note
    was handled when it returns, and the wall time includes the scheduler's backlog)."""
    notes = [{"op": "first_token" if n % 2 else "complete", "rid": f"{n:032x}", "cached_tokens": 1024} for n in range(NOTE_BURST)]
    cpu0, ru0, t0 = process_cpu_s(server_pid), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    count = 0
    while time.perf_counter() < t0 + duration_s:
        for note in notes:
            client.note(note)
        count += len(notes)
        await asyncio.sleep(0)  # the loop writes, as a busy worker's would between requests
        await client.call(decision_request(0, 0))  # a decision now and then keeps the scheduler's backlog bounded
    await client.call(decision_request(0, 0))
    wall_s = time.perf_counter() - t0
    cpu1, ru1 = process_cpu_s(server_pid), resource.getrusage(resource.RUSAGE_SELF)
    worker_cpu = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
    return {"notes": count, "wall_s": wall_s, "notes_per_s": count / wall_s, "worker_cpu_us_per_note": worker_cpu / count * 1e6,
            "scheduler_cpu_us_per_note": (cpu1 - cpu0) / count * 1e6}


def cost_model(phases: dict, args: argparse.Namespace) -> dict:
    """req/s of a node with each of ``args.cores`` cores for laps (module doc).

    The channel's share comes from the c256 and notes phases (frames batched per read: a saturated scheduler reads
    many at once, and its cap is only reached saturated); ``scheduler_us_unbatched`` prices every call and note at
    the c1 phase's scheduler CPU per call instead, the pessimistic bound.
    """
    call, note = phases["c256"], phases["notes"]
    worker_us = args.worker_cpu_us - args.decision_us + call["worker_cpu_us_per_call"] + args.notes_per_request * note["worker_cpu_us_per_note"]
    scheduler_us = args.decision_us + call["scheduler_cpu_us_per_call"] + args.notes_per_request * note["scheduler_cpu_us_per_note"]
    unbatched_us = args.decision_us + (1 + args.notes_per_request) * phases["c1"]["scheduler_cpu_us_per_call"]
    rows = {}
    for cores in args.cores:
        workers_rps = (cores - 1) * 1e6 / worker_us
        scheduler_rps = 1e6 / scheduler_us
        rows[str(cores)] = {"workers": cores - 1, "workers_rps": workers_rps, "scheduler_rps": scheduler_rps,
                            "scheduler_rps_unbatched": 1e6 / unbatched_us, "rps": min(workers_rps, scheduler_rps),
                            "bound_by": "workers" if workers_rps < scheduler_rps else "scheduler"}
    return {"worker_us_per_request": worker_us, "scheduler_us_per_request": scheduler_us, "scheduler_us_unbatched": unbatched_us,
            "cores_where_the_scheduler_binds": 1 + worker_us / scheduler_us,
            "one_process_rps": 1e6 / args.worker_cpu_us, "by_cores": rows,
            "inputs": {"worker_cpu_us": args.worker_cpu_us, "decision_us": args.decision_us, "notes_per_request": args.notes_per_request}}


async def bench(args: argparse.Namespace, sock_path: str) -> dict:
    proc = subprocess.Popen([sys.executable, __file__, "--serve", sock_path], stdout=subprocess.PIPE, start_new_session=True)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), SERVER_READY_TIMEOUT_S)
        if line.strip() != b"ready":
            raise RuntimeError("the scheduler process did not start")
        client = await ChannelClient.connect(sock_path)
        messages = [decision_request(n, args.keys) for n in range(1024)]
        await closed_loop(client, messages, 8, proc.pid, calls=2000)  # warm-up
        phases = {"c1": await closed_loop(client, messages, 1, proc.pid, calls=args.calls)}
        for c in (32, 256):
            phases[f"c{c}"] = await closed_loop(client, messages, c, proc.pid, duration_s=args.phase_s)
        phases["notes"] = await notes_phase(client, args.phase_s, proc.pid)
        await client.close()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    frame_bytes = len(orjson.dumps(messages[0]))
    return {"setup": {"cpu_cores": os.cpu_count(), "loadavg_at_end": os.getloadavg(), "keys": args.keys, "calls": args.calls,
                      "phase_s": args.phase_s, "request_json_bytes": frame_bytes},
            "phases": phases, "cost_model": cost_model(phases, args)}


def print_result(result: dict) -> None:
    s, p, m = result["setup"], result["phases"], result["cost_model"]
    out = Console(width=max(150, Console().width))
    table = Table(title=f"scheduler channel (Unix socket, msgpack, uvloop both sides): {s['cpu_cores']} CPU cores "
                        f"(load avg {s['loadavg_at_end'][0]:.1f}), {s['keys']} block keys per request")
    for col in ("phase", "calls/s", "round trip p50 / p99 (µs)", "worker CPU µs/call", "scheduler CPU µs/call"):
        table.add_column(col, justify="right")
    for label in ("c1", "c32", "c256"):
        ph = p[label]
        table.add_row(label, f"{ph['calls_per_s']:.0f}", f"{ph['rtt_p50_us']:.0f} / {ph['rtt_p99_us']:.0f}",
                      f"{ph['worker_cpu_us_per_call']:.1f}", f"{ph['scheduler_cpu_us_per_call']:.1f}")
    n = p["notes"]
    table.add_row("notes", f"{n['notes_per_s']:.0f}", "—", f"{n['worker_cpu_us_per_note']:.1f}", f"{n['scheduler_cpu_us_per_note']:.1f}")
    out.print(table)
    model = Table(title=f"cost model: worker {m['worker_us_per_request']:.0f} µs/request, scheduler "
                        f"{m['scheduler_us_per_request']:.1f} µs/request ({m['scheduler_us_unbatched']:.0f} unbatched; decision "
                        f"{m['inputs']['decision_us']:g} µs); the scheduler binds from {m['cores_where_the_scheduler_binds']:.0f} cores; "
                        f"one process alone {m['one_process_rps']:.0f} req/s")
    for col in ("cores", "workers", "workers' req/s", "scheduler's req/s (unbatched)", "node req/s", "bound by"):
        model.add_column(col, justify="right")
    for cores, row in m["by_cores"].items():
        model.add_row(cores, str(row["workers"]), f"{row['workers_rps']:.0f}",
                      f"{row['scheduler_rps']:.0f} ({row['scheduler_rps_unbatched']:.0f})", f"{row['rps']:.0f}", row["bound_by"])
    out.print(model)


def build_parser() -> argparse.ArgumentParser:
    parser = doc_parser(__doc__, split=False)
    parser.add_argument("--keys", type=int, default=64, help="prefix block keys per decision request (default: %(default)s)")
    parser.add_argument("--calls", type=int, default=20000, help="calls of the c1 phase (default: %(default)s)")
    parser.add_argument("--phase-s", type=float, default=3.0, help="seconds of the c32, c256 and notes phases (default: %(default)s)")
    parser.add_argument("--worker-cpu-us", type=float, default=485.0,
                        help="the gateway's CPU µs per request in one process, decision included (default: %(default)s, laps's at "
                             "concurrency 32 in README, Gateway overhead)")
    parser.add_argument("--decision-us", type=float, default=23.0,
                        help="the scheduler's decision, µs per request (default: %(default)s, bench/decision_cost.py p50)")
    parser.add_argument("--notes-per-request", type=int, default=2, help="notes a worker sends per request (default: %(default)s)")
    parser.add_argument("--cores", type=int, nargs="+", default=[16, 64], help="cores for laps in the cost model (default: 16 64)")
    parser.add_argument("--quick", action="store_true", help="--calls 3000, --phase-s 1")
    parser.add_argument("--out", type=Path, help="result JSON")
    parser.add_argument("--serve", metavar="PATH", help=argparse.SUPPRESS)  # the scheduler process
    return parser


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return 0
    if args.out is None:
        parser.error("--out is required")
    if args.quick:
        args.calls, args.phase_s = 3000, 1.0
    if min(args.calls, args.phase_s, min(args.cores) - 1) <= 0 or args.keys < 0:
        parser.error("--calls and --phase-s must be > 0, --cores >= 2, --keys >= 0")
    import uvloop

    with tempfile.TemporaryDirectory() as tmp:
        result = uvloop.run(bench(args, os.path.join(tmp, "sched.sock")))
    print_result(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2) + b"\n")
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
