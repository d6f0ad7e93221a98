"""The simulated engine's command line: SGLang 0.5.23 flag names, SGLang's derived defaults, and what they build.

Both shells start here: the HTTP engine process (``python -m engines.sim``)
and the virtual-time simulator (which parses each engine's role flags with the
same parser) turn a :class:`SimServerArgs` into an :class:`EngineConfig` and a
:class:`LatencyModel` through :func:`resolve_args`. Unknown flags are refused,
so a role that SGLang would not accept fails here too.

Defaults follow SGLang 0.5.23 (``arg_groups/memory_hook.py``
``handle_gpu_memory_settings``, ``arg_groups/cuda_graph_hook.py``):
``chunked_prefill_size`` and the decode graph's largest batch come from the
GPU's memory (80–160 GiB: 8192 and 256, or 512 at tp ≥ 4; the latter capped at
an explicit ``--max-running-requests``); the prefill graph (backend
``breakable``) captures token buckets up to ``chunked_prefill_size``;
``mem_fraction_static`` = (memory − reserve) / memory with reserve (MiB) =
512 + 1.5·max(chunk, 2048) + 128·tp + 2·decode max_bs + 8·(prefill buckets),
at least 10 GiB on GPUs above 60 GiB, rounded to 3 decimals; the KV pool is
what that fraction leaves after the weights. ``--sim-calibration PATH`` replaces
the latency model's two fitted efficiencies with a calibration file's
(:mod:`engines.sim.calibration_file`, written by ``bench/gpu_check.py``).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from pydantic import ValidationError

from engines.kv_events import KVEventsConfig
from engines.sim.calibration_file import load_calibration
from engines.sim.core import SCHEDULE_POLICIES, EngineConfig, default_max_running_requests
from engines.sim.faults import parse_fault
from engines.sim.kv_transfer import LINKS
from engines.sim.latency import (
    GPUS,
    MIB,
    MODELS,
    GraphSpec,
    LatencyModel,
    decode_graph_buckets,
    make_latency_model,
    prefill_graph_buckets,
)

SGLANG_SCHEDULE_POLICIES = ("lpm", "random", "fcfs", "dfs-weight", "lof", "priority", "routing-key", "hrrn",
                            "shortest-prefill-first")
GRAPH_BACKENDS = ("full", "breakable", "disabled")
PD_TRANSFER_BACKENDS = ("mooncake", "nixl", "ascend", "fake", "mori", "mooncake_tcp")  # SGLang 0.5.23 arg_groups/choices.py
FULL_PREFILL_TOKENS_PER_SLOT = 512  # full prefill graphs bake in chunked_prefill_size // 512 request slots


@dataclass(frozen=True, slots=True)
class SimServerArgs:
    """The engine's command line (SGLang flag names, underscores), with SGLang's defaults.

    None means "derive as SGLang does" (see the module doc); ``chunked_prefill_size``
    −1 disables chunking; ``sim_model`` None picks the preset whose size
    (7b/14b/32b) appears in ``model_path``, else 7b; ``sim_calibration``: a
    calibration file's path, None for the shipped efficiencies.
    """

    model_path: str = "Qwen/Qwen2.5-7B-Instruct"
    served_model_name: str | None = None
    tokenizer_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    tp_size: int = 1
    chunked_prefill_size: int | None = None
    max_prefill_tokens: int = 16384
    max_running_requests: int | None = None
    max_total_tokens: int | None = None
    mem_fraction_static: float | None = None
    context_length: int | None = None
    schedule_policy: str = "fcfs"
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10
    disable_priority_preemption: bool = False
    schedule_conservativeness: float = 1.0
    random_seed: int | None = None
    cuda_graph_backend_decode: str | None = None
    cuda_graph_backend_prefill: str | None = None
    cuda_graph_max_bs_decode: int | None = None
    cuda_graph_max_bs_prefill: int | None = None
    cuda_graph_bs_decode: tuple[int, ...] | None = None
    cuda_graph_bs_prefill: tuple[int, ...] | None = None
    disable_cuda_graph: bool = False
    disable_decode_cuda_graph: bool = False
    disable_prefill_cuda_graph: bool = False
    enable_mixed_chunk: bool = False
    prefill_decode_interval: int | None = None
    prefill_decode_interval_min_bs: int = 0
    enable_metrics: bool = False
    enable_cache_report: bool = False
    kv_events_config: str | None = None
    sim_model: str | None = None
    sim_gpu: str = "h200"
    sim_decode_spread: str = "roofline"
    sim_calibration: str | None = None
    sim_zero_time: bool = False
    sim_fault: str | None = None
    sim_late_last_ttft_s: float | None = None
    sim_late_last_per_1k_s: float = 0.0
    sim_late_last_deadline_order_above: int | None = None
    sim_short_pass_tokens: int | None = None
    sim_decode_turn_short_tokens: int | None = None
    disaggregation_mode: str = "null"
    disaggregation_transfer_backend: str = "mooncake"
    disaggregation_bootstrap_port: int = 8998
    enable_pd_role_switch: bool = False
    sim_kv_link_gb_s: float = LINKS["nvlink"].bandwidth_bytes_per_s / 1e9
    log_level: str = "info"


@dataclass(frozen=True, slots=True)
class ResolvedSim:
    """The args with every derived default filled in, and the objects they build."""

    args: SimServerArgs
    sim_model: str
    served_model_name: str
    tokenizer_path: str | None
    mem_fraction_static: float
    latency: LatencyModel
    config: EngineConfig
    kv_events: KVEventsConfig | None = None  # --kv-events-config with publisher zmq: the engine publishes its KV cache events

    @property
    def decode_graph(self) -> GraphSpec:
        """Decode CUDA-graph coverage."""
        return self.latency.decode_graph

    @property
    def prefill_graph(self) -> GraphSpec:
        """Prefill CUDA-graph coverage (token buckets)."""
        return self.latency.prefill_graph


def gpu_defaults(gpu_mib: float, tp_size: int) -> tuple[int, int]:
    """SGLang's (chunked_prefill_size, decode graph max batch) for a GPU of ``gpu_mib`` MiB."""
    if gpu_mib < 20 * 1024:
        return 2048, 8
    if gpu_mib < 35 * 1024:
        return 4096, 48 if tp_size < 4 else 160
    if gpu_mib < 60 * 1024:
        return 4096, 32 if tp_size < 4 else 160
    if gpu_mib < 160 * 1024:
        return 8192, 256 if tp_size < 4 else 512
    return 16384, 512


