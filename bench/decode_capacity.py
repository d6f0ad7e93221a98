"""Can the node sustain a workload's saturation load at all? The engines' steady-state decode capacity against it.

    python bench/decode_capacity.py --of runs/dominance28/dominance.json      # ~2 min on 2 cores
    python bench/decode_capacity.py --workload chat-single --reply-tokens 256  # the issue's 256-token replies

``bench/dominance.py`` sizes its points to ~3,000 arrivals, so where a workload saturates at thousands of requests
per second a point is a 1.5-s burst. If that rate is past what the engines can decode at steady state, no schedule
could serve it for long: the decode batches grow until the request slots or the KV pool fill, and the point's
violations (its knee, its goodput) say how the policies share those slots during the burst, set by the point's
length, not a rate the node could sustain. With ``--of``, this prints per workload of a ``dominance.py`` JSON: the
mean prompt and reply tokens of its requests (least_load at 0.2× its saturation load, seed 0, at most 3,000 requests, points as
``dominance.py`` sizes them), the engine model's decode capacity for them (:func:`decode_capacity_rps`), the
arrival rate of least_load's point at the saturation load (requests sent over the point's seconds of arrivals),
and their ratio (above 1: a burst past what the engines can decode). With ``--workload`` and ``--reply-tokens``,
the capacity for that workload's prompts with every reply that long (least_load at ``--rate`` for the means).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from dominance import REQUESTS_PER_POINT, WORKLOADS, point_duration_s, simulate_point  # noqa: E402
from engines.sim.latency import LatencyModel  # noqa: E402
from laps.doc_help import doc_parser  # noqa: E402
from loadgen.cli import positive_float, positive_int  # noqa: E402

MEANS_AT_LOAD = 0.2  # the multiple of the saturation load whose requests give the mean prompt and reply


def decode_capacity_rps(latency: LatencyModel, kv_tokens: int, slots: int, prompt_tokens: float, reply_tokens: float,
                        engines: int) -> float:
    """Requests per second that ``engines`` engines can decode at steady state, each reply ``reply_tokens`` long.

    Each engine decodes its largest batch, B = min(``slots``, ⌊``kv_tokens`` / (prompt + reply)⌋) sequences (a
    request holds its prompt's and its reply's KV until it ends), of mean context prompt + reply / 2, in one
    ``latency.decode_s(B, B · context)`` pass per token, so an engine produces B / decode_s tokens per second and
    finishes that over ``reply_tokens`` requests per second (the engine model's decode throughput only grows with B).
    Prefill passes are left out. Where the request slots bind the batch this is an upper bound for the means given;
    where the KV pool binds it, it counts every request's whole prompt, though requests sharing a prefix share its KV,
    so it can fall short of what a prefix-heavy workload reaches. Means stand for the mix of lengths.

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


def workload_capacity(workload: str, load: float, pd: bool, seed: int = 0, reply_tokens: float | None = None) -> dict:
    """least_load on ``workload`` at ``load``: its requests' mean prompt and reply tokens (``reply_tokens`` in place
    of the measured mean if given) and the decode capacity of its decoding engines for them (:func:`decode_capacity_rps`).

    Raises:
        ValueError: no request finished at that load, the mean prompt and reply pass the engines' context or do not
            fit their KV pool (or ``build_workload``'s, for an unknown workload).
    """
    config, run = simulate_point(workload, "least_load", load, point_duration_s(workload, load, 10.0), seed, pd,
                                 max_requests=REQUESTS_PER_POINT)
    done = [r for r in run.records if r.ok and r.completion_tokens]
    if not done:
        raise ValueError(f"{workload} at load {load:g}: no request finished to take the mean lengths from")
    prompt = statistics.mean(r.prompt_tokens for r in done)
    reply = statistics.mean(r.completion_tokens for r in done) if reply_tokens is None else reply_tokens
    pools = {e.name: config.roles[e.role].pool for e in config.engines}
    decoding = [slot.core for name, slot in run.engines.items() if not pd or pools.get(name) == "decode"]
    core = decoding[0]
    if prompt + reply > core.config.context_length:
        raise ValueError(f"a mean prompt of {prompt:,.0f} tokens and {reply:,.0f}-token replies pass the engines' "
                         f"{core.config.context_length:,}-token context")
    capacity = decode_capacity_rps(core.latency, core.config.max_total_tokens, core.config.max_running_requests,
                                   prompt, reply, len(decoding))
    return {"prompt_tokens": prompt, "reply_tokens": reply, "decode_engines": len(decoding), "decode_capacity_rps": capacity}


def dominance_points(path: Path) -> list[tuple[str, str, bool, float, float | None]]:
    """``(verdict name, workload, pd, saturation_load, arrivals_rps)`` per verdict of a ``bench/dominance.py`` JSON (arrivals: least_load's
    point at the saturation load, requests over seconds of arrivals; None where the JSON has no such row).

    Raises:
        ValueError: ``path`` cannot be read or is not such a JSON (the message says what is wrong).
    """
    try:
        earlier = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: {getattr(err, 'strerror', None) or err}") from None
    if not isinstance(earlier, dict) or not isinstance(earlier.get("verdict"), list) or not isinstance(earlier.get("rows"), list):
        raise ValueError(f"{path}: not a bench/dominance.py JSON (no 'verdict' and 'rows' lists)")
    points = []
    for v in earlier["verdict"]:
        name = v.get("workload") if isinstance(v, dict) else None
        sat = v.get("saturation_load") if isinstance(v, dict) else None
        workload, pd = (name.split(" ")[0], name.endswith("(PD 6+2)")) if isinstance(name, str) else (None, False)
        if workload not in WORKLOADS or isinstance(sat, bool) or not isinstance(sat, (int, float)) or not 0 < sat < math.inf:
            raise ValueError(f"{path}: a verdict without a workload of bench/dominance.py and a positive saturation_load: {v!r}"[:300])
        row = next((r for r in earlier["rows"] if isinstance(r, dict) and r.get("policy") == "least_load"
                    and r.get("workload") == workload and bool(r.get("pd")) == pd
                    and isinstance(r.get("load"), (int, float)) and abs(r["load"] / sat - 1.0) < 0.01), None)
        try:
            arrivals = None if row is None else float(row["requests"]) / float(row["duration_s"])
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            arrivals = None
        points.append((name, workload, pd, float(sat), arrivals))
    if not points:
        raise ValueError(f"{path}: no workload in it")
    return points


def main(argv: list[str] | None = None) -> int:
    parser = doc_parser(__doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--of", type=Path, metavar="JSON", help="a bench/dominance.py --out JSON")
    source.add_argument("--workload", choices=WORKLOADS, help="one workload, with --reply-tokens")
    parser.add_argument("--reply-tokens", type=positive_int, help="with --workload: every reply this long")
    parser.add_argument("--rate", type=positive_float, default=20.0,
                        help="with --workload: the load least_load runs at for the mean prompt (default: %(default)s)")
    args = parser.parse_args(argv)
    if (args.workload is None) != (args.reply_tokens is None):
        parser.error("--workload and --reply-tokens go together")
    console = Console(width=150)
    if args.workload is not None:
        try:
            cap = workload_capacity(args.workload, args.rate, pd=False, reply_tokens=args.reply_tokens)
        except ValueError as err:
            print(f"{parser.prog}: error: {err}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print(f"{parser.prog}: interrupted", file=sys.stderr)
            return 130
        console.print(f"{args.workload}: mean prompt {cap['prompt_tokens']:,.0f} tokens, replies of {args.reply_tokens}: "
                      f"{cap['decode_engines']} engines decode at most {cap['decode_capacity_rps']:,.0f} requests/s")
        return 0
    try:
        points = dominance_points(args.of)
    except ValueError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    table = Table(title=f"{args.of}: decode capacity at steady state against the saturation load's arrivals")
    for column in ("workload", "prompt", "reply", "decode engines", "decode capacity req/s", "saturation arrivals req/s", "ratio"):
        table.add_column(column, justify="left" if column == "workload" else "right")
    try:
        with console.status("simulating") as status:
            for name, workload, pd, sat, arrivals in points:
                status.update(f"simulating {name}")
                try:
                    cap = workload_capacity(workload, MEANS_AT_LOAD * sat, pd)
                except ValueError as err:
                    table.add_row(name, "-", "-", "-", "-", "-" if arrivals is None else f"{arrivals:,.0f}", "-")
                    console.print(f"note: {err}")
                    continue
                table.add_row(name, f"{cap['prompt_tokens']:,.0f}", f"{cap['reply_tokens']:.1f}", str(cap["decode_engines"]),
                              f"{cap['decode_capacity_rps']:,.0f}", "-" if arrivals is None else f"{arrivals:,.0f}",
                              "-" if arrivals is None else f"{arrivals / cap['decode_capacity_rps']:.2f}")
    except KeyboardInterrupt:
        console.print(table)
        print(f"{parser.prog}: interrupted; the workloads above are done", file=sys.stderr)
        return 130
    console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
