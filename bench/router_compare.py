"""The PyPI ``sglang-router`` and the laps gateway, live, in front of the same simulated SGLang engines.

Starts N simulated engine processes once (``python -m engines.sim``, command
lines from ``engines.manager``; the first --short-engines run --short-role's
flags, the rest --long-role's), then runs one after the other against those
same processes, each with the same workload, seed, rate and duration:

- ``sglang-router`` (``python -m sglang_router.launch_router``) with each of
  --router-policies (default cache_aware, round_robin);
- ``laps serve`` with the engines as ``kind: external`` (each engine's pool
  from its role) and each of --laps-policies (default laps).

Before every run the engines' prefix caches are flushed (``POST /flush_cache``)
so each run starts cold. Every run is driven by the project's load generator
(``loadgen.runner.run_loadgen``, then ``loadgen.report.build_report``).

Classes: the router sends no ``x-laps-class`` header, so in every run,
laps included, a request counts as ``short`` when its prompt (the
``usage.prompt_tokens`` the engine reports) has fewer than
--class-threshold-tokens tokens (default: the config's
``scheduling.short_threshold_tokens``), else ``long``; requests that failed
before usage arrived are ``unknown``. The laps gateway's own classification
(by uncached tokens, from its header) is kept as ``gateway_by_class``.

The model directory (tokenizer, chat template) is a tiny Qwen2 one with the
real Qwen2.5 vocabulary (``engines.tiny_model``), so neither the engines, the
gateway nor the router ever reach for the Hugging Face hub. sglang-router
is not a laps dependency: install it with ``pip install -e '.[bench]'``.

    python bench/router_compare.py --out runs/router_compare.json
    python bench/router_compare.py --engines 4 --short-engines 1 --rate 3 --duration 60 \\
        --router-policies cache_aware round_robin power_of_two --laps-policies laps pools --out runs/rc4.json

Prints one table with a column per run and writes ``{"setup": {...}, "runs":
[{"router", "policy", "wall_s", "class_attribution", ...report fields}]}`` to
--out; engine, router and gateway logs go to ``<out without .json>/logs/``.
Everything started is stopped at the end, on Ctrl-C, SIGTERM or an error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import importlib.util
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import aiohttp
import httpx
import orjson
import yaml
from rich.console import Console
from rich.table import Table

from engines.client import EngineClient
from engines.manager import EngineManager, die_with_parent, free_port
from engines.tiny_model import write_tiny_qwen2_model
from laps.config import DEFAULT_CONFIG_PATH, Config, load_config, parse_config
from laps.demo import serving
from laps.doc_help import doc_parser
from laps.tokenizer import ChatTokenizer, load_tokenizer
from loadgen.cli import share
from loadgen.report import build_report, ms
from loadgen.runner import RequestRecord, run_loadgen
from loadgen.workloads import DATASETS, DEFAULT_MAX_TOKENS, TIMED_DATASETS, build_workload

ROUTER_PACKAGE = "sglang-router"
ROUTER_VERSION = "0.3.2"
ROUTER_POLICIES = ("random", "round_robin", "cache_aware", "power_of_two")
LAPS_POLICIES = ("laps", "pools", "least_load", "round_robin", "cache_aware", "bucket")
READY_TIMEOUT_S = 120.0
FLUSH_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0

console = Console(stderr=True)


def engine_config(base: Config, model_dir: Path, engines: int, short_engines: int, short_role: str, long_role: str,
                  log_dir: Path) -> Config:
    """``base`` with ``engines`` simulated engines (``sp0..``: ``short_role``, ``lp0..``: ``long_role``) on free ports.

    Raises:
        ConfigError: a role is not defined in ``base``.
    """
    data = base.model_dump(mode="json")
    data["model"]["path"] = str(model_dir)
    data["log_dir"] = str(log_dir)
    data["engines"] = [{"name": f"sp{i}", "kind": "sim", "role": short_role} for i in range(short_engines)] + [
        {"name": f"lp{i}", "kind": "sim", "role": long_role} for i in range(engines - short_engines)
    ]
    return parse_config(data, "router_compare engines")


def laps_config(engines: Config, urls: dict[str, str], policy: str) -> dict:
    """The ``laps serve`` deployment for ``policy`` over the running ``engines`` as ``kind: external`` at ``urls``."""
    data = engines.model_dump(mode="json")
    data["scheduling"]["policy"] = policy
    data["engines"] = [{"name": e.name, "kind": "external", "role": e.role, "url": urls[e.name]} for e in engines.engines]
    return data


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to ``proc``'s process group, SIGKILL after ``STOP_TIMEOUT_S``; always reaps it."""
    for sig, wait_s in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            console.print(f"[yellow]sglang-router (pid {proc.pid}) still running {wait_s:.0f} s after SIGTERM: killing it[/yellow]")


