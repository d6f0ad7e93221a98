"""Roofline latency model of one forward pass (DESIGN.md §6): pure, no I/O, no clock.

A forward pass runs sequences ``i`` with ``L_i`` new tokens on top of ``H_i``
cached context tokens (a decode step has ``L_i = 1``). With ``N = Σ L_i`` and
``S`` sequences:

* FLOPs ≈ 2·P_layers·N + 2·vocab·hidden·S + 4·layers·(heads·head_dim)·Σ L_i·(H_i + (L_i+1)/2)
  (DESIGN §6's ``2·P·N`` with ``P`` split: the transformer layers' matmuls run
  for every new token, the LM head only for each sequence's last token, since
  SGLang computes logits only where it samples; the embedding table is a lookup);
* bytes ≈ weight_bytes + kv_bytes_per_token·(Σ L_i + Σ (H_i + L_i))
  (weights read once; new KV written, the whole context's KV read by attention);
* t ≈ max(FLOPs / (peak·mfu), bytes / (bw·mbu)) + overhead, where overhead is a
  CUDA-graph replay (decode batches of at most ``cuda_graph_max_bs_decode``
  sequences) or eager kernel launches per layer, plus scheduler time per sequence.

With tensor parallelism ``tp`` each GPU does 1/tp of the FLOPs and bytes and the
pass adds two all-reduces of the activations per layer over NVLink.

Calibration (Qwen2.5-7B on one H200, :data:`ANCHORS_QWEN25_7B_H200`, the LAPS
slides; :func:`anchor_report` prints it): with the default efficiencies
(mfu ≈ 0.64, mbu ≈ 0.85) the model gives 16 tokens 5.0 ms (+3%), 256 tokens
6.9 ms (+27%), 1024 tokens 23.1 ms (+68%), 2048 tokens 45.2 ms (−12%) and
8×64 tokens 12.2 ms (−36%). The anchors disagree with each other, so no roofline
fits all: 256 → 5.4 ms and 1024 → 13.7 ms need ≈ 1 PFLOP/s (the H200's whole
dense-bf16 peak), 2048 → 51.6 ms implies 0.53 PFLOP/s, and 8×64 → 19 ms is
slower than one 1024-token pass. The constants are physical (a forward pass at
~80% of measured GEMM speed), not bent to one number.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

# (new tokens L, cached context H) per sequence.
SeqShape = tuple[int, int]


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

    Units: FLOP/s (dense bf16, no sparsity), bytes/s, bytes.
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

GPUS: dict[str, GpuSpec] = {
    # NVIDIA H200 datasheet: 989 TFLOP/s dense bf16 (1,979 with sparsity), 4.8 TB/s HBM3e,
    # 141 GB, NVLink 900 GB/s (both directions). Measured: ~790 TFLOP/s bf16 GEMM,
    # ~4.3 TB/s device copy (DESIGN §6).
    "h200": GpuSpec("h200", 989e12, 790e12, 4.8e12, 4.3e12, 141e9, 450e9),
    # NVIDIA H100 SXM datasheet: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, 80 GB, NVLink 900 GB/s.
    # Measured (public GEMM / copy microbenchmarks, approximate): ~760 TFLOP/s, ~3.0 TB/s.
    "h100": GpuSpec("h100", 989e12, 760e12, 3.35e12, 3.0e12, 80e9, 450e9),
    # NVIDIA A100 SXM 80GB datasheet: 312 TFLOP/s dense bf16, 2.039 TB/s HBM2e, NVLink 600 GB/s.
    # Measured (public microbenchmarks, approximate): ~280 TFLOP/s, ~1.8 TB/s.
    "a100": GpuSpec("a100", 312e12, 280e12, 2.0e12, 1.8e12, 80e9, 300e9),
}
"""GPU presets by ``--sim-gpu`` name."""


@dataclass(frozen=True, slots=True)
class Breakdown:
    """One predicted forward pass. FLOPs and bytes are per GPU; times in seconds."""

    flops: float
    bytes: float
    compute_s: float
    memory_s: float
    comm_s: float
    overhead_s: float
    cuda_graph: bool

    @property
    def total_s(self) -> float:
        """Roofline time plus communication plus overhead."""
        return max(self.compute_s, self.memory_s) + self.comm_s + self.overhead_s

    @property
    def compute_bound(self) -> bool:
        """True when the FLOPs, not the bytes, set the roofline time."""
        return self.compute_s >= self.memory_s


@dataclass(frozen=True, slots=True)
class LatencyModel:
    """Forward-pass time of ``model`` on ``tp`` GPUs of type ``gpu``.

    ``compute_efficiency`` and ``memory_efficiency`` scale the *measured* GEMM and
    copy rates to a whole forward pass (attention, norms and activations run below
    GEMM speed): the defaults give mfu = 0.80·0.80 ≈ 0.64 of peak FLOP/s and
    mbu = 0.90·0.95 ≈ 0.85 of peak bandwidth on an H200. Overheads in seconds:
    ``graph_overhead_s`` per CUDA-graph replay; eager passes pay
    ``launch_overhead_per_layer_s`` per layer plus ``eager_base_overhead_s``;
    every pass pays ``per_seq_overhead_s`` per sequence (scheduling, metadata, sampling).
    """

    model: ModelSpec
    gpu: GpuSpec
    tp_size: int = 1
    cuda_graph_max_bs_decode: int = 256
    disable_cuda_graph: bool = False
    compute_efficiency: float = 0.80
    memory_efficiency: float = 0.95
    graph_overhead_s: float = 0.35e-3
    eager_base_overhead_s: float = 0.3e-3
    launch_overhead_per_layer_s: float = 45e-6
    per_seq_overhead_s: float = 10e-6
    allreduce_latency_s: float = 8e-6

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: effective FLOP/s over peak."""
        return self.gpu.measured_flops * self.compute_efficiency / self.gpu.peak_flops

    @property
    def mbu(self) -> float:
        """Memory bandwidth utilisation: effective bytes/s over peak."""
        return self.gpu.measured_bw * self.memory_efficiency / self.gpu.peak_bw

    def uses_cuda_graph(self, batch: Sequence[SeqShape]) -> bool:
        """Whether SGLang would replay a captured decode graph: all L_i = 1 and S ≤ cuda_graph_max_bs_decode."""
        return (
            not self.disable_cuda_graph
            and 0 < len(batch) <= self.cuda_graph_max_bs_decode
            and all(new == 1 for new, _ in batch)
        )

    def breakdown(self, batch: Sequence[SeqShape]) -> Breakdown:
        """FLOPs, bytes and times of one forward pass over ``batch`` ((L_i, H_i) pairs).

        Raises:
            ValueError: on an empty batch, L_i < 1 or H_i < 0.
        """
        if not batch:
            raise ValueError("a forward pass needs at least one sequence")
        m, tp = self.model, self.tp_size
        n_tokens = 0
        attn_pairs = 0.0
        kv_tokens = 0
        for new, cached in batch:
            if new < 1 or cached < 0:
                raise ValueError(f"bad sequence shape (L={new}, H={cached})")
            n_tokens += new
            attn_pairs += new * (cached + (new + 1) / 2)
            kv_tokens += new + cached + new
        seqs = len(batch)
        flops = (
            2 * m.layers * m.layer_params * n_tokens
            + 2 * m.vocab * m.hidden * seqs
            + 4 * m.layers * (m.heads * m.head_dim) * attn_pairs
        ) / tp
        nbytes = (m.weight_bytes + m.kv_bytes_per_token * kv_tokens) / tp
        compute_s = flops / (self.gpu.peak_flops * self.mfu)
        memory_s = nbytes / (self.gpu.peak_bw * self.mbu)
        comm_s = 0.0
        if tp > 1:
            per_allreduce = 2 * (tp - 1) / tp * n_tokens * m.hidden * m.dtype_bytes / self.gpu.nvlink_bw
            comm_s = 2 * m.layers * (per_allreduce + self.allreduce_latency_s)
        graph = self.uses_cuda_graph(batch)
        if graph:
            overhead = self.graph_overhead_s
        else:
            overhead = self.eager_base_overhead_s + m.layers * self.launch_overhead_per_layer_s
        overhead += self.per_seq_overhead_s * seqs
        return Breakdown(flops, nbytes, compute_s, memory_s, comm_s, overhead, graph)

    def predict(self, batch: Sequence[SeqShape]) -> float:
        """Seconds one forward pass over ``batch`` ((L_i new, H_i cached) pairs) takes.

        Raises:
            ValueError: as :meth:`breakdown`.
        """
        return self.breakdown(batch).total_s

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


