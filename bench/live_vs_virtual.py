"""The same workload through the live gateway (engine processes, real time) and through ``laps simulate``.

Starts ``laps serve --config`` (the gateway and its simulated SGLang engine
processes), measures the serving path's latency at idle
(loadgen.agreement.serving_latency: isolated short and long requests, live
TTFT minus virtual TTFT: a fixed part and a part per 1,000 new prompt tokens),
runs ``laps loadgen`` against it, then ``laps simulate`` with the same
config, workload, rate, duration and seed, once without and once with that
latency, and prints TTFT, TPOT and E2E p50/p90 of each, overall and
per class, with the difference to live. The reports and the comparison go to
--out.

    python bench/live_vs_virtual.py --out runs/live_vs_virtual.json
    python bench/live_vs_virtual.py --dataset hh-rlhf --rate 4 --duration 300 --out runs/lvv_hh.json

Replies differ between the two (the live gateway gives each request a random
id, which seeds the engine's reply), so outputs run to max_tokens
(``--ignore-eos``) unless --natural-replies is given.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import orjson
from rich.console import Console
from rich.table import Table

from laps.cli import build_parser
from laps.config import DEFAULT_CONFIG_PATH, load_config
from laps.demo import serving
from laps.doc_help import doc_parser
from laps.tokenizer import load_tokenizer
from loadgen.agreement import compare, serving_latency
from loadgen.report import ms


def run(config_path: Path, dataset: str, rate: float, duration: float, seed: int, natural: bool, work: Path) -> dict:
    """Run live, then virtual without and with the measured serving latency; the three reports and comparisons."""
    config = load_config(config_path)
    common = ["--dataset", dataset, "--rate", str(rate), "--duration", str(duration), "--seed", str(seed), "--quiet"]
    if not natural:
        common.append("--ignore-eos")
    parser = build_parser()
    with serving(config_path) as url:
        latency = asyncio.run(serving_latency(url, config, load_tokenizer(config.model.path)))
        args = parser.parse_args(["--log-level", "warning", "loadgen", "--url", url, *common, "--out", str(work / "live.json")])
        args.func(args)
    for name, fixed_s, per_1k_s in (("virtual", 0.0, 0.0), ("virtual_latency", latency.fixed_s, latency.per_1k_s)):
        args = parser.parse_args(["--log-level", "warning", "simulate", "--config", str(config_path), *common,
                                  "--serving-latency-ms", f"{fixed_s * 1e3:.3f}", "--serving-latency-per-1k-ms",
                                  f"{per_1k_s * 1e3:.3f}", "--out", str(work / f"{name}.json")])
        args.func(args)
    reports = {name: orjson.loads((work / f"{name}.json").read_bytes()) for name in ("live", "virtual", "virtual_latency")}
    return {"serving_latency_fixed_ms": latency.fixed_s * 1e3, "serving_latency_per_1k_ms": latency.per_1k_s * 1e3,
            "reports": reports,
            "comparison": compare(reports["live"], reports["virtual"]),
            "comparison_with_latency": compare(reports["live"], reports["virtual_latency"])}


def main() -> int:
    """Run live and virtual, print the comparison and write the JSON."""
    parser = doc_parser(__doc__, split=False)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG_PATH, help="deployment YAML (default: %(default)s)")
    parser.add_argument("--dataset", default="mixed", help="workload (default: mixed)")
    parser.add_argument("--rate", type=float, default=2.0, help="conversations per second (default: 2)")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals (default: 120)")
    parser.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    parser.add_argument("--natural-replies", action="store_true", help="let replies end at EOS (no --ignore-eos)")
    parser.add_argument("--out", type=Path, required=True, help="JSON with the reports and the comparisons")
    args = parser.parse_args()
    work = args.out.with_suffix("")
    work.mkdir(parents=True, exist_ok=True)
    result = run(args.config, args.dataset, args.rate, args.duration, args.seed, args.natural_replies, work)

    def pct(v: float | None) -> str:
        return "—" if v is None else f"{v:+.0f}%"

    sent = {k: r["requests"]["sent"] for k, r in result["reports"].items()}
    table = Table(title=f"live vs virtual — {args.dataset}, {args.rate} conv/s, {args.duration:.0f} s, seed {args.seed}; "
                        f"requests {sent['live']} live, {sent['virtual']} virtual; serving latency measured at idle "
                        f"{result['serving_latency_fixed_ms']:.1f} ms + {result['serving_latency_per_1k_ms']:.1f} ms per 1k new prompt tokens")
    for col in ("group", "metric", "live ms", "virtual ms", "diff", "+ serving latency", "diff"):
        table.add_column(col, justify="left" if col in ("group", "metric") else "right")
    for plain, lat in zip(result["comparison"], result["comparison_with_latency"]):
        table.add_row(plain["group"], f"{plain['metric'][:-2].upper()} {plain['stat']}", ms(plain["live_s"]),
                      ms(plain["virtual_s"]), pct(plain["diff_pct"]), ms(lat["virtual_s"]), pct(lat["diff_pct"]))
    console = Console(width=150)
    console.print(table)
    args.out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2) + b"\n")
    console.print(f"wrote {args.out} (reports in {work}/)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
