"""Can the node sustain a workload's saturation load at all? The engines' steady-state decode capacity against it.

    python bench/decode_capacity.py --of runs/dominance28/dominance.json      # ~4 min on 2 cores

``bench/dominance.py`` sizes its points to ~3,000 arrivals, so where a workload saturates at thousands of requests
per second a point is a 1.5-s burst. If that rate is past what the engines can decode at steady state, no schedule
could serve it for long: the decode batches grow until the request slots or the KV pool fill, and the point's
violations (its knee, its goodput) say how the policies share those slots during the burst, set by the point's
length, not a rate the node could sustain. This prints, per workload of a ``dominance.py`` JSON: the mean prompt and
reply tokens of its requests (least_load at 0.2× its saturation load, seed 0, as ``dominance.py`` runs it), the
engine model's decode capacity for them (:func:`decode_capacity_rps`), the arrival rate of least_load's point at
the saturation load, and their ratio (above 1: a burst past what the engines can decode).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from dominance import point_config, point_duration_s  # noqa: E402
from engines.sim.latency import LatencyModel  # noqa: E402
from laps.tokenizer import load_tokenizer  # noqa: E402
from loadgen.simulate import simulate_run  # noqa: E402
from loadgen.workloads import build_workload  # noqa: E402

MEANS_AT_LOAD = 0.2  # the multiple of the saturation load whose requests give the mean prompt and reply


def decode_capacity_rps(latency: LatencyModel, kv_tokens: int, slots: int, prompt_tokens: float, reply_tokens: float,
                        engines: int) -> float:
    """Requests per second that ``engines`` engines can decode at steady state, each reply ``reply_tokens`` long.

    Each engine decodes its largest batch, B = min(``slots``, ⌊``kv_tokens`` / (prompt + reply)⌋) sequences (a
    request holds its prompt's and its reply's KV until it ends), of mean context prompt + reply / 2, in one
    ``latency.decode_s(B, B · context)`` pass per token, so an engine produces B / decode_s tokens per second and
    finishes that over ``reply_tokens`` requests per second (the engine model's decode throughput only grows with B).
    Prefill passes are left out, so this is an upper bound for the means given; means stand for the mix of lengths.

    Raises:
        ValueError: ``reply_tokens`` or ``engines`` not positive, or no sequence fits the KV pool.
    """
    if reply_tokens <= 0 or engines <= 0:
        raise ValueError(f"reply_tokens and engines must be > 0, got {reply_tokens} and {engines}")
    batch = min(slots, int(kv_tokens / (prompt_tokens + reply_tokens)))
    if batch < 1:
        raise ValueError(f"a request of {prompt_tokens + reply_tokens:g} tokens does not fit a {kv_tokens}-token KV pool")
    pass_s = latency.decode_s(batch, int(batch * (prompt_tokens + reply_tokens / 2)))
    return engines * batch / pass_s / reply_tokens


def workload_capacity(workload: str, saturation_load: float, pd: bool, seed: int = 0) -> dict:
    """least_load on ``workload`` at :data:`MEANS_AT_LOAD` × ``saturation_load``: its requests' mean prompt and reply
    tokens and the decode capacity of its decoding engines for them (:func:`decode_capacity_rps`)."""
    tokenizer = load_tokenizer()
    config = point_config("least_load", pd)
    load = MEANS_AT_LOAD * saturation_load
    wl = build_workload(workload, random.Random(f"workload/{seed}"), tokenizer=tokenizer)
    timing = {"time_scale": 1.0 / load} if wl.timed else {"rate": load}
    run = simulate_run(config, wl, duration_s=point_duration_s(workload, load, 10.0), seed=seed, tokenizer=tokenizer, **timing)
    done = [r for r in run.records if r.ok and r.completion_tokens]
    prompt = statistics.mean(r.prompt_tokens for r in done)
    reply = statistics.mean(r.completion_tokens for r in done)
    pools = {e.name: config.roles[e.role].pool for e in config.engines}
    decoding = [slot.core for name, slot in run.engines.items() if not pd or pools.get(name) == "decode"]
    core = decoding[0]
    capacity = decode_capacity_rps(core.latency, core.config.max_total_tokens, core.config.max_running_requests,
                                   prompt, reply, len(decoding))
    return {"prompt_tokens": prompt, "reply_tokens": reply, "decode_engines": len(decoding), "decode_capacity_rps": capacity}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--of", type=Path, required=True, metavar="JSON", help="a bench/dominance.py --out JSON")
    args = parser.parse_args(argv)
    try:
        earlier = json.loads(args.of.read_text())
        verdicts, rows = earlier["verdict"], earlier["rows"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        print(f"{parser.prog}: {args.of}: not a bench/dominance.py JSON ({err})", file=sys.stderr)
        return 2
    console = Console(width=150)
    table = Table(title=f"{args.of}: decode capacity at steady state against the saturation load's arrivals")
    for column in ("workload", "prompt", "reply", "decode engines", "decode capacity req/s", "saturation arrivals req/s", "ratio"):
        table.add_column(column, justify="left" if column == "workload" else "right")
    with console.status("simulating") as status:
        for v in verdicts:
            pd = v["workload"].endswith("(PD 6+2)")
            workload = v["workload"].split(" ")[0]
            status.update(f"simulating {v['workload']}")
            point = next((r for r in rows if r["policy"] == "least_load" and r["workload"] == workload
                          and bool(r.get("pd")) == pd and abs(r["load"] / v["saturation_load"] - 1.0) < 0.01), None)
            cap = workload_capacity(workload, v["saturation_load"], pd)
            arrivals = None if point is None else point["requests"] / point["duration_s"]
            table.add_row(v["workload"], f"{cap['prompt_tokens']:,.0f}", f"{cap['reply_tokens']:.1f}", str(cap["decode_engines"]),
                          f"{cap['decode_capacity_rps']:,.0f}", "-" if arrivals is None else f"{arrivals:,.0f}",
                          "-" if arrivals is None else f"{arrivals / cap['decode_capacity_rps']:.2f}")
    console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
