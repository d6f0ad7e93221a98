"""A prepared GPU check of the engine model: time a Qwen2.5-7B-shaped transformer as SGLang runs it, fit, write a calibration.

The engine model (engines/sim/latency.py) claims what one forward pass costs on
a GPU from the model's shape and two efficiencies fitted to published anchors.
This check measures the hardware side of that claim without SGLang (which the
GPU machine cannot install: no network, 64 MiB of files carried): it builds the
real layer shapes of a :data:`~engines.sim.latency.MODELS` preset (Qwen2.5-7B:
28 layers of GQA attention with q/k/v biases and RoPE, SwiGLU MLP, RMSNorm, an
untied LM head; random bf16 weights, nothing downloaded; the parameter count is
the spec's) and runs it the way SGLang 0.5.23 does:

* ragged (varlen) batches: the new tokens of all sequences are one flat
  [Σ L_i, hidden] tensor through the linear layers, logits only for each
  sequence's last token;
* attention over a token-pool KV cache (one [capacity, kv_heads, head_dim]
  buffer per layer and for K and V; each sequence's cached and new tokens
  contiguous, the new tokens' K/V written at their slots), with
  ``torch.ops.aten._flash_attention_forward`` (PyTorch's FlashAttention-2,
  cu_seqlens varlen, causal aligned to each sequence's end, GQA) on CUDA,
  SGLang's fa3 call in kind; where that op is missing or disagrees with the
  fallback on a small batch, and on CPU,
  ``torch.nn.functional.scaled_dot_product_attention`` per run of equal
  sequences (lower-right causal mask over a cached prefix). flash-attn itself
  is not installed there;
* on CUDA every pass replays a ``torch.cuda.CUDAGraph`` captured for its
  shape (decode as SGLang's full decode graphs; prefill as its prefill graphs,
  whole), so the times are the GPU's, not Python's dispatch.

Anchors (:data:`ANCHORS`): prefill of 16/256/1024/2048 tokens, 8 × 64 tokens,
7 × 64 + 2048 ragged and padded to 8 × 2048 (the interference pair the LAPS
slides report at 19 → 567 ms), a re-prefill of 64 new tokens on 8,192 cached,
decode at batch 1/32/128 with 1,024 tokens of context each. Each is timed with
CUDA events (time.perf_counter on CPU): the median of ``--repeats`` (default 10)
runs after 3 warm-ups. Then :func:`engines.sim.calibration.fit_latency` fits
compute_efficiency and memory_efficiency to them on a model with no scheduler
overhead, no launch cost and no graph padding (the check has none of them) and
bounds wide enough to show the truth, and the file written is a calibration
(:mod:`engines.sim.calibration_file`) that simulated engines load with
``sim.calibration: PATH`` / ``--sim-calibration PATH``; it also holds the
measurements, the model's predictions with the shipped and the fitted
efficiencies, a bf16 GEMM and a device-copy rate next to the GPU preset's, and
the measured interference slowdown.

    python bench/gpu_check.py --out runs/gpu_check.json                 # one H200: expected ~1 min
    python bench/gpu_check.py --out /tmp/tiny.json --device cpu --tiny  # the same code, a tiny model, seconds

Needs PyTorch 2.5 or later (SDPA's enable_gqa); imports only torch, numpy, scipy and
engines/sim/{latency,calibration,calibration_file}.py
(no install of this project is needed: it puts the repository on sys.path).
``--device cpu`` needs ``--tiny``; a CPU run's efficiencies only test the code path.
Exits with a message (status 2) when CUDA is missing, the GPU has no preset, or it runs out of memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the GPU machine has no install of this project

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention.bias import causal_lower_right  # noqa: E402

from engines.sim.calibration import (  # noqa: E402
    INTERFERENCE_ANCHORS,
    MIXED_BATCH,
    PASS_ANCHORS,
    SHORT_BATCH,
    PassAnchor,
    fit_latency,
    padded_batch,
    pass_anchor_rows,
)
from engines.sim.calibration_file import CALIBRATED_FIELDS, calibration_document  # noqa: E402
from engines.sim.latency import GPUS, MODELS, GraphSpec, LatencyModel, ModelSpec, SeqShape  # noqa: E402

MODEL = "qwen2.5-7b"
TINY = ModelSpec("tiny", "(random weights)", hidden=32, layers=2, heads=2, kv_heads=1, intermediate=64, vocab=256)
"""A Qwen2-style shape small enough for the test suite's CPU run (GQA 2:1, head_dim 16)."""