@contextlib.contextmanager
def sglang_router(policy: str, worker_urls: Sequence[str], model_dir: Path, log_path: Path,
                  request_timeout_s: float) -> Iterator[str]:
    """``sglang_router.launch_router`` with ``policy`` over ``worker_urls`` on free loopback ports; yields its URL once
    ``/readiness`` reports every worker healthy. The router (its whole process group) is stopped on exit.

    Raises:
        RuntimeError: the router exited, or was not ready within ``READY_TIMEOUT_S`` (with its log's tail).
    """
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [
        sys.executable, "-m", "sglang_router.launch_router",
        "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *worker_urls, "--policy", policy,
        "--model-path", str(model_dir), "--tokenizer-path", str(model_dir),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        "--request-timeout-secs", str(int(request_timeout_s)),
        "--worker-startup-check-interval", "1", "--shutdown-grace-period-secs", "5", "--log-level", "warn",
    ]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as logf:
        logf.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(command)}\n".encode())
        logf.flush()
        proc = subprocess.Popen(command, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=die_with_parent)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"sglang-router exited with code {proc.returncode} during start-up:\n{_tail(log_path)}")
            with contextlib.suppress(httpx.HTTPError, ValueError):
                resp = httpx.get(f"{url}/readiness", timeout=1.0)
                if resp.status_code == 200 and resp.json().get("healthy_workers") == len(worker_urls):
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"sglang-router not ready after {READY_TIMEOUT_S:.0f} s:\n{_tail(log_path)}")
            time.sleep(0.2)
        yield url
    finally:
        _stop(proc)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


async def flush_caches(session: aiohttp.ClientSession, urls: Sequence[str]) -> None:
    """``POST /flush_cache`` on every engine, retrying while one answers non-200 (it refuses while requests run).

    Raises:
        RuntimeError: an engine did not flush within ``FLUSH_TIMEOUT_S``.
    """
    for url in urls:
        deadline = time.monotonic() + FLUSH_TIMEOUT_S
        while True:
            async with session.post(f"{url}/flush_cache", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                if resp.status == 200:
                    break
                answer = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url}/flush_cache still refused after {FLUSH_TIMEOUT_S:.0f} s ({answer})")
            await asyncio.sleep(0.5)


def attribute_classes(records: Sequence[RequestRecord], threshold: int) -> None:
    """Set each record's class from its prompt length: ``short`` below ``threshold`` tokens, else ``long``;
    ``unknown`` when the engine reported no usage (a request that failed early)."""
    for r in records:
        r.laps_class = "unknown" if r.prompt_tokens is None else ("short" if r.prompt_tokens < threshold else "long")


async def drive(url: str, args: argparse.Namespace, model: str, tokenizer: ChatTokenizer) -> list[RequestRecord]:
    """The workload of ``args`` (rebuilt from its seed, as ``laps loadgen`` builds it) against ``url``."""
    workload = await asyncio.to_thread(build_workload, args.dataset, random.Random(f"workload/{args.seed}"),
                                       tokenizer=tokenizer, default_max_tokens=args.max_tokens, long_share=args.long_share)
    return await run_loadgen(url, workload, duration_s=args.duration, seed=args.seed, rate=args.rate, model=model,
                             think_time_s=args.think_time_s, request_timeout_s=args.request_timeout_s,
                             extra_body=None if args.natural_replies else {"ignore_eos": True})


