"""AlignedServe decode placement vs round robin and least load, in virtual time.

Harness: E data-parallel engine models (:class:`engines.sim.core.EngineCore`, SGLang 0.5.23
defaults for the GPU) behind the gateway's own scheduler objects
(:func:`policies.registry.make_scheduler`: ``round_robin``, ``least_load``, ``aligned``),
driven as the gateway drives them (submit, decide, dispatch, first-token and completion hooks),
with engines stepped back to back. Closed loop: ``--concurrency`` clients per engine each send a
single-turn request (random token ids, so no prefix-cache hits), wait for it to finish (output
length exact: ``ignore_eos``) and send the next, until ``--requests`` have been sent. The decode
model charges the length spread of each decode batch (``--spread alignedserve``: κ = 0.112, the
calibration of :mod:`engines.sim.latency`; ``roofline``: κ = 0, to see what is left without it).

Why not :class:`loadgen.virtual.VirtualRun`: the gateway path it adds (tokenizing real text, the
prefix index, classification) changes nothing here (single turns, no shared prefixes, no
short/long pools), while cutting real text to exact lengths of up to 8,000 tokens would make the
run many times slower; the policies and the engine cores are the same objects in both.

Measured over the window in which every client is busy (from the time ``--warmup`` of the
requests, and at least the first request of every client, have been sent to the time the last
one is sent): decode tokens/s (all output tokens
but first tokens, per second, over all engines), P99 TPOT (per request, (last token − first
token) / (tokens − 1), over requests sent in the window). Workloads: ``mixNN`` = NN% short
prompts (uniform 32–999 tokens), the rest long (uniform 1,000–8,000), outputs uniform
``--output-min``..``--output-max``; ``azure-conv`` = (ContextTokens, GeneratedTokens) rows of the
Azure LLM inference trace 2023 (conversation), in trace order (arrival times not used).

The paper's claims next to ours: up to 1.98x decode throughput and up to 7.4x lower P99 TPOT.

    python bench/aligned_decode.py --out runs/aligned_decode.json
    python bench/aligned_decode.py --quick --out /tmp/aligned.json
    python bench/aligned_decode.py --spread roofline --out runs/aligned_decode_roofline.json
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import json
import random
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import Progress  # noqa: E402
from rich.table import Table  # noqa: E402

from engines.sim.args import parse_server_args, resolve_args  # noqa: E402
from engines.sim.core import EngineCore, StepResult, default_max_running_requests  # noqa: E402
from engines.sim.latency import GPUS, LLAMA2_7B, MODELS, decode_spread_fraction  # noqa: E402
from laps.config import SchedulingConfig  # noqa: E402
from laps.doc_help import doc_parser  # noqa: E402
from laps.tokenizer import load_tokenizer  # noqa: E402
from loadgen.workloads import load_azure_trace  # noqa: E402
from policies.registry import make_scheduler  # noqa: E402
from policies.types import EngineView, RequestView  # noqa: E402

POLICIES = ("round_robin", "least_load", "aligned")
BASELINE = "least_load"
PAPER = {"throughput_x": 1.98, "tpot_p99_x": 7.4}
SHORT_SHARES = (0.70, 0.80, 0.95)
Draw = Callable[[random.Random], tuple[int, int]]  # -> (prompt tokens, output tokens)


def mix_draw(short_share: float, output_min: int, output_max: int) -> Draw:
    """Prompt: short (uniform 32–999) with ``short_share``, else long (uniform 1,000–8,000); output uniform."""
    def draw(rng: random.Random) -> tuple[int, int]:
        prompt = rng.randint(32, 999) if rng.random() < short_share else rng.randint(1000, 8000)
        return prompt, rng.randint(output_min, output_max)
    return draw


def azure_draw(max_context: int) -> Draw:
    """The Azure conversation trace's (context, generated) rows in order from the first, cycled;
    contexts capped at ``max_context``. Stateful: one per run."""
    rows: Iterator = itertools.cycle(load_azure_trace())

    def draw(rng: random.Random) -> tuple[int, int]:
        row = next(rows)
        return max(1, min(row.context_tokens, max_context)), max(1, row.generated_tokens)
    return draw


def make_core_factory(model: str, gpu: str, spread: str) -> Callable[[], EngineCore]:
    """Fresh engine cores for ``model`` on ``gpu`` with SGLang's defaults; ``llama-2-7b`` (AlignedServe's
    model, MHA) reuses the Qwen2.5-7B engine settings with Llama-2-7B's shape and KV pool."""
    tokenizer = load_tokenizer()
    sim_model = model if model in MODELS else "qwen2.5-7b"
    sim = resolve_args(parse_server_args(["--model-path", sim_model, "--sim-model", sim_model, "--sim-gpu", gpu,
                                          "--sim-decode-spread", spread]))
    latency, config = sim.latency, sim.config
    if model == LLAMA2_7B.name:
        latency = dataclasses.replace(latency, model=LLAMA2_7B)
        max_total = latency.max_total_tokens(sim.mem_fraction_static)
        config = dataclasses.replace(config, max_total_tokens=max_total,
                                     max_running_requests=min(config.max_running_requests,
                                                              default_max_running_requests(max_total, config.context_length)))
    return lambda: EngineCore(config, latency, tokenizer)