ROPE_THETA = 1e6  # Qwen2.5's rope_theta
RMS_EPS = 1e-6
WARMUP = 3
DEFAULT_REPEATS = 10
MEASURED_BOUNDS = dict.fromkeys(CALIBRATED_FIELDS, (1e-9, 2.0))
"""Fit bounds of the check: wide, so the fit shows what was measured (a CPU run lands near 1e-6)."""

SHORT, MIXED, PADDED = "8 x prefill 64", "7 x prefill 64 + 2048", "7 x prefill 64 + 2048, padded (8 x 2048)"
ANCHORS: tuple[tuple[str, tuple[SeqShape, ...]], ...] = (
    ("prefill 16", ((16, 0),)),
    ("prefill 256", ((256, 0),)),
    ("prefill 1024", ((1024, 0),)),
    ("prefill 2048", ((2048, 0),)),
    (SHORT, SHORT_BATCH),
    (MIXED, MIXED_BATCH),
    (PADDED, padded_batch(MIXED_BATCH)),
    ("re-prefill 64 on 8192 cached", ((64, 8192),)),
    ("decode bs 1, 1024 context", ((1, 1024),)),
    ("decode bs 32, 1024 context", ((1, 1024),) * 32),
    ("decode bs 128, 1024 context", ((1, 1024),) * 128),
)
"""(name, batch of (new L, cached H) shapes) of every timed pass; names match the published anchors where they coincide."""

GPU_NAMES = {"H200": "h200", "H100": "h100", "A100": "a100"}
"""Substrings of ``torch.cuda.get_device_name()`` and the GPU preset each is."""


class CheckError(Exception):
    """The check cannot run here; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class Run:
    """``count`` consecutive sequences of one shape (L new, H cached) and where they start: query row, KV slot."""

    count: int
    new: int
    cached: int
    q_start: int
    kv_start: int


@dataclass(frozen=True, slots=True)
class PassInputs:
    """One forward pass's device inputs, fixed for its CUDA graph.

    Tensors: ``input_ids``, ``positions`` (H_i + 0..L_i−1) and ``slots`` (KV-pool rows the new
    tokens' K/V go to) [N]; ``last_index`` [S] (each sequence's last new token); ``cu_q``, ``cu_k``
    [S+1] int32 (cumulative new tokens and cached + new tokens). ``max_q``, ``max_k``: the longest
    L_i and H_i + L_i; ``kv_tokens``: Σ (H_i + L_i); ``runs``: the batch as runs of equal sequences (:class:`Run`). Sequences
    lie back to back in the KV pool from slot 0: sequence i's H_i cached tokens, then its L_i new ones.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    last_index: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    kv_tokens: int
    runs: tuple[Run, ...]


def pass_inputs(shapes: Sequence[SeqShape], input_ids: torch.Tensor, device: torch.device) -> PassInputs:
    """The inputs of a pass over ``shapes`` ((L ≥ 1, H ≥ 0) each) with ``input_ids`` [Σ L] as its new tokens.

    Raises:
        ValueError: an empty batch, a bad shape, or ``input_ids`` of another length than Σ L.
    """
    if not shapes or any(new < 1 or cached < 0 for new, cached in shapes):
        raise ValueError(f"a pass needs sequences with L >= 1 and H >= 0, got {list(shapes)}")
    tokens = sum(new for new, _ in shapes)
    if input_ids.shape != (tokens,):
        raise ValueError(f"input_ids must have shape ({tokens},), got {tuple(input_ids.shape)}")
    positions, slots, cu_q, cu_k, runs = [], [], [0], [0], []
    for new, cached in shapes:
        start = cu_k[-1]
        positions.append(torch.arange(cached, cached + new))
        slots.append(torch.arange(start + cached, start + cached + new))
        if runs and (runs[-1].new, runs[-1].cached) == (new, cached):
            last = runs[-1]
            runs[-1] = Run(last.count + 1, new, cached, last.q_start, last.kv_start)
        else:
            runs.append(Run(1, new, cached, cu_q[-1], start))
        cu_q.append(cu_q[-1] + new)
        cu_k.append(start + cached + new)

    def put(t: torch.Tensor, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return t.to(device=device, dtype=dtype)

    return PassInputs(put(input_ids), put(torch.cat(positions)), put(torch.cat(slots)),
                      put(torch.tensor(cu_q[1:]) - 1), put(torch.tensor(cu_q), torch.int32),
                      put(torch.tensor(cu_k), torch.int32), max(n for n, _ in shapes),
                      max(n + h for n, h in shapes), cu_k[-1], tuple(runs))


Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, PassInputs], torch.Tensor]
"""(q [N, heads, d], k_pool, v_pool [capacity, kv_heads, d], inputs) -> [N, heads, d]."""


