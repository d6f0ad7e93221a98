"""How far the engine model lands from every published anchor of DESIGN.md §6 (Qwen2.5-7B on one H200).

Fits the latency model's compute and memory efficiencies to the forward-pass
anchors (engines.sim.calibration.fit_latency), checks the shipped defaults are
that fit, and prints and writes one row per anchor: the forward passes priced by
the model, and the P90 TTFT anchors from the closed-loop interference runs of
bench/interference.py (long share 0.2 when mixed, 3000 requests).

    python bench/sim_calibration.py --out runs/sim_calibration.json

JSON: {"fit": {...}, "anchors": [{"name", "published_ms", "model_ms", "error_pct"}]}.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import orjson
from rich.console import Console
from rich.table import Table

from engines.sim.args import SimServerArgs, resolve_args
from engines.sim.calibration import fit_latency, pass_anchor_rows, ttft_anchor_rows
from engines.sim.core import EngineCore
from laps.tokenizer import load_tokenizer
from loadgen.workloads import short_and_long_prompts

LONG_SHARE = 0.2
REQUESTS = 3000


def main() -> int:
    """Fit, price every anchor, print the table and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--seed", type=int, default=0, help="seed of the TTFT runs (default: 0)")
    args = parser.parse_args()
    console = Console(width=150)

    sim = resolve_args(SimServerArgs())
    model = sim.latency
    fitted = fit_latency(model)
    fit = {"compute_efficiency": fitted.compute_efficiency, "memory_efficiency": fitted.memory_efficiency,
           "mfu": fitted.mfu, "mbu": fitted.mbu, "pass_overhead_ms": fitted.pass_overhead_s * 1e3,
           "defaults": {"compute_efficiency": model.compute_efficiency, "memory_efficiency": model.memory_efficiency}}
    console.print(f"fit: compute_efficiency {fitted.compute_efficiency:.3f} (mfu {fitted.mfu:.3f}), memory_efficiency "
                  f"{fitted.memory_efficiency:.3f} (mbu {fitted.mbu:.3f}), pass overhead {fitted.pass_overhead_s * 1e3:.2f} ms;"
                  f" shipped defaults {model.compute_efficiency:.3f} / {model.memory_efficiency:.3f}")

    tok = load_tokenizer()
    shorts, longs = short_and_long_prompts(tok, random.Random(f"prompts/{args.seed}"), 1000, 300)
    rows = pass_anchor_rows(model) + ttft_anchor_rows(lambda: EngineCore(sim.config, model, tok), shorts, longs,
                                                      LONG_SHARE, REQUESTS, args.seed)
    table = Table(title="engine model vs published anchors (Qwen2.5-7B, H200)")
    for col in ("anchor", "published ms", "model ms", "error"):
        table.add_column(col, justify="left" if col == "anchor" else "right")
    for r in rows:
        table.add_row(r["name"], f"{r['published_ms']:.1f}", f"{r['model_ms']:.1f}", f"{r['error_pct']:+.0f}%")
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps({"fit": fit, "anchors": rows}, option=orjson.OPT_INDENT_2) + b"\n")
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
