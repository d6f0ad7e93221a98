"""Reports from request records: summary statistics, SLO violations, a rich table, JSON, a TTFT plot.

Percentiles are numpy's default (linear interpolation between order
statistics). An SLO violation is any request sent that did not succeed with a
TTFT at or under the target: errors and successes without any content count as
violations; the rate is over all requests sent.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import orjson
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from rich.console import Console
from rich.table import Table

from loadgen.bench_serving import bench_serving_metrics, format_bench_serving
from loadgen.outputs import beside, is_stream, open_output
from loadgen.runner import RequestRecord

CLASSES = ("short", "long")


def summarize(values: Iterable[float]) -> dict[str, float | None]:
    """``{"mean", "p50", "p90", "p99"}`` of ``values`` (seconds); all ``None`` when empty."""
    arr = np.asarray(list(values), dtype=float)
    if arr.size == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"mean": float(arr.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def _violations(records: Sequence[RequestRecord], slo_ttft_s: float) -> int:
    return sum(not (r.ok and r.ttft_s is not None and r.ttft_s <= slo_ttft_s) for r in records)


def length_objective_s(record: RequestRecord, slo_ttft_s: float, per_1k_new_tokens_s: float) -> float:
    """The length-aware TTFT objective of ``record``: ``slo_ttft_s`` plus ``per_1k_new_tokens_s`` per 1,000 new
    prompt tokens.

    New tokens are those the gateway classified the request by at its arrival (``new_tokens_est``), as the
    scheduler's deadline counts them; without that header, the prompt minus the cached tokens its engine
    reported (a request with no usage counts gets none). The engine's report comes after the fact: a question on a
    document that another request is still prefilling there finds the document cached once it starts, and by it
    alone would be allowed nothing for the prefill it waited for.
    """
    if record.new_tokens_est is not None:
        return slo_ttft_s + per_1k_new_tokens_s * record.new_tokens_est / 1000
    new_tokens = max(0, (record.prompt_tokens or 0) - (record.cached_tokens or 0))
    return slo_ttft_s + per_1k_new_tokens_s * new_tokens / 1000


def _length_violations(records: Sequence[RequestRecord], slo_ttft_s: float, per_1k_new_tokens_s: float) -> int:
    return sum(not (r.ok and r.ttft_s is not None and r.ttft_s <= length_objective_s(r, slo_ttft_s, per_1k_new_tokens_s))
               for r in records)


def _block(records: Sequence[RequestRecord], slo_ttft_s: float, per_1k_new_tokens_s: float | None = None) -> dict:
    """Counts, latency statistics and SLO violation rates (fixed; length-aware when ``per_1k_new_tokens_s`` is set)."""
    ok = [r for r in records if r.ok]
    extra = {}
    if per_1k_new_tokens_s is not None:
        extra["length_slo_violation_rate"] = (_length_violations(records, slo_ttft_s, per_1k_new_tokens_s) / len(records)
                                              if records else None)
    return {
        "count": len(records),
        "ok": len(ok),
        "errors": len(records) - len(ok),
        "ttft_s": summarize(r.ttft_s for r in ok if r.ttft_s is not None),
        "tpot_s": summarize(r.tpot_s for r in ok if r.tpot_s is not None),
        "e2e_s": summarize(r.e2e_s for r in ok),
        "slo_violation_rate": _violations(records, slo_ttft_s) / len(records) if records else None,
        **extra,
    }


def build_report(records: Sequence[RequestRecord], *, slo_ttft_s: float, slo_ttft_per_1k_s: float | None = None,
                 meta: dict | None = None) -> dict:
    """The run's report as a JSON-ready dict.

    Keys: ``meta``'s entries (dataset, rate, seed, ...), ``requests``
    {sent, ok, errors}, ``conversations`` (distinct ids), ``duration_s``
    (run start to the last request's end), ``throughput_rps`` (successful
    requests per second of ``duration_s``), ``output_tokens_per_s``,
    ``ttft_s``/``tpot_s``/``e2e_s``/``itl_s`` statistics over successes,
    ``slo`` {ttft_s, violations, violation_rate}, ``by_class`` (``short`` and
    ``long`` always, ``unknown`` when some requests had no class header),
    ``errors_by_message`` {message: count}, ``bench_serving`` (the figures SGLang's
    bench_serving prints, under its result keys: :mod:`loadgen.bench_serving`). With ``slo_ttft_per_1k_s`` (the length-aware objective,
    :func:`length_objective_s`) also ``length_slo`` {ttft_s, per_1k_new_tokens_s, violations,
    violation_rate} and each class's ``length_slo_violation_rate``.
    """
    everything = _block(records, slo_ttft_s)
    ok = [r for r in records if r.ok]
    duration = max((r.end_s for r in records), default=0.0)
    classes = list(CLASSES) + sorted({r.laps_class for r in records} - set(CLASSES))
    return {
        **(meta or {}),
        "requests": {"sent": everything["count"], "ok": everything["ok"], "errors": everything["errors"]},
        "conversations": len({r.conversation_id for r in records}),
        "duration_s": duration,
        "throughput_rps": len(ok) / duration if duration > 0 else 0.0,
        "output_tokens_per_s": sum(r.completion_tokens or 0 for r in ok) / duration if duration > 0 else 0.0,
        "ttft_s": everything["ttft_s"],
        "tpot_s": everything["tpot_s"],
        "e2e_s": everything["e2e_s"],
        "itl_s": summarize(gap for r in ok for gap in r.itl_s),
        "slo": {
            "ttft_s": slo_ttft_s,
            "violations": _violations(records, slo_ttft_s),
            "violation_rate": everything["slo_violation_rate"],
        },
        **({} if slo_ttft_per_1k_s is None else {"length_slo": {
            "ttft_s": slo_ttft_s, "per_1k_new_tokens_s": slo_ttft_per_1k_s,
            "violations": _length_violations(records, slo_ttft_s, slo_ttft_per_1k_s),
            "violation_rate": _length_violations(records, slo_ttft_s, slo_ttft_per_1k_s) / len(records) if records else None}}),
        "by_class": {c: _block([r for r in records if r.laps_class == c], slo_ttft_s, slo_ttft_per_1k_s) for c in classes},
        "errors_by_message": dict(Counter(r.error for r in records if not r.ok).most_common()),
        "bench_serving": bench_serving_metrics(records, duration),
    }


def ms(seconds: float | None, digits: int = 1) -> str:
    """Seconds as milliseconds, ``digits`` after the point, no unit; ``None`` (nothing measured): —."""
    return "—" if seconds is None else f"{1e3 * seconds:.{digits}f}"


def arrivals_text(report: dict) -> str:
    """How the report's conversations arrived, for its summary line: `` (N conv/s, Poisson)`` or `` (N conv/s, gamma
    gaps of burstiness B)``; empty for a replayed trace (its own times) or a report without a rate."""
    rate, burstiness = report.get("rate"), report.get("burstiness")
    if rate is None:
        return ""
    return f" ({rate:.15g} conv/s, " + ("Poisson)" if burstiness in (None, 1.0) else f"gamma gaps of burstiness {burstiness:.15g})")


def print_report(report: dict, console: Console | None = None) -> None:
    """Print ``report`` (from :func:`build_report`): one column per class, one row per statistic, then the errors."""
    console = console or Console()
    overall = {
        "count": report["requests"]["sent"],
        "errors": report["requests"]["errors"],
        "slo_violation_rate": report["slo"]["violation_rate"],
        **({"length_slo_violation_rate": report["length_slo"]["violation_rate"]} if "length_slo" in report else {}),
        **{k: report[k] for k in ("ttft_s", "tpot_s", "e2e_s")},
    }
    blocks = {"all": overall, **report["by_class"]}
    command = "simulate" if report.get("mode") == "virtual" else "loadgen"
    table = Table(title=f"laps {command} — {report.get('dataset', '')}")
    table.add_column("")
    for name in blocks:
        table.add_column(name, justify="right")
    table.add_row("requests", *(str(b["count"]) for b in blocks.values()))
    table.add_row("errors", *(str(b["errors"]) for b in blocks.values()))
    for metric, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "E2E")):
        for stat in ("mean", "p50", "p90", "p99"):
            table.add_row(f"{label} {stat} (ms)", *(ms(b[metric][stat]) for b in blocks.values()))
    table.add_row(
        f"TTFT > {report['slo']['ttft_s']:g} s or failed",
        *("—" if b["slo_violation_rate"] is None else f"{b['slo_violation_rate']:.1%}" for b in blocks.values()),
    )
    if "length_slo" in report:
        per_1k = report["length_slo"]["per_1k_new_tokens_s"]
        table.add_row(
            f"TTFT > {report['slo']['ttft_s']:g} s + {per_1k:g} s/1k new tokens or failed",
            *("—" if b.get("length_slo_violation_rate") is None else f"{b['length_slo_violation_rate']:.1%}" for b in blocks.values()),
        )
    console.print(table)
    console.print(
        f"{report['requests']['ok']} ok / {report['requests']['sent']} sent in {report['duration_s']:.1f} s{arrivals_text(report)}: "
        f"{report['throughput_rps']:.2f} req/s, {report['output_tokens_per_s']:.0f} output tok/s"
    )
    rows = report.get("trace_rows")
    if rows is not None and rows["over_context"]:
        console.print(f"[yellow]{rows['over_context']} of {rows['read']} trace rows left out: prompt plus output "
                      f"tokens pass the {rows['context_tokens']}-token context[/yellow]")
    for message, count in report["errors_by_message"].items():
        console.print(f"[red]{count} × {message}[/red]")
    print_run_summary(report, console)
    console.print(format_bench_serving(report["bench_serving"], f"laps {command}",
                                       "trace" if report.get("rate") is None else report["rate"]),
                  markup=False, highlight=False, soft_wrap=True)


def print_run_summary(report: dict, console: Console) -> None:
    """Print what ``laps simulate`` adds to a report (:meth:`loadgen.virtual.VirtualRun.summary`): the scheduler's
    counters that are not 0, the controller's moves and the PD KV transfers; nothing for a report without them."""
    scheduler = report.get("scheduler")
    counted = {k: v for k, v in (scheduler or {}).items() if k != "name" and v}
    if counted:
        console.print(f"scheduler {scheduler['name']}: " + ", ".join(
            f"{k.removesuffix('_total').replace('_', ' ')} {v:,.0f}" for k, v in counted.items()), markup=False, highlight=False)
    control = report.get("controller")
    if control is not None:
        console.print(f"controller: {len(control['moves'])} moves in {control['decisions']} decisions; "
                      f"{control['drain_engine_s']:.1f} engine-s draining, {control['restart_engine_s']:.1f} engine-s restarting")
        for m in control["moves"]:
            console.print(f"  {m['start_s']:.1f} s: {m['engine']} {m['from_pool']} -> {m['to_pool']} as {m['role']} ({_move_text(m)})")
    kv = report.get("kv_transfer")
    if kv is not None:
        line = f"KV transfers: {kv['count']}, {kv['bytes'] / 1e9:.3f} GB"
        if kv["count"]:
            line += (f"; time mean {ms(kv['time_s']['mean'])} / p99 {ms(kv['time_s']['p99'])} ms; link sharing stretched "
                     f"them {kv['inflation']['mean']:.2f}x on average, {kv['inflation']['p99']:.2f}x at p99")
        console.print(line)