def attention_varlen(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, p: PassInputs) -> torch.Tensor:
    """All sequences in one FlashAttention-2 varlen call (CUDA only): causal, aligned to each sequence's end."""
    k, v = k_pool[:p.kv_tokens], v_pool[:p.kv_tokens]
    return torch.ops.aten._flash_attention_forward(q, k, v, p.cu_q, p.cu_k, p.max_q, p.max_k, 0.0, True, False,
                                                   scale=q.shape[-1] ** -0.5)[0]


def attention_sdpa(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, p: PassInputs) -> torch.Tensor:
    """One ``scaled_dot_product_attention`` per run of equal sequences: causal without a cached prefix,
    a lower-right causal mask with one (the new tokens see the whole prefix), none for decode."""
    out = torch.empty_like(q)
    heads, dim = q.shape[1], q.shape[2]
    for r in p.runs:
        total = r.new + r.cached
        qr = q[r.q_start:r.q_start + r.count * r.new].view(r.count, r.new, heads, dim).transpose(1, 2)
        kr, vr = (pool[r.kv_start:r.kv_start + r.count * total].view(r.count, total, -1, dim).transpose(1, 2)
                  for pool in (k_pool, v_pool))
        mask = causal_lower_right(r.new, total) if r.cached and r.new > 1 else None
        o = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask, is_causal=r.new > 1 and not r.cached,
                                           enable_gqa=True)
        out[r.q_start:r.q_start + r.count * r.new] = o.transpose(1, 2).reshape(-1, heads, dim)
    return out


@dataclass(slots=True)
class Layer:
    """One decoder layer's weights ([out, in], as ``F.linear`` takes them) and its KV-pool buffers."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor
    out: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    k_pool: torch.Tensor
    v_pool: torch.Tensor


class Transformer:
    """``spec``'s decoder-only transformer with random weights (Qwen2 layout) and a KV pool of ``kv_capacity`` tokens.

    Weights ~ N(0, 1/fan_in), norms 1, cached K/V ~ N(0, 1), drawn from ``seed``;
    :meth:`forward` runs one pass. Memory: ``spec.params`` weights plus
    2·layers·kv_capacity·kv_heads·head_dim KV values, in ``dtype``.
    """

    def __init__(self, spec: ModelSpec, kv_capacity: int, device: torch.device, dtype: torch.dtype,
                 attention: Attention, seed: int = 0) -> None:
        gen = torch.Generator(device=device).manual_seed(seed)

        def rand(*shape: int, fan_in: int = 1) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, device=device, dtype=dtype).mul_(fan_in ** -0.5)

        def ones(n: int) -> torch.Tensor:
            return torch.ones(n, device=device, dtype=dtype)

        h, d, kv = spec.hidden, spec.head_dim, spec.kv_heads * spec.head_dim
        self.spec, self.attention = spec, attention
        self.layers = [Layer(ones(h), rand(h + 2 * kv, h, fan_in=h), rand(h + 2 * kv, fan_in=h), rand(h, h, fan_in=h),
                             ones(h), rand(2 * spec.intermediate, h, fan_in=h),
                             rand(h, spec.intermediate, fan_in=spec.intermediate),
                             rand(kv_capacity, spec.kv_heads, d), rand(kv_capacity, spec.kv_heads, d))
                       for _ in range(spec.layers)]
        self.embed = rand(spec.vocab, h)
        self.final_norm = ones(h)
        self.lm_head = rand(spec.vocab, h, fan_in=h)
        inv_freq = ROPE_THETA ** (-torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
        angles = torch.outer(torch.arange(spec.context_length, device=device, dtype=torch.float32), inv_freq)
        self.cos, self.sin = angles.cos().to(dtype), angles.sin().to(dtype)

    @property
    def params(self) -> int:
        """Weight count (the KV pool and RoPE tables aside); equals ``spec.params``."""
        weights = [self.embed, self.final_norm, self.lm_head]
        for layer in self.layers:
            weights += [layer.input_norm, layer.qkv, layer.qkv_bias, layer.out, layer.post_norm, layer.gate_up, layer.down]
        return sum(w.numel() for w in weights)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of x [N, heads, d] (rotate-half layout), cos/sin [N, 1, d/2]."""
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(self, p: PassInputs) -> torch.Tensor:
        """One pass: writes the new tokens' K/V to the pool, returns logits [S, vocab] of each sequence's last token."""
        s = self.spec
        n, h, d, kv = p.input_ids.shape[0], s.hidden, s.head_dim, s.kv_heads * s.head_dim
        cos, sin = self.cos[p.positions].unsqueeze(1), self.sin[p.positions].unsqueeze(1)
        residual = F.embedding(p.input_ids, self.embed)
        for layer in self.layers:
            x = F.rms_norm(residual, (h,), layer.input_norm, RMS_EPS)
            q, k, v = F.linear(x, layer.qkv, layer.qkv_bias).split((h, kv, kv), dim=-1)
            q = self._rope(q.view(n, s.heads, d), cos, sin)
            layer.k_pool.index_copy_(0, p.slots, self._rope(k.view(n, s.kv_heads, d), cos, sin))
            layer.v_pool.index_copy_(0, p.slots, v.view(n, s.kv_heads, d))
            attn = self.attention(q, layer.k_pool, layer.v_pool, p)
            residual = residual + F.linear(attn.reshape(n, h), layer.out)
            x = F.rms_norm(residual, (h,), layer.post_norm, RMS_EPS)
            gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)
            residual = residual + F.linear(F.silu(gate) * up, layer.down)
        last = F.rms_norm(residual[p.last_index], (h,), self.final_norm, RMS_EPS)
        return F.linear(last, self.lm_head)


