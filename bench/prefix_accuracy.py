"""Prefix-hit accuracy: the gateway's estimate vs the engines' KV cache events, under eviction pressure.

Runs the same multi-turn workload twice through ``laps serve`` (the gateway and
its simulated SGLang engine processes, which publish KV cache events as SGLang
does): once with ``scheduling.kv_events: false`` (H is the estimate), once with
it on (H comes from the events). The engines' KV pools are cut to
``--kv-pool-tokens`` so that their radix caches evict, and the policy is
``cache_aware`` (each request goes where H is largest, load permitting), so H
decides routing. Per mode, over the requests that got an answer: the share
whose H (the ``x-laps-cached-tokens-est`` header: H on the engine chosen) equals
the engine's reported ``cached_tokens`` within one page (page size 1 here:
equal), mean and P99 of |H - cached_tokens|, the cache hit rate (reported
cached tokens over prompt tokens) and the P90 TTFT of short requests.

    python bench/prefix_accuracy.py --out runs/prefix_accuracy.json
    python bench/prefix_accuracy.py --quick --out runs/prefix_accuracy_quick.json   # under a minute

``--virtual`` runs both modes in virtual time instead (``laps simulate``: the
same index, fed from the engine models directly). JSON:
``{"estimate": {...}, "events": {...}, "setup": {...}}`` with ``exact_share``,
``mean_abs_error``, ``p99_abs_error``, ``cache_hit_rate``, ``short_ttft_p90_s``,
``requests`` per mode.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
from pathlib import Path

import numpy as np
import orjson
import yaml
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from laps.config import DEFAULT_CONFIG_PATH, load_config, parse_config  # noqa: E402
from laps.demo import serving  # noqa: E402
from laps.doc_help import doc_parser  # noqa: E402
from laps.tokenizer import load_tokenizer  # noqa: E402
from loadgen.runner import RequestRecord, run_loadgen  # noqa: E402
from loadgen.simulate import simulate  # noqa: E402
from loadgen.workloads import build_workload  # noqa: E402

MODES = {"estimate": False, "events": True}


def deployment(base: Path, kv_pool_tokens: int, kv_events: bool, log_dir: Path) -> dict:
    """``base``'s deployment with every role's KV pool at ``kv_pool_tokens``, policy ``cache_aware``, ``kv_events`` as given."""
    data = yaml.safe_load(base.read_text())
    data.setdefault("scheduling", {}).update(policy="cache_aware", kv_events=kv_events)
    for role in data["roles"].values():
        role.setdefault("flags", {})["max-total-tokens"] = kv_pool_tokens
    data["log_dir"] = str(log_dir)
    return data


def accuracy(records: list[RequestRecord], page_tokens: int = 1) -> dict:
    """The figures of one mode (module doc) over the answered requests that carry both H and cached_tokens."""
    done = [r for r in records if r.error is None and r.cached_tokens is not None and r.cached_tokens_est is not None]
    errors = np.array([abs(r.cached_tokens_est - r.cached_tokens) for r in done], dtype=float)
    short_ttft = [r.ttft_s for r in done if r.laps_class == "short" and r.ttft_s is not None]
    prompt = sum(r.prompt_tokens or 0 for r in done)
    return {
        "requests": len(done),
        "exact_share": float(np.mean(errors < page_tokens)) if len(done) else None,
        "mean_abs_error": float(errors.mean()) if len(done) else None,
        "p99_abs_error": float(np.percentile(errors, 99)) if len(done) else None,
        "cache_hit_rate": sum(r.cached_tokens for r in done) / prompt if prompt else None,
        "short_ttft_p90_s": float(np.percentile(short_ttft, 90)) if short_ttft else None,
    }


def run_mode(data: dict, work: Path, name: str, args: argparse.Namespace) -> list[RequestRecord]:
    config_path = work / f"{name}.yaml"
    config_path.write_text(yaml.safe_dump(data))
    config = load_config(config_path)
    tokenizer = load_tokenizer(config.model.path)
    workload = build_workload(args.dataset, random.Random(args.seed), tokenizer=tokenizer)
    if args.virtual:
        return simulate(config, workload, duration_s=args.duration, seed=args.seed, rate=args.rate, ignore_eos=True,
                        tokenizer=tokenizer)
    with serving(config_path) as url:
        return asyncio.run(run_loadgen(url, workload, duration_s=args.duration, seed=args.seed, rate=args.rate,
                                       extra_body={"ignore_eos": True}))


def main() -> int:
    parser = doc_parser(__doc__, split=False)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG_PATH, help="base deployment YAML (default: %(default)s)")
    parser.add_argument("--dataset", default="hh-rlhf", help="multi-turn workload (default: hh-rlhf)")
    parser.add_argument("--rate", type=float, default=4.0, help="conversations per second (default: 4)")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals (default: 120)")
    parser.add_argument("--kv-pool-tokens", type=int, default=8000, help="each engine's KV pool, tokens (default: 8000)")
    parser.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    parser.add_argument("--quick", action="store_true", help="15 s of arrivals (the whole run under a minute)")
    parser.add_argument("--virtual", action="store_true", help="run in virtual time (laps simulate) instead of live")
    parser.add_argument("--out", type=Path, required=True, help="where the JSON goes")
    args = parser.parse_args()
    if args.quick:
        args.duration = 15.0
    parse_config(deployment(args.config, args.kv_pool_tokens, True, Path("logs")), str(args.config))  # fail before starting
    result: dict = {"setup": {"dataset": args.dataset, "rate": args.rate, "duration_s": args.duration, "seed": args.seed,
                              "kv_pool_tokens": args.kv_pool_tokens, "policy": "cache_aware",
                              "mode": "virtual" if args.virtual else "live"}}
    with tempfile.TemporaryDirectory(prefix="prefix-accuracy-") as tmp:
        work = Path(tmp)
        for name, kv_events in MODES.items():
            records = run_mode(deployment(args.config, args.kv_pool_tokens, kv_events, work / f"logs-{name}"), work, name, args)
            result[name] = accuracy(records)

    def fmt(v: float | None, spec: str) -> str:
        return "—" if v is None else format(v, spec)

    table = Table(title=f"prefix hits, estimate vs KV events — {args.dataset}, {args.rate} conv/s, {args.duration:.0f} s, "
                        f"KV pools of {args.kv_pool_tokens} tokens, {result['setup']['mode']}")
    for col in ("mode", "requests", "H = cached", "mean |H-c|", "P99 |H-c|", "cache hit rate", "short P90 TTFT ms"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    for name in MODES:
        m = result[name]
        table.add_row(name, str(m["requests"]), fmt(m["exact_share"], ".1%"), fmt(m["mean_abs_error"], ".1f"),
                      fmt(m["p99_abs_error"], ".0f"), fmt(m["cache_hit_rate"], ".1%"),
                      fmt(None if m["short_ttft_p90_s"] is None else m["short_ttft_p90_s"] * 1e3, ".1f"))
    console = Console(width=140)
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2) + b"\n")
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