async def compare(args: argparse.Namespace, base: Config, work: Path) -> dict:
    """Start the engines, run every (router, policy) against them in turn, stop everything; the result JSON."""
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    log_dir = work / "logs"
    model_dir = work / "model"
    console.print(f"writing the tiny Qwen2.5-vocabulary model directory {model_dir}")
    await asyncio.to_thread(write_tiny_qwen2_model, model_dir)
    config = engine_config(base, model_dir, args.engines, args.short_engines, args.short_role, args.long_role, log_dir)
    threshold = args.class_threshold_tokens or config.scheduling.short_threshold_tokens
    slo_ttft_s = args.slo_ttft_s or config.slo.ttft_s
    tokenizer = await asyncio.to_thread(load_tokenizer, model_dir)
    plan = [("sglang-router", p) for p in args.router_policies] + [("laps", p) for p in args.laps_policies]
    manager = EngineManager(config, ready_timeout_s=READY_TIMEOUT_S)
    runs = []
    async with aiohttp.ClientSession() as session, EngineClient() as engine_client:
        try:
            t0 = time.monotonic()
            urls = await manager.start(engine_client)
            console.print(f"{len(urls)} engines ready in {time.monotonic() - t0:.1f} s: "
                          + ", ".join(f"{e.name} ({e.role}) {urls[e.name]}" for e in config.engines))
            for i, (router, policy) in enumerate(plan, 1):
                await flush_caches(session, list(urls.values()))
                console.print(f"run {i}/{len(plan)}: {router} {policy} — {args.dataset}, {args.rate:g} conv/s, "
                              f"{args.duration:g} s, seed {args.seed}")
                t0 = time.monotonic()
                if router == "sglang-router":
                    with sglang_router(policy, list(urls.values()), model_dir, log_dir / f"sglang-router-{policy}.log",
                                       args.request_timeout_s) as url:
                        records = await drive(url, args, config.model.name, tokenizer)
                    gateway_by_class = None
                else:
                    config_path = work / f"laps-{policy}.yaml"
                    config_path.write_text(yaml.safe_dump(laps_config(config, urls, policy), sort_keys=False))
                    with serving(config_path) as url:
                        records = await drive(url, args, config.model.name, tokenizer)
                    gateway_by_class = dict(Counter(r.laps_class for r in records))
                wall_s = time.monotonic() - t0
                attribute_classes(records, threshold)
                report = build_report(records, slo_ttft_s=slo_ttft_s, meta={
                    "router": router, "policy": policy, "wall_s": wall_s,
                    "class_attribution": f"prompt_tokens < {threshold}: short, else long",
                    "gateway_by_class": gateway_by_class,
                    "dataset": args.dataset, "rate": args.rate, "seed": args.seed, "configured_duration_s": args.duration,
                })
                console.print(f"  {report['requests']['ok']} ok, {report['requests']['errors']} errors, "
                              f"TTFT p90 {ms(report['ttft_s']['p90'])} ms; {wall_s:.1f} s with start and stop")
                runs.append(report)
        finally:
            await manager.stop()
            console.print("engines stopped")
    return {
        "setup": {
            "engines": [{"name": e.name, "role": e.role, "pool": config.pool(e)} for e in config.engines],
            "sim": {"model": config.sim.model, "gpu": config.sim.gpu},
            "sglang_router_version": importlib.metadata.version(ROUTER_PACKAGE) if args.router_policies else None,
            "dataset": args.dataset, "rate": args.rate, "duration_s": args.duration, "seed": args.seed,
            "long_share": args.long_share, "ignore_eos": not args.natural_replies, "slo_ttft_s": slo_ttft_s,
            "class_threshold_tokens": threshold,
        },
        "runs": runs,
    }


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{v:.1%}"


def print_table(result: dict) -> None:
    """One column per run: requests, throughput, TTFT p50/p90/p99 overall and per class, TPOT, ITL, SLO violations."""
    s = result["setup"]
    table = Table(title=f"sglang-router vs laps — {len(s['engines'])} simulated {s['sim']['model']} / {s['sim']['gpu']} "
                        f"engines, {s['dataset']}, {s['rate']:g} conv/s, {s['duration_s']:g} s, seed {s['seed']}; "
                        f"class: prompt < {s['class_threshold_tokens']} tokens = short")
    table.add_column("")
    runs = result["runs"]
    for r in runs:
        table.add_column(f"{r['router']}\n{r['policy']}", justify="right")

    def row(label: str, fn) -> None:
        table.add_row(label, *(fn(r) for r in runs))

    row("requests ok / errors", lambda r: f"{r['requests']['ok']} / {r['requests']['errors']}")
    row("throughput (req/s)", lambda r: f"{r['throughput_rps']:.2f}")
    row("output tok/s", lambda r: f"{r['output_tokens_per_s']:.0f}")
    for stat in ("p50", "p90", "p99"):
        row(f"TTFT {stat} (ms)", lambda r, stat=stat: ms(r["ttft_s"][stat]))
    for cls in ("short", "long"):
        row(f"{cls}: requests", lambda r, cls=cls: str(r["by_class"][cls]["count"]))
        for stat in ("p50", "p90", "p99"):
            row(f"{cls}: TTFT {stat} (ms)", lambda r, cls=cls, stat=stat: ms(r["by_class"][cls]["ttft_s"][stat]))
    row("TPOT p50 (ms)", lambda r: ms(r["tpot_s"]["p50"]))
    row("ITL p99 (ms)", lambda r: ms(r["itl_s"]["p99"]))
    row(f"SLO violations (TTFT > {s['slo_ttft_s']:g} s)", lambda r: _pct(r["slo"]["violation_rate"]))
    for cls in ("short", "long"):
        row(f"{cls}: SLO violations", lambda r, cls=cls: _pct(r["by_class"][cls]["slo_violation_rate"]))
    out = Console(width=150)
    out.print(table)
    for r in runs:
        for message, count in r["errors_by_message"].items():
            out.print(f"[red]{r['router']} {r['policy']}: {count} × {message}[/red]")