def pick_attention(device: torch.device, spec: ModelSpec, dtype: torch.dtype) -> tuple[Attention, str]:
    """The attention to time and why: varlen on CUDA when it runs, replays from a CUDA graph and matches
    :func:`attention_sdpa` on a small ragged batch with a cached prefix (within 2e-2), else the SDPA fallback."""
    sdpa = ("torch.nn.functional.scaled_dot_product_attention per run of equal sequences "
            "(lower-right causal mask over a cached prefix)")
    if device.type != "cuda":
        return attention_sdpa, sdpa + "; CPU"
    shapes = ((5, 0), (3, 4), (1, 6), (1, 6))
    p = pass_inputs(shapes, torch.zeros(sum(n for n, _ in shapes), dtype=torch.long), device)
    gen = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(p.input_ids.shape[0], spec.heads, spec.head_dim, generator=gen, device=device, dtype=dtype)
    k, v = (torch.randn(p.kv_tokens, spec.kv_heads, spec.head_dim, generator=gen, device=device, dtype=dtype)
            for _ in range(2))
    try:
        gap = (attention_varlen(q, k, v, p) - attention_sdpa(q, k, v, p)).abs().max().item()
        time_call(lambda: attention_varlen(q, k, v, p), device, 1)  # it must replay from a CUDA graph too
    except (RuntimeError, NotImplementedError) as err:
        return attention_sdpa, f"{sdpa}; varlen failed: {str(err).splitlines()[0]}"
    if gap > 2e-2:
        return attention_sdpa, f"{sdpa}; varlen differed by {gap:.3g}"
    return attention_varlen, ("torch.ops.aten._flash_attention_forward (PyTorch's FlashAttention-2, cu_seqlens "
                              f"varlen, one call per layer; matched SDPA within {gap:.1g})")


def time_call(fn: Callable[[], object], device: torch.device, repeats: int) -> list[float]:
    """Seconds of ``repeats`` runs of ``fn`` after :data:`WARMUP` warm-ups: on CUDA replays of a CUDA graph
    captured from ``fn`` (after warming up on a side stream, PyTorch's recipe), each between two CUDA
    events; on CPU calls timed with time.perf_counter."""
    if device.type != "cuda":
        for _ in range(WARMUP):
            fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return times
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(WARMUP):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    times = [start.elapsed_time(end) / 1e3 for start, end in events]
    del graph
    torch.cuda.empty_cache()
    return times


