"""The figures SGLang's ``bench_serving`` prints, from laps' request records, under bench_serving's own names.

Source: sglang 0.5.23, ``python/sglang/benchmark/serving.py`` (``python -m
sglang.bench_serving`` imports it): ``calculate_metrics`` computes them,
``benchmark`` prints the "Serving Benchmark Result" block and writes the keys
of :data:`RESULT_KEYS` into its ``--output-file`` JSONL. Here, over the
successful requests (``ok``), with ``duration`` the report's ``duration_s``
(run start to the last request's end; bench_serving: its benchmark's wall
time):

* ``completed``: successful requests; ``total_input_tokens`` /
  ``total_output_tokens``: the sums of their usage ``prompt_tokens`` /
  ``completion_tokens`` (bench_serving counts input with its own tokenizer on
  the data set's prompts, output from the same usage field);
* ``request_throughput``, ``input_throughput``, ``output_throughput``,
  ``total_throughput``: those over ``duration``;
* TTFT, TPOT = (e2e − TTFT) / (completion_tokens − 1) for outputs of more than
  one token, ITL = the gaps between streamed content chunks, E2E latency:
  mean, median, std, P90, P95, P99 in ms (numpy's default percentiles, as
  there), and the max ITL;
* ``concurrency``: the summed E2E latency over ``duration``;
  ``max_output_tokens_per_s`` / ``max_concurrent_requests``: the busiest
  second of content chunks / of requests in flight, counted in whole seconds
  from the first successful request's start, as there.

With ``cache_report`` (bench_serving's ``--cache-report``): the successful
requests' prompt tokens, their usage ``cached_tokens`` and the hit rate in %.

bench_serving's retokenized output counts, input text/vision splits and
accept length have no counterpart here and are left out. A statistic with
no sample is None (bench_serving prints 0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from loadgen.runner import RequestRecord

_STATS = ("mean", "median", "std", "p90", "p95", "p99")
RESULT_KEYS = (
    "duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput", "input_throughput",
    "output_throughput", "total_throughput",
    *(f"{s}_e2e_latency_ms" for s in _STATS), *(f"{s}_ttft_ms" for s in _STATS), *(f"{s}_tpot_ms" for s in _STATS),
    *(f"{s}_itl_ms" for s in _STATS), "max_itl_ms", "concurrency", "max_output_tokens_per_s", "max_concurrent_requests",
    "cache_report",
)
"""The keys of :func:`bench_serving_metrics`, named and ordered as in bench_serving's result JSON (plus
``max_itl_ms``, which it prints but does not write), then ``cache_report``."""


def _stats_ms(values: Sequence[float], name: str) -> dict[str, float | None]:
    """``{mean,median,std,p90,p95,p99}_{name}_ms`` of ``values`` in seconds (None each when empty)."""
    if not values:
        return {f"{s}_{name}_ms": None for s in _STATS}
    arr = np.asarray(values, dtype=float) * 1000
    p90, p95, p99 = np.percentile(arr, [90, 95, 99])
    figures = (arr.mean(), np.median(arr), arr.std(), p90, p95, p99)
    return {f"{s}_{name}_ms": float(v) for s, v in zip(_STATS, figures)}


def _peaks(ok: Sequence[RequestRecord]) -> tuple[float, int]:
    """The most content chunks in one whole second and the most requests in flight in one, counted as bench_serving."""
    if not ok:
        return 0.0, 0
    t0 = min(r.start_s for r in ok)
    seconds = int(math.ceil(max(r.end_s for r in ok) - t0)) + 1
    chunks = np.zeros(seconds)
    in_flight = np.zeros(seconds)
    for r in ok:
        if r.ttft_s is not None:
            times = np.cumsum([r.start_s + r.ttft_s, *r.itl_s]) - t0
            buckets = times.astype(int)
            np.add.at(chunks, buckets[(buckets >= 0) & (buckets < seconds)], 1)
        first, last = int(r.start_s - t0), int(r.end_s - t0)
        in_flight[first:min(last + 1, seconds)] += 1
    return float(chunks.max()), int(in_flight.max())


def bench_serving_metrics(records: Sequence[RequestRecord], duration_s: float) -> dict[str, float | int | None]:
    """bench_serving's figures of a run (module doc), keyed by :data:`RESULT_KEYS`; throughputs 0 when ``duration_s`` is 0."""
    ok = [r for r in records if r.ok]
    total_in = sum(r.prompt_tokens or 0 for r in ok)
    total_out = sum(r.completion_tokens or 0 for r in ok)
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    itl = [gap for r in ok for gap in r.itl_s]
    cached = sum(r.cached_tokens or 0 for r in ok)

    def per_s(value: float) -> float:
        return value / duration_s if duration_s > 0 else 0.0

    peak_chunks, peak_in_flight = _peaks(ok)
    return {
        "duration": duration_s,
        "completed": len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": per_s(len(ok)),
        "input_throughput": per_s(total_in),
        "output_throughput": per_s(total_out),
        "total_throughput": per_s(total_in + total_out),
        **_stats_ms(e2e, "e2e_latency"),
        **_stats_ms([r.ttft_s for r in ok if r.ttft_s is not None], "ttft"),
        **_stats_ms([r.tpot_s for r in ok if r.tpot_s is not None], "tpot"),
        **_stats_ms(itl, "itl"),
        "max_itl_ms": max(itl) * 1000 if itl else None,
        "concurrency": per_s(sum(e2e)),
        "max_output_tokens_per_s": peak_chunks,
        "max_concurrent_requests": peak_in_flight,
        "cache_report": {
            "total_prompt_tokens": total_in,
            "total_cached_tokens": cached,
            "cache_hit_rate_pct": round(cached / total_in * 100, 2) if total_in > 0 else 0.0,
        },
    }


