"""Roofline latency model of one forward pass (DESIGN.md §6): pure, no I/O, no clock.

A forward pass runs sequences ``i`` with ``L_i`` new tokens on top of ``H_i``
cached context tokens (a decode step has ``L_i = 1``). With ``N = Σ L_i``,
``S`` sequences and ``N'`` the token count the linear layers really run
(``N`` padded up to the CUDA-graph bucket that replays the pass, else ``N``):

* FLOPs ≈ 2·P_layers·N' + 2·vocab·hidden·S + 4·layers·(heads·head_dim)·Σ L_i·(H_i + (L_i+1)/2)
  (DESIGN §6's ``2·P·N`` with ``P`` split: the transformer layers' matmuls run
  for every new token, the LM head only for each sequence's last token, since
  SGLang computes logits only where it samples; the embedding table is a lookup);
* bytes ≈ weight_bytes + kv_bytes_per_token·(Σ L_i + Σ (H_i + L_i))
  (weights read once; new KV written, the whole context's KV read by attention);
* t ≈ max(FLOPs / (peak·mfu), bytes / (bw·mbu), launch) + comm + fixed.

``launch`` is the host time to issue the pass's kernels, which overlaps GPU
work: eager passes pay ``eager_launch_per_layer_s`` per layer, breakable
CUDA graphs (SGLang 0.5.23's default prefill backend: graph segments with
attention launched eagerly between them) ``breakable_launch_per_layer_s`` per
layer, a full graph one ``graph_launch_s``. ``fixed`` is what no overlap hides:
``pass_overhead_s`` per pass (scheduling, metadata, sampling) plus
``per_seq_overhead_s`` per sequence. This departs from DESIGN §6's purely
additive "+ launch overhead": a kernel launched while the GPU still runs the
previous one costs nothing, so launch time only shows when it exceeds the
roofline time (small eager batches), which is why CUDA graphs speed up decode.

Which passes a graph covers follows SGLang 0.5.23
(``arg_groups/cuda_graph_hook.py``, ``model_executor/cuda_graph_config.py``):
decode batches of at most ``--cuda-graph-max-bs-decode`` sequences replay the
smallest captured batch size ≥ S; prefill (extend) passes of at most
``--cuda-graph-max-bs-prefill`` tokens replay the smallest captured token
bucket ≥ N (``--cuda-graph-bs-prefill``; for prefill these are token counts),
and the ``full`` backend only with at most ``chunked_prefill_size // 512``
sequences. With tensor parallelism ``tp`` each GPU does 1/tp of the FLOPs and
bytes and the pass adds two all-reduces of the activations per layer.

The two efficiencies are fitted to the published anchors
(:mod:`engines.sim.calibration`, ``python bench/sim_calibration.py``): on an
H200 mfu = 0.61 and mbu = 0.66 of peak. The anchors disagree with each other,
so the fit is a log least-squares compromise, not a match to any one of them:
16 tokens 4.9 ms (0%), 256 tokens 6.0 ms (+10%), 1024 tokens 22.8 ms (+67%),
2048 tokens 46.0 ms (−11%), 8 × 64 tokens 11.5 ms (−39%).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Literal, Sequence

# (new tokens L, cached context H) per sequence.
SeqShape = tuple[int, int]
GraphBackend = Literal["full", "breakable", "disabled"]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A decoder-only transformer's shape (Qwen2-style: GQA, SwiGLU MLP, q/k/v biases, untied LM head).

    Parameter counts are computed from the shape, not quoted.
    """

    name: str
    hf_name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    context_length: int = 32768
    dtype_bytes: int = 2  # bf16

    @property
    def head_dim(self) -> int:
        """Per-head width, hidden / heads."""
        return self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        """Parameters of one transformer layer: attention (with q/k/v biases), SwiGLU MLP, two RMSNorms."""
        kv_width = self.kv_heads * self.head_dim
        attn = 2 * self.hidden * self.hidden + 2 * self.hidden * kv_width + self.hidden + 2 * kv_width
        mlp = 3 * self.hidden * self.intermediate
        return attn + mlp + 2 * self.hidden

    @property
    def params(self) -> int:
        """All parameters: layers, embedding table, untied LM head, final norm."""
        return self.layers * self.layer_params + 2 * self.vocab * self.hidden + self.hidden

    @property
    def weight_bytes(self) -> int:
        """Bytes a forward pass reads from weights: all but the embedding table (only a few rows are gathered)."""
        return (self.params - self.vocab * self.hidden) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes per token: layers·2·kv_heads·head_dim·dtype_bytes (Qwen2.5-7B: 57,344 B)."""
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One accelerator: vendor peaks and measured achievable rates, all per GPU.

    Units: FLOP/s (dense bf16, no sparsity), bytes/s, bytes. ``memory_bytes``
    is the total nvidia-smi reports (what SGLang sizes its pools from).
    """

    name: str
    peak_flops: float
    measured_flops: float
    peak_bw: float
    measured_bw: float
    memory_bytes: float
    nvlink_bw: float  # per direction