def default_mem_fraction_static(gpu_mib: float, tp_size: int, chunk: int, max_prefill_tokens: int,
                                decode_graph: GraphSpec, prefill_graph: GraphSpec) -> float:
    """SGLang's ``mem_fraction_static`` heuristic (module doc); ``chunk`` ≤ 0 means chunking is off."""
    activation_tokens = max(chunk if chunk > 0 else max_prefill_tokens, 2048)
    reserved = 512 + activation_tokens * 1.5 + tp_size / 8 * 1024
    if decode_graph.backend != "disabled":
        reserved += max(decode_graph.sizes, default=0) * 2
    if prefill_graph.backend != "disabled":
        reserved += len(prefill_graph.sizes) * 8
    if gpu_mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((gpu_mib - reserved) / gpu_mib, 3)


def _graphs(args: SimServerArgs, chunk: int, max_running: int | None, gpu_mib: float) -> tuple[GraphSpec, GraphSpec]:
    """Decode and prefill CUDA-graph coverage as SGLang 0.5.23 resolves the flags (JSON config not simulated)."""
    decode_backend = prefill_backend = None
    if args.disable_cuda_graph:
        decode_backend = prefill_backend = "disabled"
    if args.disable_prefill_cuda_graph:
        prefill_backend = "disabled"
    if args.disable_decode_cuda_graph:
        decode_backend = "disabled"
    decode_backend = args.cuda_graph_backend_decode or decode_backend or "full"
    prefill_backend = args.cuda_graph_backend_prefill or prefill_backend or "breakable"
    _, default_bs = gpu_defaults(gpu_mib, args.tp_size)
    if args.cuda_graph_bs_decode:
        decode_sizes = tuple(sorted(set(args.cuda_graph_bs_decode)))
    else:
        max_bs = args.cuda_graph_max_bs_decode or default_bs
        if args.cuda_graph_max_bs_decode is None and args.max_running_requests is not None:
            max_bs = min(max_bs, args.max_running_requests)
        decode_sizes = decode_graph_buckets(max_bs)
    if max_running is not None:  # captures are clamped to the request slots, which are always captured
        if decode_sizes[-1] > max_running:
            decode_sizes = tuple(sorted({s for s in decode_sizes if s <= max_running} | {max_running}))
    if args.cuda_graph_bs_prefill:
        prefill_sizes = tuple(sorted(set(args.cuda_graph_bs_prefill)))
    else:
        max_tokens = args.cuda_graph_max_bs_prefill or max(chunk, 1)
        if args.cuda_graph_max_bs_prefill is None and args.max_total_tokens is not None:
            max_tokens = min(max_tokens, args.max_total_tokens)
        prefill_sizes = prefill_graph_buckets(max_tokens)
    full_slots = max(1, chunk // FULL_PREFILL_TOKENS_PER_SLOT) if prefill_backend == "full" else None
    return GraphSpec(decode_backend, decode_sizes), GraphSpec(prefill_backend, prefill_sizes, full_slots)  # type: ignore[arg-type]


def full_chunk_prefill_s_per_1k(latency: LatencyModel, chunk_tokens: int) -> float:
    """Seconds per 1,000 new tokens of a prefill pass of ``chunk_tokens`` with nothing cached: the engine's prefill
    rate when its queue is long, which the plugin's deadline order uses."""
    return latency.predict([(chunk_tokens, 0)]) / chunk_tokens * 1000


def _check_late_last(args: SimServerArgs) -> None:
    """The simulated plugin's flags as laps' plugin takes its variables: a finite objective > 0, an allowance >= 0.

    Raises:
        ValueError: naming the flag.
    """
    ttft_s, per_1k_s = args.sim_late_last_ttft_s, args.sim_late_last_per_1k_s
    if ttft_s is not None and not (math.isfinite(ttft_s) and ttft_s > 0):
        raise ValueError(f"--sim-late-last-ttft-s must be a number of seconds > 0, got {ttft_s}")
    if not (math.isfinite(per_1k_s) and per_1k_s >= 0):
        raise ValueError(f"--sim-late-last-per-1k-s must be a number of seconds >= 0, got {per_1k_s}")
    if per_1k_s and ttft_s is None:
        raise ValueError("--sim-late-last-per-1k-s needs --sim-late-last-ttft-s")
    above = args.sim_late_last_deadline_order_above
    if above is not None and above < 0:
        raise ValueError(f"--sim-late-last-deadline-order-above must be a number of tokens >= 0, got {above}")
    if above is not None and ttft_s is None:
        raise ValueError("--sim-late-last-deadline-order-above needs --sim-late-last-ttft-s")
    short_pass = args.sim_short_pass_tokens
    if short_pass is not None and short_pass < 1:
        raise ValueError(f"--sim-short-pass-tokens must be a number of tokens >= 1, got {short_pass}")
    if short_pass is not None and above is None:
        raise ValueError("--sim-short-pass-tokens needs --sim-late-last-deadline-order-above")
    if short_pass is not None and args.chunked_prefill_size is not None and args.chunked_prefill_size <= 0:
        raise ValueError("--sim-short-pass-tokens cuts a pass's chunk budget: it needs chunked prefill, not "
                         f"--chunked-prefill-size {args.chunked_prefill_size}")
    turns = args.sim_decode_turn_short_tokens
    if turns is not None and turns < 0:
        raise ValueError(f"--sim-decode-turn-short-tokens must be a number of tokens >= 0, got {turns}")
    if turns is not None and ttft_s is None:
        raise ValueError("--sim-decode-turn-short-tokens models part of laps' plugin: it needs --sim-late-last-ttft-s")
    if turns is not None and not args.prefill_decode_interval:
        raise ValueError("--sim-decode-turn-short-tokens keeps or drops the decode passes that --prefill-decode-interval "
                         "owes: it needs --prefill-decode-interval >= 1")
    if ttft_s is not None and args.schedule_policy != "shortest-prefill-first":
        raise ValueError(f"--sim-late-last-ttft-s reorders the queue of --schedule-policy shortest-prefill-first, "
                         f"not {args.schedule_policy}")


def resolve_args(args: SimServerArgs) -> ResolvedSim:
    """Fill in derived defaults (see the module doc) and build the latency model and engine config.

    Raises:
        ValueError: on a schedule policy SGLang refuses or the model does not
            implement, an unknown preset, or limits that do not fit.
        engines.sim.calibration_file.CalibrationError: (a ValueError) a calibration file that
            cannot be used, or was fitted against another GPU.
    """
    parse_fault(args.sim_fault)  # a bad --sim-fault fails with the other flags
    _check_late_last(args)
    sim_model = args.sim_model or next(
        (name for name in MODELS if name.split("-")[-1] in args.model_path.lower()), "qwen2.5-7b")
    if args.sim_gpu not in GPUS:
        raise ValueError(f"unknown sim gpu {args.sim_gpu!r}; choose from {sorted(GPUS)}")
    gpu_mib = GPUS[args.sim_gpu].memory_bytes / MIB
    default_chunk, _ = gpu_defaults(gpu_mib, args.tp_size)
    chunk = args.chunked_prefill_size if args.chunked_prefill_size is not None else default_chunk
    calibration = load_calibration(args.sim_calibration) if args.sim_calibration is not None else None

    def latency_model(decode_graph: GraphSpec, prefill_graph: GraphSpec) -> LatencyModel:
        latency = make_latency_model(sim_model, args.sim_gpu, args.tp_size, decode_graph, prefill_graph,
                                     args.sim_decode_spread)
        return calibration.apply(latency) if calibration is not None else latency

    decode_graph, prefill_graph = _graphs(args, chunk, args.max_running_requests, gpu_mib)
    latency = latency_model(decode_graph, prefill_graph)
    mfs = args.mem_fraction_static or default_mem_fraction_static(
        gpu_mib, args.tp_size, chunk, args.max_prefill_tokens, decode_graph, prefill_graph)
    max_total = args.max_total_tokens or latency.max_total_tokens(mfs)
    context = args.context_length or latency.model.context_length
    max_running = args.max_running_requests or default_max_running_requests(max_total, context)
    if args.max_running_requests is None:  # the request slots are known only now; decode captures clamp to them
        decode_graph, prefill_graph = _graphs(args, chunk, max_running, gpu_mib)
        latency = latency_model(decode_graph, prefill_graph)
    config = EngineConfig(
        max_total_tokens=max_total,
        max_running_requests=max_running,
        chunked_prefill_size=None if chunk <= 0 else chunk,  # SGLang 0.5.23: 0 or less turns chunking off
        max_prefill_tokens=args.max_prefill_tokens,
        context_length=context,
        enable_mixed_chunk=args.enable_mixed_chunk,
        prefill_decode_interval=args.prefill_decode_interval or 0,
        prefill_decode_interval_min_bs=args.prefill_decode_interval_min_bs,
        decode_turn_short_tokens=args.sim_decode_turn_short_tokens,
        schedule_policy=args.schedule_policy,
        enable_priority_scheduling=args.enable_priority_scheduling,
        schedule_low_priority_values_first=args.schedule_low_priority_values_first,
        priority_scheduling_preemption_threshold=args.priority_scheduling_preemption_threshold,
        disable_priority_preemption=args.disable_priority_preemption,
        schedule_conservativeness=args.schedule_conservativeness,
        random_seed=args.random_seed or 0,
        disaggregation_mode=args.disaggregation_mode,
        late_last_ttft_s=args.sim_late_last_ttft_s,
        late_last_per_1k_s=args.sim_late_last_per_1k_s,
        late_last_deadline_order_tokens=args.sim_late_last_deadline_order_above,
        late_last_short_pass_tokens=args.sim_short_pass_tokens,
        late_last_prefill_s_per_1k=None if args.sim_late_last_deadline_order_above is None else
        full_chunk_prefill_s_per_1k(latency, chunk if chunk > 0 else args.max_prefill_tokens),
    )
    tokenizer_path = args.tokenizer_path or (args.model_path if Path(args.model_path).is_dir() else None)
    kv_events = None
    if args.kv_events_config is not None:
        try:
            kv_events = KVEventsConfig.model_validate_json(args.kv_events_config)
        except ValidationError as err:
            raise ValueError(f"--kv-events-config: {err.errors()[0]['msg']} at {'.'.join(map(str, err.errors()[0]['loc'])) or 'the top'}") from None
        if kv_events.publisher == "null":
            kv_events = None
    return ResolvedSim(args, sim_model, args.served_model_name or args.model_path, tokenizer_path, mfs, latency, config, kv_events)


EPILOG = """\
example:
  python -m engines.sim --model-path Qwen/Qwen2.5-7B-Instruct --port 30001 \\
      --chunked-prefill-size 2048 --schedule-policy lpm --enable-metrics --enable-cache-report

Flags keep SGLang 0.5.23's names and defaults; --sim-* flags pick the simulated
model and GPU. --model-path is only a name unless it is a directory holding a
Hugging Face tokenizer, which is then used (so is --tokenizer-path)."""


def build_parser(exit_on_error: bool = True) -> argparse.ArgumentParser:
    """The command line; unset flags take :class:`SimServerArgs`'s defaults."""
    p = argparse.ArgumentParser(
        prog="python -m engines.sim",
        description="A simulated SGLang 0.5.23 engine: SGLang's HTTP API and batching on a roofline model of a "
                    "GPU, in real time, on CPU only.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS, exit_on_error=exit_on_error)
    d = SimServerArgs()
    p.add_argument("--model-path", help=f"model name, or a HF model directory (default {d.model_path})")
    p.add_argument("--served-model-name", help="name in /v1/models (default: --model-path)")
    p.add_argument("--tokenizer-path", help="HF tokenizer directory (default: built-in Qwen2.5 vocabulary)")
    p.add_argument("--host", help=f"bind address (default {d.host})")
    p.add_argument("--port", type=int, help=f"port (default {d.port})")
    p.add_argument("--tp-size", type=int, help="tensor-parallel GPUs (default 1)")
    p.add_argument("--chunked-prefill-size", type=int,
                   help="max tokens of one prefill chunk; -1 disables (default: 8192 on 80-160 GiB GPUs)")
    p.add_argument("--max-prefill-tokens", type=int, help=f"max new tokens of one prefill batch (default {d.max_prefill_tokens})")
    p.add_argument("--max-running-requests", type=int, help="max running requests (default: from the KV pool)")
    p.add_argument("--max-total-tokens", type=int, help="KV pool size in tokens (default: from GPU memory)")
    p.add_argument("--mem-fraction-static", type=float, help="GPU memory share for weights + KV pool (default: SGLang's heuristic)")
    p.add_argument("--context-length", type=int, help="context length (default: the model's, 32768)")
    p.add_argument("--schedule-policy", choices=SGLANG_SCHEDULE_POLICIES,
                   help=f"waiting-queue order; simulated: {', '.join(SCHEDULE_POLICIES)} (default fcfs)")
    p.add_argument("--enable-priority-scheduling", action="store_true",
                   help="order by the request's priority (higher first), preempting lower ones (fcfs or lof only)")
    p.add_argument("--schedule-low-priority-values-first", action="store_true", help="lower priority values go first")
    p.add_argument("--priority-scheduling-preemption-threshold", type=int,
                   help="minimum priority difference for preemption (default 10)")
    p.add_argument("--disable-priority-preemption", action="store_true", help="priority orders the queue only")
    p.add_argument("--schedule-conservativeness", type=float, help="scales the initial new-token ratio (default 1.0)")
    p.add_argument("--random-seed", type=int, help="seed of --schedule-policy random (default 0)")
    p.add_argument("--cuda-graph-backend-decode", choices=GRAPH_BACKENDS, help="decode graph backend (default full)")
    p.add_argument("--cuda-graph-backend-prefill", choices=GRAPH_BACKENDS, help="prefill graph backend (default breakable)")
    p.add_argument("--cuda-graph-max-bs-decode", type=int, help="largest decode batch a CUDA graph covers (default 256)")
    p.add_argument("--cuda-graph-max-bs-prefill", type=int,
                   help="largest prefill pass, in tokens, a CUDA graph covers (default: --chunked-prefill-size)")
    p.add_argument("--cuda-graph-bs-decode", type=int, nargs="+", help="decode batch sizes to capture")
    p.add_argument("--cuda-graph-bs-prefill", type=int, nargs="+", help="prefill token buckets to capture")
    p.add_argument("--disable-cuda-graph", action="store_true", help="deprecated: both backends disabled")
    p.add_argument("--disable-decode-cuda-graph", action="store_true", help="decode passes run eagerly")
    p.add_argument("--disable-prefill-cuda-graph", action="store_true", help="prefill passes run eagerly")
    p.add_argument("--enable-mixed-chunk", action="store_true", help="run decodes in the same pass as prefill chunks")
    p.add_argument("--prefill-decode-interval", type=int, metavar="N",
                   help="decode passes after each prefill pass before the next prefill (default: 0, off)")
    p.add_argument("--prefill-decode-interval-min-bs", type=int, metavar="REQUESTS",
                   help="apply --prefill-decode-interval only while at least this many requests run (default 0)")
    p.add_argument("--enable-metrics", action="store_true", help="serve Prometheus metrics at /metrics")
    p.add_argument("--enable-cache-report", action="store_true",
                   help="put usage.prompt_tokens_details.cached_tokens in OpenAI responses")
    p.add_argument("--kv-events-config", metavar="JSON",
                   help='publish KV cache events as SGLang does, e.g. \'{"publisher": "zmq", "endpoint": "tcp://*:5557", '
                        '"replay_endpoint": "tcp://*:5558"}\' (default: none)')
    p.add_argument("--sim-model", choices=sorted(MODELS), help="simulated model (default: from --model-path)")
    p.add_argument("--sim-gpu", choices=sorted(GPUS), help=f"simulated GPU (default {d.sim_gpu})")
    p.add_argument("--sim-decode-spread", metavar="KAPPA",
                   help="share of a decode batch's padding waste n*max(ctx) - sum(ctx) that attention pays: "
                        "'roofline' (0, a split-KV kernel), 'alignedserve' (0.112, fitted to AlignedServe's "
                        f"Llama-7B/H100 figure) or a number in [0, 1] (default {d.sim_decode_spread})")
    p.add_argument("--sim-calibration", metavar="PATH",
                   help="a calibration file from bench/gpu_check.py: its measured compute and memory efficiencies "
                        "replace the ones fitted to the published anchors (default: those)")
    p.add_argument("--sim-zero-time", action="store_true",
                   help="forward passes take no time (scheduling unchanged): only HTTP and scheduling cost remain, "
                        "for gateway overhead benchmarks (bench/router_overhead.py)")
    p.add_argument("--sim-fault", metavar="KIND[:N]",
                   help="inject a fault for tests of the gateway: error-mid-stream, malformed, truncated or hang after N "
                        "stream events (default 2; non-streamed answers fail at once, or under hang never come, nor does "
                        "/health_generate's token: a stuck scheduler), or slow:N (every pass N times as long, default 10); "
                        "see engines.sim.faults")
    p.add_argument("--sim-late-last-ttft-s", type=float, metavar="SECONDS",
                   help="model laps' SGLang plugin (engines/sglang_plugin): under shortest-prefill-first, requests "
                        "waiting longer than this TTFT objective sort behind the others (default: off)")
    p.add_argument("--sim-late-last-per-1k-s", type=float, metavar="SECONDS",
                   help="with --sim-late-last-ttft-s: seconds added to the objective per 1,000 tokens the request "
                        f"must prefill (prompt and reply so far, less its cached prefix; default {d.sim_late_last_per_1k_s:g})")
    p.add_argument("--sim-late-last-deadline-order-above", type=int, metavar="TOKENS",
                   help="with --sim-late-last-ttft-s: the plugin's deadline order: requests in time of more than "
                        "TOKENS new tokens go by deadline (behind the shorter ones), less the longest ones wherever, "
                        "by an estimate at the engine's full-chunk prefill rate, one would end late: Moore's order "
                        "(default: off)")
    p.add_argument("--sim-short-pass-tokens", type=int, metavar="TOKENS",
                   help="with --sim-late-last-deadline-order-above N: the plugin's short pass: a prefill pass whose "
                        "queue starts with requests in time of at most N new tokens holds at most TOKENS tokens, or "
                        "what they need where more, instead of filling the chunk with a long prefill (default: off)")
    p.add_argument("--sim-decode-turn-short-tokens", type=int, metavar="TOKENS",
                   help="with --prefill-decode-interval and --sim-late-last-ttft-s: the plugin's decode turns: a decode "
                        "pass the interval owes is kept only while no chunked prefill is in progress and every waiting "
                        "request has at most TOKENS new tokens, else the prefill runs (default: off)")
    p.add_argument("--disaggregation-mode", choices=("null", "prefill", "decode"),
                   help="PD disaggregation: prefill-only or decode-only engine (default null; see engines.sim.pd_http)")
    p.add_argument("--disaggregation-transfer-backend", choices=PD_TRANSFER_BACKENDS,
                   help=f"KV transfer backend (accepted; the sim models a link instead, default {d.disaggregation_transfer_backend})")
    p.add_argument("--disaggregation-bootstrap-port", type=int,
                   help=f"a prefill engine's KV bootstrap port (default {d.disaggregation_bootstrap_port})")
    p.add_argument("--enable-pd-role-switch", action="store_true",
                   help="allow POST /pd_role_switch to flip an idle PD engine between prefill and decode "
                        "(see engines.sim.role_switch)")
    p.add_argument("--sim-kv-link-gb-s", type=float,
                   help=f"simulated KV link bandwidth, GB/s, for PD transfers (default {d.sim_kv_link_gb_s:g}: NVLink)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), help="log level (default info)")
    return p


def parse_server_args(argv: Sequence[str]) -> SimServerArgs:
    """Parse an engine command line (SGLang flag names) into :class:`SimServerArgs`.

    Raises:
        ValueError: on an unknown or malformed flag.
    """
    try:
        namespace, unknown = build_parser(exit_on_error=False).parse_known_args(list(argv))
    except argparse.ArgumentError as err:
        raise ValueError(str(err)) from None
    if unknown:
        raise ValueError(f"unrecognized arguments: {' '.join(unknown)}")
    values = vars(namespace)
    for name in ("cuda_graph_bs_decode", "cuda_graph_bs_prefill"):
        if name in values:
            values[name] = tuple(values[name])
    return SimServerArgs(**values)