# (label as bench_serving prints it, key, format); None key: a section rule.
_LINES = (
    ("Successful requests:", "completed", ""),
    ("Benchmark duration (s):", "duration", ".2f"),
    ("Total input tokens:", "total_input_tokens", ""),
    ("Total generated tokens:", "total_output_tokens", ""),
    ("Request throughput (req/s):", "request_throughput", ".2f"),
    ("Input token throughput (tok/s):", "input_throughput", ".2f"),
    ("Output token throughput (tok/s):", "output_throughput", ".2f"),
    ("Peak output token throughput (tok/s):", "max_output_tokens_per_s", ".2f"),
    ("Peak concurrent requests:", "max_concurrent_requests", ""),
    ("Total token throughput (tok/s):", "total_throughput", ".2f"),
    ("Concurrency:", "concurrency", ".2f"),
    ("End-to-End Latency", None, ""),
    *((f"{label} E2E Latency (ms):", f"{s}_e2e_latency_ms", ".2f")
      for label, s in (("Mean", "mean"), ("Median", "median"), ("P90", "p90"), ("P95", "p95"), ("P99", "p99"))),
    ("Time to First Token", None, ""),
    *((f"{label} TTFT (ms):", f"{s}_ttft_ms", ".2f")
      for label, s in (("Mean", "mean"), ("Median", "median"), ("P90", "p90"), ("P95", "p95"), ("P99", "p99"))),
    ("Time per Output Token (excl. 1st token)", None, ""),
    *((f"{label} TPOT (ms):", f"{s}_tpot_ms", ".2f")
      for label, s in (("Mean", "mean"), ("Median", "median"), ("P90", "p90"), ("P95", "p95"), ("P99", "p99"))),
    ("Inter-Token Latency", None, ""),
    *((f"{label} ITL (ms):", f"{s}_itl_ms", ".2f")
      for label, s in (("Mean", "mean"), ("Median", "median"), ("P90", "p90"), ("P95", "p95"), ("P99", "p99"),
                       ("Max", "max"))),
)


def format_bench_serving(metrics: dict, backend: str, request_rate: float | str) -> str:
    """``metrics`` (from :func:`bench_serving_metrics`) as bench_serving prints them: the same labels, widths and
    rules, line for line (``request_rate``: conversations/s, or ``"trace"``; a missing figure prints ``-``)."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
             f"{'Backend:':<40} {backend:<10}",
             f"{'Traffic request rate:':<40} {request_rate!s:<10}",
             f"{'Max request concurrency:':<40} {'not set':<10}"]
    for label, key, fmt in _LINES:
        if key is None:
            lines.append("{s:{c}^{n}}".format(s=label, n=50, c="-"))
            continue
        value = metrics[key]
        lines.append(f"{label:<40} {'-' if value is None else format(value, fmt):<10}")
    cache = metrics["cache_report"]
    lines += ["{s:{c}^{n}}".format(s="Cache Hit Details", n=50, c="-"),
              f"{'Total prompt tokens:':<40} {cache['total_prompt_tokens']:<10}",
              f"{'Total cached tokens:':<40} {cache['total_cached_tokens']:<10}",
              f"{'Cache hit rate:':<40} {cache['cache_hit_rate_pct']:.1f}%",
              "=" * 50]
    return "\n".join(lines)