def run_point(policy: str, draw: Draw, make_core: Callable[[], EngineCore], engines: int, concurrency: int,
              requests: int, warmup: float, seed: int) -> dict:
    """One closed-loop run (module doc); decode tokens/s and TPOT percentiles over the busy window."""
    rng = random.Random(f"aligned-decode/{seed}")
    token_rng = random.Random(f"tokens/{seed}")
    scheduler = make_scheduler(SchedulingConfig(policy=policy))
    cores = {f"e{i}": make_core() for i in range(engines)}
    busy = dict.fromkeys(cores, False)
    in_flight = dict.fromkeys(cores, 0)
    prompt_in_flight = dict.fromkeys(cores, 0)
    heap: list[tuple[float, int, str, StepResult]] = []
    seq = itertools.count()
    info: dict[str, list] = {}  # rid -> [sent_s, prompt, output, engine, first_s, tokens, last_s]
    sent = 0
    window: list[float | None] = [None, None]
    warm_index = max(concurrency * engines, int(warmup * requests))
    now = 0.0

    def send() -> None:
        nonlocal sent
        prompt, output = draw(rng)
        rid = f"r{sent}"
        info[rid] = [now, prompt, output, None, None, 0, None]
        scheduler.submit(RequestView(rid, prompt, arrival_s=now), now)
        sent += 1
        if sent == warm_index + 1:
            window[0] = now
        if sent == requests:
            window[1] = now

    def dispatch() -> None:
        views = [EngineView(e, "short", True, in_flight[e], prompt_in_flight[e]) for e in cores]
        decision = scheduler.decide(views, now)
        if decision.rejected:
            raise RuntimeError(f"{policy} rejected {decision.rejected}")
        for d in decision.dispatches:
            for rid in d.rids:
                rec = info[rid]
                rec[3] = d.engine_id
                in_flight[d.engine_id] += 1
                prompt_in_flight[d.engine_id] += rec[1]
                ids = [token_rng.randrange(1000, 150000) for _ in range(rec[1])]
                cores[d.engine_id].add_request(rid, ids, rec[2], ignore_eos=True, now=now)
            kick(d.engine_id)

    def kick(engine: str) -> None:
        if busy[engine] or not cores[engine].has_work():
            return
        result = cores[engine].step(now)
        if result.idle:
            if result.events:
                raise RuntimeError(f"{engine}: unexpected abort {result.events}")
            return
        busy[engine] = True
        heapq.heappush(heap, (now + result.duration_s, next(seq), engine, result))

    for _ in range(min(concurrency * engines, requests)):
        send()
    dispatch()
    decode_tokens_window = 0
    while heap:
        now, _, engine, result = heapq.heappop(heap)
        busy[engine] = False
        kick(engine)
        finished = 0
        for ev in result.events:
            rec = info[ev.rid]
            if ev.first_token:
                rec[4] = now
                scheduler.on_first_token(ev.rid, engine, now, ev.cached_tokens)
            elif window[0] is not None and (window[1] is None or now <= window[1]):
                decode_tokens_window += len(ev.new_token_ids)
            rec[5] = ev.completion_tokens
            if ev.finished:
                if ev.finish_reason == "abort":
                    raise RuntimeError(f"{ev.rid} aborted on {engine}")
                rec[6] = now
                in_flight[engine] -= 1
                prompt_in_flight[engine] -= rec[1]
                scheduler.on_complete(ev.rid, engine, now)
                finished += 1
        for _ in range(min(finished, requests - sent)):
            send()
        if finished:
            dispatch()
    start_s, end_s = window
    tpots = [(r[6] - r[4]) / (r[5] - 1) for r in info.values()
             if r[5] > 1 and start_s <= r[0] <= end_s]
    return {
        "policy": policy,
        "decode_tokens_per_s": decode_tokens_window / (end_s - start_s),
        "tpot_p50_s": float(np.percentile(tpots, 50)),
        "tpot_p99_s": float(np.percentile(tpots, 99)),
        "window_s": end_s - start_s,
        "makespan_s": now,
        "requests_in_window": len(tpots),
        "scheduler_stats": scheduler.stats(),
    }


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Decode throughput and P99 TPOT per workload, one bar per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    by = {(r["workload"], r["policy"]): r for r in rows}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / len(policies)
    x = np.arange(len(workloads))
    for i, p in enumerate(policies):
        ax1.bar(x + i * width, [by[(w, p)]["decode_tokens_per_s"] for w in workloads], width, label=p)
        ax2.bar(x + i * width, [1e3 * by[(w, p)]["tpot_p99_s"] for w in workloads], width, label=p)
    for ax, label in ((ax1, "decode tokens/s (all engines)"), (ax2, "P99 TPOT (ms)")):
        ax.set_xticks(x + width * (len(policies) - 1) / 2, workloads)
        ax.set(ylabel=label, title=f"{title}: {label}")
        ax.grid(alpha=0.3, axis="y")
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = doc_parser(__doc__)
    parser.add_argument("--out", type=Path, required=True, help="JSON output; the PNG goes next to it")
    parser.add_argument("--engines", type=int, default=4, help="decode (data-parallel) engines (default: %(default)s)")
    parser.add_argument("--concurrency", type=int, default=48, help="clients per engine (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=1500, help="requests per run (default: %(default)s)")
    parser.add_argument("--warmup", type=float, default=0.2, help="share of requests sent before the window opens (default: %(default)s)")
    parser.add_argument("--model", choices=[LLAMA2_7B.name, *MODELS], default=LLAMA2_7B.name,
                        help="cost model: AlignedServe's Llama-2-7B (MHA) or a Qwen2.5 preset (default: %(default)s)")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h100", help="sim GPU preset (default: %(default)s)")
    parser.add_argument("--spread", default="alignedserve",
                        help="decode spread κ: alignedserve, roofline or a number (default: %(default)s)")
    parser.add_argument("--output-min", type=int, default=128, help="mixes: shortest output, tokens (default: %(default)s)")
    parser.add_argument("--output-max", type=int, default=1024, help="mixes: longest output, tokens (default: %(default)s)")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES),
                        help="schedulers to run (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="request draw seed (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="600 requests, mixes 70%% and 95%% short, 2 engines")
    args = parser.parse_args(argv)
    try:
        decode_spread_fraction(args.spread)  # a bad value fails here, not in the first run
    except ValueError as err:
        parser.error(f"--spread: {err}")
    if args.quick:
        args.requests, args.engines = 600, 2
    shares = (0.70, 0.95) if args.quick else SHORT_SHARES
    max_context = 16000
    workloads: dict[str, Callable[[], Draw]] = {
        f"mix{round(100 * s)}": lambda s=s: mix_draw(s, args.output_min, args.output_max) for s in shares}
    workloads["azure-conv"] = lambda: azure_draw(max_context)  # a fresh draw per run: every policy gets the same rows
    make_core = make_core_factory(args.model, args.gpu, args.spread)
    rows: list[dict] = []
    started = time.perf_counter()
    with Progress(transient=True) as progress:
        task = progress.add_task("simulating", total=len(workloads) * len(args.policies))
        for name, make_draw in workloads.items():
            for policy in args.policies:
                row = run_point(policy, make_draw(), make_core, args.engines, args.concurrency, args.requests, args.warmup, args.seed)
                rows.append({"workload": name, **row})
                progress.advance(task)
    wall_s = time.perf_counter() - started
    base = {r["workload"]: r for r in rows if r["policy"] == BASELINE}
    table = Table(title=f"{args.engines} x {args.model} on {args.gpu}, decode spread {args.spread}, "
                        f"{args.concurrency} clients/engine, {args.requests} requests per run")
    for col in ("workload", "policy", "decode tok/s", "x least_load", "TPOT p50 ms", "TPOT p99 ms",
                "p99 x lower"):
        table.add_column(col, justify="right")
    for r in rows:
        b = base.get(r["workload"])
        r["throughput_vs_least_load"] = r["decode_tokens_per_s"] / b["decode_tokens_per_s"] if b else None
        r["tpot_p99_lower_vs_least_load"] = b["tpot_p99_s"] / r["tpot_p99_s"] if b else None
        table.add_row(r["workload"], r["policy"], f"{r['decode_tokens_per_s']:,.0f}",
                      f"{r['throughput_vs_least_load']:.3f}" if b else "-",
                      f"{1e3 * r['tpot_p50_s']:.2f}", f"{1e3 * r['tpot_p99_s']:.2f}",
                      f"{r['tpot_p99_lower_vs_least_load']:.3f}" if b else "-")
    console = Console(width=150)
    console.print(table)
    console.print(f"AlignedServe (paper): up to {PAPER['throughput_x']}x decode throughput and up to "
                    f"{PAPER['tpot_p99_x']}x lower P99 TPOT than its baselines")
    config = {"engines": args.engines, "concurrency_per_engine": args.concurrency, "requests": args.requests,
              "warmup": args.warmup, "model": args.model, "gpu": args.gpu, "spread": args.spread,
              "decode_spread_fraction": decode_spread_fraction(args.spread), "output_tokens": [args.output_min, args.output_max],
              "short_prompt_tokens": [32, 999], "long_prompt_tokens": [1000, 8000], "azure_max_context": max_context,
              "seed": args.seed, "paper": PAPER, "wall_s": wall_s}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": config, "rows": rows}, indent=1))
    plot(rows, args.out.with_suffix(".png"), f"{args.engines} x {args.model}/{args.gpu}, spread {args.spread}")
    print(f"wrote {args.out} and {args.out.with_suffix('.png')} ({wall_s:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