def hardware_rates(device: torch.device, tiny: bool, repeats: int) -> dict[str, float]:
    """Measured bf16 GEMM FLOP/s (n × n × n, n = 8192; 128 when tiny) and device-copy bytes/s (read + written,
    of a 2 GiB buffer; 1 MiB when tiny), the two rates the GPU presets quote as measured."""
    n, size = (128, 1 << 20) if tiny else (8192, 2 << 30)
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    gemm_s = statistics.median(time_call(lambda: a @ b, device, repeats))
    src, dst = (torch.empty(size, device=device, dtype=torch.uint8) for _ in range(2))
    copy_s = statistics.median(time_call(lambda: dst.copy_(src), device, repeats))
    return {"gemm_flops": 2 * n**3 / gemm_s, "copy_bytes_per_s": 2 * size / copy_s}


def fit_model(spec: ModelSpec, gpu: str) -> LatencyModel:
    """The roofline the measurements are fitted to: ``spec`` on ``gpu``'s preset with no scheduler overhead,
    no launch cost and no CUDA-graph token padding (this check replays each pass's own graph)."""
    none = GraphSpec("disabled")
    return LatencyModel(spec, GPUS[gpu], decode_graph=none, prefill_graph=none, pass_overhead_s=0.0,
                        per_seq_overhead_s=0.0, graph_launch_s=0.0, breakable_launch_per_layer_s=0.0,
                        eager_launch_per_layer_s=0.0)


def gpu_preset(device: torch.device, requested: str | None) -> tuple[str, str]:
    """(preset, device name): ``requested``, else the preset named in the CUDA device's name (h200 on CPU).

    Raises:
        CheckError: a CUDA device whose name matches no preset and no ``--gpu``.
    """
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if requested is not None:
        return requested, name
    if device.type != "cuda":
        return "h200", name
    for key, preset in GPU_NAMES.items():
        if key in name:
            return preset, name
    raise CheckError(f"no GPU preset matches {name!r}; name the closest with --gpu {{{','.join(sorted(GPUS))}}}")


def measure(spec: ModelSpec, device: torch.device, repeats: int, log: Callable[[str], None]) -> tuple[dict[str, float], str]:
    """Median seconds of every :data:`ANCHORS` pass on a random-weight ``spec`` model, and the attention used."""
    dtype = torch.bfloat16
    attention, how = pick_attention(device, spec, dtype)
    capacity = max(sum(n + h for n, h in batch) for _, batch in ANCHORS)
    model = Transformer(spec, capacity, device, dtype, attention)
    log(f"{spec.name}: {model.params / 1e9:.2f} B parameters, KV pool {capacity} tokens, attention: {how}")
    gen = torch.Generator().manual_seed(0)
    medians = {}
    with torch.inference_mode():
        for name, batch in ANCHORS:
            ids = torch.randint(spec.vocab, (sum(n for n, _ in batch),), generator=gen)
            p = pass_inputs(batch, ids, device)
            medians[name] = statistics.median(time_call(lambda p=p: model.forward(p), device, repeats))
            log(f"  {name}: {medians[name] * 1e3:.3f} ms")
    return medians, how


def report(spec: ModelSpec, gpu: str, medians: dict[str, float]) -> tuple[LatencyModel, dict]:
    """The fitted model and the report: per anchor the measurement and the roofline's prediction with the
    shipped and the fitted efficiencies; median |error| of each; the measured interference slowdown."""
    anchors = [PassAnchor(name, batch, medians[name], spec.name, "bench/gpu_check.py") for name, batch in ANCHORS]
    shipped = fit_model(spec, gpu)
    fitted = fit_latency(shipped, anchors, MEASURED_BOUNDS)
    rows = []
    for a, s, f in zip(anchors, pass_anchor_rows(shipped, anchors), pass_anchor_rows(fitted, anchors)):
        rows.append({"name": a.name, "batch": [list(shape) for shape in a.batch], "measured_ms": s["published_ms"],
                     "shipped_ms": s["model_ms"], "shipped_error_pct": s["error_pct"], "fitted_ms": f["model_ms"],
                     "fitted_error_pct": f["error_pct"]})
    short, mixed, padded = medians[SHORT], medians[MIXED], medians[PADDED]
    published = {a.name: a.seconds for a in (*PASS_ANCHORS, *INTERFERENCE_ANCHORS) if a.model == MODEL}
    return fitted, {
        "anchors": rows,
        "median_abs_error_pct": {k: statistics.median(abs(r[f"{k}_error_pct"]) for r in rows) for k in ("shipped", "fitted")},
        "interference": {"short_ms": short * 1e3, "mixed_ms": mixed * 1e3, "padded_ms": padded * 1e3,
                         "ragged_slowdown": mixed / short, "padded_slowdown": padded / short,
                         "published": {"model": MODEL, "short_ms": published[SHORT] * 1e3,
                                       "mixed_ms": published[MIXED] * 1e3, "slowdown": published[MIXED] / published[SHORT]}},
        "shipped": {name: getattr(shipped, name) for name in CALIBRATED_FIELDS},
        "fitted_mfu": fitted.mfu, "fitted_mbu": fitted.mbu,
    }