MODELS: dict[str, ModelSpec] = {
    # Shapes from the models' config.json (DESIGN §6).
    "qwen2.5-7b": ModelSpec("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct", 3584, 28, 28, 4, 18944, 152064),
    "qwen2.5-14b": ModelSpec("qwen2.5-14b", "Qwen/Qwen2.5-14B-Instruct", 5120, 48, 40, 8, 13824, 152064),
    "qwen2.5-32b": ModelSpec("qwen2.5-32b", "Qwen/Qwen2.5-32B-Instruct", 5120, 64, 40, 8, 27648, 152064),
}
"""Model presets by ``--sim-model`` name."""

MIB = 1 << 20
GPUS: dict[str, GpuSpec] = {
    # NVIDIA H200 datasheet: 989 TFLOP/s dense bf16 (1,979 with sparsity), 4.8 TB/s HBM3e,
    # "141 GB" (nvidia-smi: 143,771 MiB), NVLink 900 GB/s (both directions).
    # Measured: ~790 TFLOP/s bf16 GEMM, ~4.3 TB/s device copy (DESIGN §6).
    "h200": GpuSpec("h200", 989e12, 790e12, 4.8e12, 4.3e12, 143_771 * MIB, 450e9),
    # NVIDIA H100 SXM datasheet: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, 80 GB (nvidia-smi: 81,559 MiB),
    # NVLink 900 GB/s. Measured (public GEMM / copy microbenchmarks, approximate): ~760 TFLOP/s, ~3.0 TB/s.
    "h100": GpuSpec("h100", 989e12, 760e12, 3.35e12, 3.0e12, 81_559 * MIB, 450e9),
    # NVIDIA A100 SXM 80GB datasheet: 312 TFLOP/s dense bf16, 2.039 TB/s HBM2e (nvidia-smi: 81,920 MiB),
    # NVLink 600 GB/s. Measured (public microbenchmarks, approximate): ~280 TFLOP/s, ~1.8 TB/s.
    "a100": GpuSpec("a100", 312e12, 280e12, 2.0e12, 1.8e12, 81_920 * MIB, 300e9),
}
"""GPU presets by ``--sim-gpu`` name."""


def prefill_graph_buckets(max_tokens: int) -> tuple[int, ...]:
    """SGLang 0.5.23's default prefill CUDA-graph token buckets up to ``max_tokens``.

    4..32 step 4, 48..256 step 16, 288..512 step 32, 576..1024 step 64,
    1280..4096 step 256, then step 512 (``generate_prefill_cuda_graph_batch_sizes``).
    """
    sizes = (
        list(range(4, 33, 4)) + list(range(48, 257, 16)) + list(range(288, 513, 32))
        + list(range(576, 1025, 64)) + list(range(1280, 4097, 256)) + list(range(4608, max_tokens + 1, 512))
    )
    return tuple(s for s in sizes if s <= max_tokens)


def decode_graph_buckets(max_bs: int) -> tuple[int, ...]:
    """SGLang 0.5.23's default decode CUDA-graph batch sizes up to ``max_bs`` (no speculative decoding).

    1, 2, 4, 8, 12, then 16..256 step 8, 272..496 step 16, 512.. step 32, and
    ``max_bs`` itself (``generate_decode_cuda_graph_batch_sizes``).
    """
    sizes = [1, 2, 4, 8, 12] + list(range(16, 257, 8)) + list(range(272, 512, 16)) + list(range(512, max_bs + 1, 32))
    sizes = [s for s in sizes if s <= max_bs]
    if max_bs not in sizes:
        sizes.append(max_bs)
    return tuple(sizes)


@dataclass(frozen=True, slots=True)
class GraphSpec:
    """CUDA-graph coverage of one phase: the backend and its captured sizes (sorted, ascending).

    Decode sizes are batch sizes (sequences), prefill sizes token counts.
    ``max_seqs`` (prefill ``full`` backend only) is the request-slot count baked
    into each graph; a pass with more sequences runs eagerly.
    """

    backend: GraphBackend
    sizes: tuple[int, ...] = ()
    max_seqs: int | None = None

    def bucket(self, size: int, seqs: int = 1) -> int | None:
        """The captured size that replays a pass of ``size`` (and ``seqs`` sequences), or None: eager.

        The smallest captured size ≥ ``size``; None when the backend is
        disabled, ``size`` exceeds the largest one, or ``seqs`` exceeds ``max_seqs``.
        """
        if self.backend == "disabled" or not self.sizes or size > self.sizes[-1]:
            return None
        if self.max_seqs is not None and seqs > self.max_seqs:
            return None
        return self.sizes[bisect.bisect_left(self.sizes, size)]


