"""Load generation for laps: real-text workloads, open-loop arrivals, reports, in real or virtual time.

* :mod:`loadgen.workloads` — conversations from real data sets and traces.
* :mod:`loadgen.runner` — arrivals at a rate (Poisson or bursty) or at trace times, streaming requests, per-request records.
* :mod:`loadgen.virtual` — the same load through the gateway's policies and engine models in virtual time.
* :mod:`loadgen.agreement` — live against virtual: serving latency at idle, report comparison.
* :mod:`loadgen.report` — statistics, SLO violations, rich table, JSON, TTFT plot.
* :mod:`loadgen.cli` — the ``laps loadgen`` and ``laps simulate`` flags and entry points.
"""
