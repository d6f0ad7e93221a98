"""Short/long prefill interference on one engine model of an H200 (Qwen2.5-32B by default), the effect LAPS is built on.

Closed loop in virtual time (engines.sim.calibration.closed_loop): C clients each
send a single-turn request, wait for its first (and only) token, and send the
next, on one engine with SGLang 0.5.23's defaults for an H200 (fcfs, chunked
prefill 8192, breakable prefill CUDA graphs). Short requests are real chat first
turns under 64 templated tokens; long ones are real text cut to Azure 2023 trace
lengths above 1,024 tokens. "alone": only that class; "mixed": each request is
long with probability --long-share. Prints the P90 TTFT per class next to the
LAPS paper's figures for short requests (Figs. 1 and 3, Qwen2.5-32B on one H200:
45/48/52 ms alone, 125/165/205 ms mixed), shown only when --model is the model
they were measured on.

    python bench/interference.py
    python bench/interference.py --model qwen2.5-7b --long-share 0.5 --out runs/interference.json
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import orjson
from rich.console import Console
from rich.table import Table

from engines.sim.args import SimServerArgs, resolve_args
from engines.sim.calibration import TTFT_ANCHORS, ClosedLoopResult, closed_loop
from engines.sim.core import EngineCore
from engines.sim.latency import MODELS
from laps.doc_help import doc_parser
from laps.tokenizer import load_tokenizer
from loadgen.cli import positive_int, share
from loadgen.workloads import short_and_long_prompts


ANCHOR_MODEL = TTFT_ANCHORS[0].model


def run(concurrencies: list[int], long_share: float, requests: int, seed: int, model: str = ANCHOR_MODEL) -> list[dict]:
    """One row per concurrency: P90 TTFT (ms) of short and long requests, alone and mixed, on the ``model``
    preset, and the published ones (None unless ``model`` is the one they were measured on)."""
    tok = load_tokenizer()
    shorts, longs = short_and_long_prompts(tok, random.Random(f"prompts/{seed}"), 1000, 300)
    sim = resolve_args(SimServerArgs(model_path=MODELS[model].hf_name, sim_model=model))

    def make_core() -> EngineCore:
        return EngineCore(sim.config, sim.latency, tok)

    def p90_ms(share: float, concurrency: int) -> tuple[float | None, float | None]:
        def draw(rng: random.Random) -> tuple[list[int], bool]:
            is_long = rng.random() < share
            return list(rng.choice(longs if is_long else shorts)), is_long

        result = closed_loop(make_core, draw, concurrency, requests, seed)
        return tuple(None if p is None else p * 1e3
                     for p in (ClosedLoopResult.p90(result.ttft_short), ClosedLoopResult.p90(result.ttft_long)))

    published = {(a.concurrency, a.mixed): a.p90_s * 1e3 for a in TTFT_ANCHORS if a.model == model}
    rows = []
    for c in concurrencies:
        short_alone, _ = p90_ms(0.0, c)
        _, long_alone = p90_ms(1.0, c)
        short_mixed, long_mixed = p90_ms(long_share, c)
        rows.append({"concurrency": c, "short_alone_ms": short_alone, "short_mixed_ms": short_mixed,
                     "long_alone_ms": long_alone, "long_mixed_ms": long_mixed,
                     "published_short_alone_ms": published.get((c, False)),
                     "published_short_mixed_ms": published.get((c, True))})
    return rows


def main() -> int:
    """Parse the flags, run, print the table (and write the JSON)."""
    parser = doc_parser(__doc__, split=False)
    parser.add_argument("--model", choices=sorted(MODELS), default=ANCHOR_MODEL,
                        help=f"simulated model (default: {ANCHOR_MODEL}, the published figures' model)")
    parser.add_argument("--concurrency", type=positive_int, nargs="+", default=[8, 16, 32], help="clients (default: 8 16 32)")
    parser.add_argument("--long-share", type=share, default=0.2, help="mixed: chance a request is long (default: 0.2)")
    parser.add_argument("--requests", type=positive_int, default=3000, help="requests per run (default: 3000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of prompts and draws (default: 0)")
    parser.add_argument("--out", type=Path, help="also write the rows as JSON")
    args = parser.parse_args()
    rows = run(args.concurrency, args.long_share, args.requests, args.seed, args.model)

    def ms(v: float | None) -> str:
        return "—" if v is None else f"{v:.1f}"

    table = Table(title=f"P90 TTFT (ms), one {MODELS[args.model].hf_name}/H200 engine model, long share {args.long_share} "
                        "when mixed")
    for col in ("C", "short alone", "published", "short mixed", "published", "long alone", "long mixed"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["concurrency"]), ms(r["short_alone_ms"]), ms(r["published_short_alone_ms"]),
                      ms(r["short_mixed_ms"]), ms(r["published_short_mixed_ms"]), ms(r["long_alone_ms"]),
                      ms(r["long_mixed_ms"]))
    console = Console(width=150)
    console.print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_bytes(orjson.dumps({"model": args.model, "long_share": args.long_share, "requests": args.requests,
                                           "rows": rows},
                                          option=orjson.OPT_INDENT_2))
        console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