def _move_text(move: dict) -> str:
    """How one of :attr:`loadgen.virtual.VirtualRun.moves` went, in words."""
    if move["kind"] == "instant":
        return "instant"
    if not move["ok"]:
        return f"drain {move['drain_s']:.1f} s, then the flip was given up: still busy; it serves as before"
    how = "flipped in place" if move["kind"] == "flip" else f"restart {move['restart_s']:.1f} s"
    return (f"drain {move['drain_s']:.1f} s, {how}, back at {move['end_s']:.1f} s"
            + (f", {move['drain_failed']} requests failed by the drain timeout" if move["drain_failed"] else ""))


def plot_ttft_cdf(records: Sequence[RequestRecord], slo_ttft_s: float, path: Path, title: str = "") -> None:
    """Write a PNG of the TTFT CDF per class (successes with a TTFT; log x axis; dashed SLO line)."""
    fig = Figure(figsize=(7, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    by_class: dict[str, list[float]] = {}
    for r in records:
        if r.ok and r.ttft_s is not None:
            by_class.setdefault(r.laps_class, []).append(r.ttft_s)
    for name in sorted(by_class):
        values = np.sort(np.asarray(by_class[name]))
        ax.step(values, np.arange(1, values.size + 1) / values.size, where="post", label=f"{name} (n={values.size})")
    if not by_class:
        ax.text(0.5, 0.5, "no TTFT samples", ha="center", va="center", transform=ax.transAxes)
    ax.axvline(slo_ttft_s, color="red", linestyle="--", label=f"SLO {slo_ttft_s:g} s")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.set_title(title or "TTFT distribution per class")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    with open_output(path) as f:
        fig.savefig(f, format="png")


def plot_path(out: Path) -> Path | None:
    """Where the TTFT plot of a report written at ``out`` goes: beside it, the same stem with ``.png``; None where
    ``out`` is a stream (:func:`is_stream`: no plot beside ``/dev/stdout``).

    Raises:
        OSError: as :func:`is_stream`.
    """
    return None if is_stream(out) else beside(out, Path(out).stem + ".png")


def write_report(report: dict, records: Sequence[RequestRecord], out: Path, written: list[Path]) -> None:
    """Write the TTFT plot at :func:`plot_path`, then ``report`` as JSON at ``out``, each through :func:`open_output`,
    appending each path to ``written`` once it is written (where a write fails, ``written`` holds those before it). A
    plot that cannot be written leaves both earlier files as they were.

    Raises:
        OSError: a file or folder cannot be written.
    """
    out = Path(out)
    png = plot_path(out)
    if png is not None:
        try:
            plot_ttft_cdf(records, report["slo"]["ttft_s"], png, title=f"TTFT — {report.get('dataset', '')}")
        except OSError as err:  # matplotlib's errors name no file: this one is the plot's
            err.filename = err.filename or str(png)
            raise
        written.append(png)
    with open_output(out) as f:
        f.write(orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")
    written.append(out)


def write_trace(records: Iterable[RequestRecord], path: Path) -> None:
    """Write one JSON line per record (replayable with ``--dataset replay:PATH``) at ``path`` (:func:`open_output`).

    Raises:
        OSError: the file or a folder cannot be written.
    """
    with open_output(Path(path)) as f:
        for r in records:
            f.write(orjson.dumps(r.to_dict()) + b"\n")