ANCHORS_QWEN25_7B_H200: tuple[tuple[str, tuple[SeqShape, ...], float], ...] = (
    ("prefill 16", ((16, 0),), 4.9e-3),
    ("prefill 256", ((256, 0),), 5.4e-3),
    ("prefill 1024", ((1024, 0),), 13.7e-3),
    ("prefill 2048", ((2048, 0),), 51.6e-3),
    ("8 x prefill 64", ((64, 0),) * 8, 19e-3),
)
"""Published forward-pass times (LAPS slides, DESIGN §6): (label, batch, seconds)."""


def anchor_report(model: LatencyModel) -> list[tuple[str, float, float, float]]:
    """(label, anchor s, predicted s, relative error) for each of :data:`ANCHORS_QWEN25_7B_H200`."""
    rows = []
    for label, batch, anchor in ANCHORS_QWEN25_7B_H200:
        predicted = model.predict(batch)
        rows.append((label, anchor, predicted, predicted / anchor - 1))
    return rows


def make_latency_model(
    model: str = "qwen2.5-7b",
    gpu: str = "h200",
    tp_size: int = 1,
    cuda_graph_max_bs_decode: int = 256,
    disable_cuda_graph: bool = False,
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
    return LatencyModel(MODELS[model], GPUS[gpu], tp_size, cuda_graph_max_bs_decode, disable_cuda_graph)
