"""Load generation for laps: real-text workloads, open-loop arrivals, reports.

* :mod:`loadgen.workloads` — conversations from real data sets and traces.
* :mod:`loadgen.runner` — Poisson / trace-time arrivals, streaming requests, per-request records.
* :mod:`loadgen.report` — statistics, SLO violations, rich table, JSON, TTFT plot.
* :mod:`loadgen.cli` — the ``laps loadgen`` flags and entry point.
"""