def build_parser() -> argparse.ArgumentParser:
    parser = doc_parser(__doc__, split=False)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG_PATH,
                        help="deployment YAML whose roles, model name, sim, slo and scheduling are used (default: %(default)s)")
    parser.add_argument("--engines", type=int, default=2, help="simulated engine processes (default: %(default)s)")
    parser.add_argument("--short-engines", type=int, help="how many of them run --short-role (default: half, at least 1)")
    parser.add_argument("--short-role", default="short-prefill", help="role of the short-pool engines (default: %(default)s)")
    parser.add_argument("--long-role", default="long-prefill", help="role of the long-pool engines (default: %(default)s)")
    parser.add_argument("--router-policies", nargs="*", choices=ROUTER_POLICIES, default=["cache_aware", "round_robin"],
                        help="sglang-router policies to run, in order (default: cache_aware round_robin)")
    parser.add_argument("--laps-policies", nargs="*", choices=LAPS_POLICIES, default=["laps"],
                        help="laps scheduling policies to run, in order (default: laps)")
    parser.add_argument("--dataset", default="mixed", choices=DATASETS, help="workload (default: %(default)s)")
    parser.add_argument("--rate", type=float, default=2.0, help="conversation arrivals per second (default: %(default)s)")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per run (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="workload and arrival seed (default: %(default)s)")
    parser.add_argument("--long-share", type=share, default=0.2, help="mixed: share of long requests (default: %(default)s)")
    parser.add_argument("--think-time-s", type=float, default=1.0, help="mean pause between turns (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                        help="output tokens where the data has no length (default: %(default)s)")
    parser.add_argument("--natural-replies", action="store_true",
                        help="let replies end at EOS (default: ignore_eos, so every run gets the same output lengths)")
    parser.add_argument("--slo-ttft-s", type=float, help="TTFT objective (default: the config's slo.ttft_s)")
    parser.add_argument("--class-threshold-tokens", type=int,
                        help="prompt tokens from which a request counts as long (default: scheduling.short_threshold_tokens)")
    parser.add_argument("--request-timeout-s", type=float, default=300.0, help="per-request limit (default: %(default)s)")
    parser.add_argument("--out", type=Path, required=True, help="result JSON; logs and configs go to its path without .json")
    return parser


def main() -> int:
    """Check the arguments and sglang-router, run the comparison, print the table, write the JSON."""
    parser = build_parser()
    args = parser.parse_args()
    if args.dataset in TIMED_DATASETS:
        parser.error(f"{args.dataset} replays its own arrival times; pick a Poisson dataset")
    if args.short_engines is None:
        args.short_engines = max(1, args.engines // 2)
    if not 1 <= args.short_engines <= args.engines:
        parser.error(f"--short-engines must be between 1 and --engines ({args.engines}), got {args.short_engines}")
    if not args.router_policies and not args.laps_policies:
        parser.error("nothing to run: give --router-policies or --laps-policies")
    if args.router_policies and importlib.util.find_spec("sglang_router") is None:
        print(f"router_compare: the PyPI package {ROUTER_PACKAGE} is not installed in {sys.executable}; install it with\n"
              f"  pip install -e '.[bench]'     (or: pip install {ROUTER_PACKAGE}=={ROUTER_VERSION})", file=sys.stderr)
        return 1
    base = load_config(args.config)
    for name in (args.short_role, args.long_role):
        if name not in base.roles:
            parser.error(f"role {name!r} is not defined in {args.config}; defined: {', '.join(sorted(base.roles))}")
    work = args.out.with_suffix("").resolve()
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        result = asyncio.run(compare(args, base, work))
    except (KeyboardInterrupt, asyncio.CancelledError):
        console.print("[red]interrupted: everything started was stopped[/red]")
        return 130
    except RuntimeError as err:
        console.print(f"[red]router_compare: {err}[/red]")
        return 1
    print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2) + b"\n")
    console.print(f"wrote {args.out} (logs in {work / 'logs'}); {time.monotonic() - t0:.0f} s in all")
    return 0 if all(r["requests"]["errors"] == 0 for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