def run(out: Path, device_name: str, tiny: bool, repeats: int, gpu: str | None,
        log: Callable[[str], None] = print) -> dict:
    """The whole check: measure, fit, write the calibration to ``out``; returns what was written.

    Raises:
        CheckError: no CUDA for ``device_name`` "cuda", a full-size model on CPU, no GPU preset, out of memory.
        ValueError: ``repeats`` < 1.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if device_name == "cuda" and not torch.cuda.is_available():
        raise CheckError(f"--device cuda, but torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA "
                         "device; check nvidia-smi, or run the code path with --device cpu --tiny")
    if device_name == "cpu" and not tiny:
        raise CheckError(f"the {MODEL} shape ({MODELS[MODEL].params / 1e9:.1f} B parameters) needs a GPU; use --tiny on CPU")
    device = torch.device(device_name)
    spec = TINY if tiny else MODELS[MODEL]
    preset, name = gpu_preset(device, gpu)
    started = time.perf_counter()
    try:
        medians, how = measure(spec, device, repeats, log)
        hardware = hardware_rates(device, tiny, repeats)
    except torch.cuda.OutOfMemoryError as err:
        raise CheckError(f"out of GPU memory on {name}: {str(err).splitlines()[0]}") from None
    fitted, body = report(spec, preset, medians)
    hardware |= {"preset_measured_flops": GPUS[preset].measured_flops, "preset_measured_bw": GPUS[preset].measured_bw}
    measured = {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda, "model": spec.name,
                "shape": {k: getattr(spec, k) for k in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab")},
                "dtype": "bfloat16", "attention": how, "cuda_graphs": device.type == "cuda",
                "timer": "CUDA events" if device.type == "cuda" else "time.perf_counter", "repeats": repeats,
                "warmup": WARMUP, "seconds": time.perf_counter() - started}
    document = calibration_document(preset, fitted, {"measured": measured, "hardware": hardware, **body})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=2) + "\n")
    log(f"fitted against {preset}: compute_efficiency {fitted.compute_efficiency:.3g} (mfu {fitted.mfu:.3g}), "
        f"memory_efficiency {fitted.memory_efficiency:.3g} (mbu {fitted.mbu:.3g}); median |error| shipped "
        f"{body['median_abs_error_pct']['shipped']:.1f}%, fitted {body['median_abs_error_pct']['fitted']:.1f}%")
    inter = body["interference"]
    log(f"7 x 64 + 2048 over 8 x 64: ragged {inter['ragged_slowdown']:.1f}x, padded {inter['padded_slowdown']:.1f}x "
        f"(published {inter['published']['slowdown']:.1f}x); GEMM {hardware['gemm_flops'] / 1e12:.3g} TFLOP/s, "
        f"copy {hardware['copy_bytes_per_s'] / 1e12:.3g} TB/s")
    log(f"wrote {out} ({time.perf_counter() - started:.0f} s); use it with sim.calibration: {out}")
    return document


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the flags and run; a :class:`CheckError` or bad flag value exits with status 2 and its message."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="calibration JSON to write")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where to run (default: cuda)")
    parser.add_argument("--tiny", action="store_true", help=f"a tiny model instead of {MODEL} (CPU test of the code path)")
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                        help=f"timed runs per anchor after {WARMUP} warm-ups; the median counts (default: {DEFAULT_REPEATS})")
    parser.add_argument("--gpu", choices=sorted(GPUS),
                        help="GPU preset the efficiencies are fractions of (default: from the CUDA device's name; h200 on CPU)")
    args = parser.parse_args(argv)
    try:
        run(args.out, args.device, args.tiny, args.repeats, args.gpu)
    except (CheckError, ValueError) as err:
        parser.exit(2, f"gpu_check: {err}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
