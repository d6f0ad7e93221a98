"""The controller sizing the decode pool of a PD deployment, in virtual time: on against off, on a right and a wrong split.

    python bench/pd_decode_sizing.py --out runs/pd_decode_sizing.json --duration 10   # ~20 min on 2 busy cores
    python bench/pd_decode_sizing.py --out /tmp/pds.json --duration 5 --workloads mixed

The node of ``examples/sim-h200x8.yaml`` (8 simulated H200s, Qwen2.5-7B, its
roles and controller settings) as a PD deployment over NVLink with
``pd.role_switch``: a ``decode`` role with the node's flags, so every move
between the sides is a flip in place (``POST /pd_role_switch``, no restart),
and every move between the short and long pools instant. Splits (prefill +
decode engines): ``6+2`` (3 short, 3 long prefill) and ``7+1`` (4 short, 3
long). Controller variants:

* ``off``: ``controller.enabled`` false, the split stays as configured;
* ``pools``: the controller on without ``pd.role_switch``: it moves engines
  between the short and long prefill pools only;
* ``pd``: the controller on with ``pd.role_switch``: it also sizes the decode
  pool (:mod:`policies.pd_controller`).

Workloads (``laps simulate``'s, seed 0), Poisson conversation arrivals
(:data:`WORKLOADS`): ``mixed`` at 400/s and ``docs`` at 120/s (prefill-bound:
few output tokens), and the decode-bound ``chat-single`` at 600/s with
``ignore_eos`` (every reply its full 256 tokens), for ``--duration``
simulated seconds, TTFT SLO 0.4 s. Each row: ``{workload,
split, controller, conv_rate, rate_rps, slo_violation_rate, ttft_p90_s,
tpot_p90_s, flips, moves, final_split}`` (``flips``: moves across the sides;
``final_split``: prefill+decode engines at the end). Writes the JSON and
prints the table.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import yaml  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from laps.config import parse_config  # noqa: E402
from laps.doc_help import doc_parser  # noqa: E402
from laps.tokenizer import load_tokenizer  # noqa: E402
from loadgen.cli import positive_float, positive_int  # noqa: E402
from loadgen.report import build_report  # noqa: E402
from loadgen.simulate import simulate_run  # noqa: E402
from loadgen.workloads import build_workload  # noqa: E402

NODE = Path(__file__).resolve().parent.parent / "examples" / "sim-h200x8.yaml"
SPLITS = {"6+2": (3, 3, 2), "7+1": (4, 3, 1)}  # short prefill, long prefill, decode engines
CONTROLLERS = ("off", "pools", "pd")
WORKLOADS = {"mixed": (400.0, False), "docs": (120.0, False), "chat-single": (600.0, True)}  # conv/s, ignore_eos


def deployment(split: str, controller: str) -> dict:
    """The config data of ``split`` with the ``controller`` variant (module doc)."""
    data = yaml.safe_load(NODE.read_text())
    n_short, n_long, n_decode = SPLITS[split]
    data["roles"]["decode"] = {"pool": "decode", "flags": copy.deepcopy(data["roles"]["short-prefill"]["flags"])}
    data["pd"] = {"link": "nvlink", "role_switch": controller == "pd"}
    data["controller"].update(enabled=controller != "off", decode_role="decode")
    roles = ["short-prefill"] * n_short + ["long-prefill"] * n_long + ["decode"] * n_decode
    data["engines"] = [{"name": f"e{i}", "kind": "sim", "role": role, "gpus": [i]} for i, role in enumerate(roles)]
    return data


def point(workload_name: str, split: str, controller: str, duration_s: float, seed: int) -> dict:
    """One simulated run; its row."""
    config = parse_config(deployment(split, controller), f"pd_decode_sizing[{split} {controller}]")
    tokenizer = load_tokenizer()
    workload = build_workload(workload_name, random.Random(f"workload/{seed}"), tokenizer=tokenizer)
    conv_rate, ignore_eos = WORKLOADS[workload_name]
    run = simulate_run(config, workload, duration_s=duration_s, seed=seed, rate=conv_rate, ignore_eos=ignore_eos, tokenizer=tokenizer)
    report = build_report(run.records, slo_ttft_s=config.slo.ttft_s)
    moves = run.moves if config.controller.enabled else []
    decode = sum(state.pool == "decode" for state in run.registry)
    return {
        "workload": workload_name, "split": split, "controller": controller, "conv_rate": conv_rate,
        "rate_rps": report["throughput_rps"], "requests": report["requests"]["sent"], "errors": report["requests"]["errors"],
        "slo_violation_rate": report["slo"]["violation_rate"], "ttft_p90_s": report["ttft_s"]["p90"],
        "tpot_p90_s": report["tpot_s"]["p90"],
        "flips": sum(m["ok"] and "decode" in (m["from_pool"], m["to_pool"]) for m in moves), "moves": len(moves),
        "final_split": f"{len(config.engines) - decode}+{decode}",
        "move_log": [(m["start_s"], m["engine"], m["from_pool"], m["to_pool"], m["kind"], m["ok"]) for m in moves],
    }


def main() -> None:
    parser = doc_parser(__doc__, epilog=None, formatter_class=argparse.HelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="rows as JSON")
    parser.add_argument("--duration", type=positive_float, default=30.0, help="simulated seconds per run (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=positive_int, default=2, help="runs in parallel (default: %(default)s)")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    args = parser.parse_args()
    jobs = [(w, split, c, args.duration, args.seed) for w in args.workloads for split in SPLITS for c in CONTROLLERS]
    rows = []
    with ProcessPoolExecutor(args.workers) as pool:
        for row in pool.map(point, *zip(*jobs)):
            rows.append(row)
            print(json.dumps(row), flush=True)  # as each run ends
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"node": str(NODE.name), "duration_s": args.duration, "seed": args.seed, "rows": rows}, indent=1))
    table = Table(title=f"PD decode sizing, {args.duration:g} simulated s per run, TTFT SLO 0.4 s")
    for column in ("workload", "conv/s", "split", "controller", "req/s", "SLO viol.", "TTFT P90 ms", "TPOT P90 ms", "flips", "moves", "final"):
        table.add_column(column)
    for r in rows:
        table.add_row(r["workload"], f"{r['conv_rate']:g}", r["split"], r["controller"], f"{r['rate_rps']:.0f}",
                      f"{100 * r['slo_violation_rate']:.1f}%", f"{1e3 * r['ttft_p90_s']:.0f}", f"{1e3 * r['tpot_p90_s']:.1f}",
                      str(r["flips"]), str(r["moves"]), r["final_split"])
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