DEFAULT_DECODE_GRAPH = GraphSpec("full", decode_graph_buckets(256))
DEFAULT_PREFILL_GRAPH = GraphSpec("breakable", prefill_graph_buckets(8192))


@dataclass(frozen=True, slots=True)
class Breakdown:
    """One predicted forward pass. FLOPs and bytes are per GPU; times in seconds.

    ``graph`` is the captured size that replayed the pass (batch size for
    decode, tokens for prefill), None when it ran eagerly.
    """

    flops: float
    bytes: float
    compute_s: float
    memory_s: float
    launch_s: float
    comm_s: float
    fixed_s: float
    graph: int | None

    @property
    def total_s(self) -> float:
        """max(compute, memory, launch) + communication + fixed overhead."""
        return max(self.compute_s, self.memory_s, self.launch_s) + self.comm_s + self.fixed_s

    @property
    def compute_bound(self) -> bool:
        """True when the FLOPs, not the bytes, set the roofline time."""
        return self.compute_s >= self.memory_s


@dataclass(frozen=True, slots=True)
class LatencyModel:
    """Forward-pass time of ``model`` on ``tp_size`` GPUs of type ``gpu`` (see the module doc).

    ``compute_efficiency`` and ``memory_efficiency`` scale the *measured* GEMM
    and copy rates to a whole forward pass: mfu = measured_flops ·
    compute_efficiency / peak_flops, mbu likewise; they are the fit of
    :func:`engines.sim.calibration.fit_latency` to the published anchors with
    ``pass_overhead_s`` = 0.4 ms (scheduling, sampling and metadata a step
    does not overlap: fitting it too leaves the short anchors underdetermined,
    since only the 16-token one is memory-bound). Launch costs are host time: ``eager_launch_per_layer_s`` (≈15
    kernels per layer at ~15 µs of PyTorch dispatch each),
    ``breakable_launch_per_layer_s`` (one graph segment and one attention kernel
    per layer), ``graph_launch_s`` (one whole-graph replay). All seconds.
    """

    model: ModelSpec
    gpu: GpuSpec
    tp_size: int = 1
    decode_graph: GraphSpec = DEFAULT_DECODE_GRAPH
    prefill_graph: GraphSpec = DEFAULT_PREFILL_GRAPH
    compute_efficiency: float = 0.766
    memory_efficiency: float = 0.733
    pass_overhead_s: float = 0.4e-3
    per_seq_overhead_s: float = 10e-6
    graph_launch_s: float = 30e-6
    breakable_launch_per_layer_s: float = 25e-6
    eager_launch_per_layer_s: float = 220e-6
    allreduce_latency_s: float = 8e-6
    _const: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        m, tp = self.model, self.tp_size
        flop_rate = self.gpu.measured_flops * self.compute_efficiency
        byte_rate = self.gpu.measured_bw * self.memory_efficiency
        object.__setattr__(self, "_const", (
            2 * m.layers * m.layer_params / tp / flop_rate,  # s per linear-layer token
            2 * m.vocab * m.hidden / tp / flop_rate,  # s per sequence (LM head)
            4 * m.layers * m.heads * m.head_dim / tp / flop_rate,  # s per attention (query, key) pair
            m.weight_bytes / tp / byte_rate,  # s to read the weights
            m.kv_bytes_per_token / tp / byte_rate,  # s per KV token moved
        ))

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: effective FLOP/s over peak."""
        return self.gpu.measured_flops * self.compute_efficiency / self.gpu.peak_flops

    @property
    def mbu(self) -> float:
        """Memory bandwidth utilisation: effective bytes/s over peak."""
        return self.gpu.measured_bw * self.memory_efficiency / self.gpu.peak_bw

    def breakdown(self, batch: Sequence[SeqShape]) -> Breakdown:
        """FLOPs, bytes and times of one forward pass over ``batch`` ((L_i, H_i) pairs).

        A batch whose every L_i is 1 is a decode pass; any other is an extend
        (prefill) pass, priced with the prefill graph.

        Raises:
            ValueError: on an empty batch, L_i < 1 or H_i < 0.
        """
        if not batch:
            raise ValueError("a forward pass needs at least one sequence")
        tokens = pairs = kv = 0
        for new, cached in batch:
            if new < 1 or cached < 0:
                raise ValueError(f"bad sequence shape (L={new}, H={cached})")
            tokens += new
            pairs += new * cached + new * (new + 1) // 2
            kv += new + cached + new
        return self.breakdown_totals(len(batch), tokens, pairs, kv, decode=tokens == len(batch))

    def breakdown_totals(self, seqs: int, tokens: int, attn_pairs: float, kv_tokens: int, decode: bool) -> Breakdown:
        """:meth:`breakdown` from a batch's totals: S sequences, N new tokens, Σ L_i(H_i + (L_i+1)/2)
        attention pairs and Σ (2·L_i + H_i) KV tokens moved; ``decode`` picks the decode graph."""
        m, tp = self.model, self.tp_size
        c_tok, c_seq, c_pair, c_weights, c_kv = self._const
        if decode:
            graph = self.decode_graph.bucket(seqs)
            linear_tokens = graph or tokens
        else:
            graph = self.prefill_graph.bucket(tokens, seqs)
            linear_tokens = graph or tokens
        backend = self.decode_graph.backend if decode else self.prefill_graph.backend
        if graph is None:
            launch = m.layers * self.eager_launch_per_layer_s
        elif backend == "breakable":
            launch = m.layers * self.breakable_launch_per_layer_s
        else:
            launch = self.graph_launch_s
        compute_s = c_tok * linear_tokens + c_seq * seqs + c_pair * attn_pairs
        memory_s = c_weights + c_kv * kv_tokens
        comm_s = 0.0
        if tp > 1:
            per_allreduce = 2 * (tp - 1) / tp * tokens * m.hidden * m.dtype_bytes / self.gpu.nvlink_bw
            comm_s = 2 * m.layers * (per_allreduce + self.allreduce_latency_s)
        fixed = self.pass_overhead_s + self.per_seq_overhead_s * seqs
        flop_rate = self.gpu.measured_flops * self.compute_efficiency
        byte_rate = self.gpu.measured_bw * self.memory_efficiency
        return Breakdown(compute_s * flop_rate, memory_s * byte_rate, compute_s, memory_s, launch, comm_s, fixed,
                         graph)

    def predict(self, batch: Sequence[SeqShape]) -> float:
        """Seconds one forward pass over ``batch`` ((L_i new, H_i cached) pairs) takes.

        Raises:
            ValueError: as :meth:`breakdown`.
        """
        return self.breakdown(batch).total_s

    def predict_totals(self, seqs: int, tokens: int, attn_pairs: float, kv_tokens: int, decode: bool) -> float:
        """Seconds of a pass given by its totals (see :meth:`breakdown_totals`); the engine's hot path."""
        return self.breakdown_totals(seqs, tokens, attn_pairs, kv_tokens, decode).total_s

    def max_total_tokens(self, mem_fraction_static: float) -> int:
        """KV-pool size in tokens: (GPU memory · mem_fraction_static − weights/tp) / (KV bytes per token/tp).

        Raises:
            ValueError: when the weights do not fit in the static fraction.
        """
        m = self.model
        free = self.gpu.memory_bytes * mem_fraction_static - m.params * m.dtype_bytes / self.tp_size
        if free <= 0:
            raise ValueError(
                f"{m.name} weights ({m.params * m.dtype_bytes / 1e9:.1f} GB over tp={self.tp_size}) do not fit in "
                f"{mem_fraction_static:.2f} of a {self.gpu.name}'s {self.gpu.memory_bytes / 1e9:.0f} GB"
            )
        return int(free // (m.kv_bytes_per_token / self.tp_size))


def make_latency_model(
    model: str = "qwen2.5-7b",
    gpu: str = "h200",
    tp_size: int = 1,
    decode_graph: GraphSpec = DEFAULT_DECODE_GRAPH,
    prefill_graph: GraphSpec = DEFAULT_PREFILL_GRAPH,
) -> LatencyModel:
    """A :class:`LatencyModel` from preset names (keys of :data:`MODELS` and :data:`GPUS`).

    Raises:
        ValueError: on an unknown preset name or tp_size < 1.
    """
    if model not in MODELS:
        raise ValueError(f"unknown sim model {model!r}; choose from {sorted(MODELS)}")
    if gpu not in GPUS:
        raise ValueError(f"unknown sim gpu {gpu!r}; choose from {sorted(GPUS)}")
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    return LatencyModel(MODELS[model], GPUS[gpu], tp_size, decode_graph, prefill_graph)
