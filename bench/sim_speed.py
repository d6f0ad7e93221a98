"""Speed of the virtual-time simulator: simulated seconds per wall second on the whole deployment path.

8 engines (6 short-prefill with chunked prefill 2048 and up to 256 running, 2
long-prefill with 8192 and 64; Qwen2.5-7B on H200 engine models) behind the
``laps`` policy, fed hh-rlhf multi-turn chats (2.5 turns per conversation,
1 s mean think time) at 20 conversations/s, about 50 requests/s, for 600 s.
Everything a ``laps simulate`` run does is timed: tokenizing every turn,
prefix index, classifier, scheduler, engine models, records. Target: ≥ 10.

    python bench/sim_speed.py
    python bench/sim_speed.py --duration 120 --policy round_robin
    python bench/sim_speed.py --out runs/sim_speed.json
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

from laps.config import parse_config
from laps.doc_help import doc_parser
from laps.tokenizer import load_tokenizer
from loadgen.cli import positive_float, positive_int
from loadgen.report import build_report
from loadgen.simulate import simulate
from loadgen.workloads import build_workload
from policies.registry import POLICIES

ROLES = {
    "short-prefill": {"pool": "short", "flags": {"chunked-prefill-size": 2048, "max-running-requests": 256}},
    "long-prefill": {"pool": "long", "flags": {"chunked-prefill-size": 8192, "max-running-requests": 64}},
}


def main() -> int:
    """Build the 8-engine deployment, simulate it and print the speed."""
    parser = doc_parser(__doc__, split=False)
    parser.add_argument("--duration", type=positive_float, default=600.0, help="simulated seconds of arrivals (default: 600)")
    parser.add_argument("--rate", type=positive_float, default=20.0, help="conversations per second (default: 20, ~50 req/s)")
    parser.add_argument("--engines", type=positive_int, default=8, help="engines, a quarter of them long-prefill (default: 8)")
    parser.add_argument("--policy", choices=sorted(POLICIES), default="laps", help="scheduling policy (default: laps)")
    parser.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    parser.add_argument("--out", type=Path, help="also write the figures as JSON here")
    args = parser.parse_args()
    n_long = max(1, args.engines // 4)
    config = parse_config({
        "roles": ROLES,
        "scheduling": {"policy": args.policy},
        "engines": [{"name": f"e{i}", "role": "long-prefill" if i >= args.engines - n_long else "short-prefill",
                     "gpus": [i]} for i in range(args.engines)],
    })
    tokenizer = load_tokenizer()
    start = time.perf_counter()
    workload = build_workload("hh-rlhf", random.Random(f"workload/{args.seed}"), tokenizer=tokenizer)
    records = simulate(config, workload, duration_s=args.duration, seed=args.seed, rate=args.rate, tokenizer=tokenizer)
    wall = time.perf_counter() - start
    simulated = max(r.end_s for r in records)
    report = build_report(records, slo_ttft_s=config.slo.ttft_s)
    tokens = sum(r.completion_tokens or 0 for r in records)
    print(f"{args.engines} engines, policy {args.policy}: {len(records)} requests ({len(records) / args.duration:.1f}/s), "
          f"{tokens} output tokens, TTFT p50 {report['ttft_s']['p50'] * 1e3:.1f} ms p90 {report['ttft_s']['p90'] * 1e3:.1f} ms")
    print(f"simulated {simulated:.1f} s in {wall:.1f} s of wall time: {simulated / wall:.1f} simulated s per wall s "
          f"(target >= 10)")
    if args.out is not None:
        result = {"engines": args.engines, "policy": args.policy, "rate_conv_s": args.rate, "duration_s": args.duration,
                  "seed": args.seed, "requests": len(records), "output_tokens": tokens, "simulated_s": simulated,
                  "wall_s": wall, "simulated_s_per_wall_s": simulated / wall, "target_simulated_s_per_wall_s": 10,
                  "ttft_p50_s": report["ttft_s"]["p50"], "ttft_p90_s": report["ttft_s"]["p90"]}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
