"""``laps simulate`` in one call: plan the arrivals, run the deployment in virtual time, hand back the run.

A deployment with a ``pd:`` section runs as a :class:`~loadgen.virtual_pd.VirtualPDRun`, any other as a
:class:`~loadgen.virtual.VirtualRun`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from engines.sim.core import StepResult
from laps.config import Config
from laps.tokenizer import ChatTokenizer, load_tokenizer
from loadgen.runner import RequestRecord, plan_arrivals
from loadgen.virtual import VirtualRun
from loadgen.virtual_pd import VirtualPDRun
from loadgen.workloads import Workload


def simulate(config: Config, workload: Workload, **kwargs: Any) -> list[RequestRecord]:
    """Run ``workload`` against ``config``'s deployment in virtual time; one record per request sent.

    As :func:`simulate_run`, whose keyword arguments it takes (and whose run also gives the
    :meth:`~loadgen.virtual.VirtualRun.summary`), returning only the records.
    """
    return simulate_run(config, workload, **kwargs).records


def simulate_run(config: Config, workload: Workload, *, duration_s: float, seed: int, rate: float | None = None,
                 burstiness: float = 1.0, time_scale: float = 1.0, think_time_s: float = 1.0, think_dist: str = "exp",
                 request_timeout_s: float = 300.0, ignore_eos: bool = False, serving_latency_s: float = 0.0,
                 serving_latency_per_1k_s: float = 0.0, tokenizer: ChatTokenizer | None = None,
                 on_record: Callable[[RequestRecord], None] | None = None,
                 on_progress: Callable[[float], None] | None = None, max_requests: int | None = None,
                 on_prompt: Callable[[RequestRecord, list[int]], None] | None = None,
                 on_pass: Callable[[str, float, StepResult], None] | None = None) -> VirtualRun:
    """Run ``workload`` against ``config``'s deployment in virtual time; the finished run (``records``: one per request sent).

    Arguments mean what they mean for :func:`loadgen.runner.run_loadgen`;
    arrivals come from ``random.Random(f"arrivals/{seed}")`` as there;
    ``serving_latency_s`` and ``serving_latency_per_1k_s`` as for :class:`~loadgen.virtual.VirtualRun`,
    ``on_prompt`` and ``on_pass`` as for its :meth:`~loadgen.virtual.VirtualRun.run`.
    ``tokenizer`` defaults to the gateway's (``config.model.path``).
    A prefill–decode deployment (``pd:``) runs as a :class:`~loadgen.virtual_pd.VirtualPDRun`.

    Raises:
        ValueError: bad ``rate``/``burstiness``/``time_scale``/``think_dist``, or an engine role the simulator cannot run.
    """
    plan = plan_arrivals(workload, duration_s=duration_s, rng=random.Random(f"arrivals/{seed}"), rate=rate,
                         burstiness=burstiness, time_scale=time_scale, think_time_s=think_time_s, think_dist=think_dist,
                         max_requests=max_requests)
    run_class = VirtualPDRun if config.pd is not None else VirtualRun
    run = run_class(config, tokenizer or load_tokenizer(config.model.path), request_timeout_s=request_timeout_s,
                    ignore_eos=ignore_eos, serving_latency_s=serving_latency_s,
                    serving_latency_per_1k_s=serving_latency_per_1k_s)
    run.run(plan, duration_s, on_record=on_record, on_progress=on_progress, on_prompt=on_prompt, on_pass=on_pass)
    return run
