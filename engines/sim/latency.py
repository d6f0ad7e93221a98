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

**Decode spread** (``decode_spread_fraction`` κ, flag ``--sim-decode-spread``). A decode
step's attention reads each sequence's whole KV context: with ``s_i = H_i + 1`` tokens
attended by the new token of sequence i, attention does ~2·s_i·h multiply-adds per layer per
head dimension (h = heads·head_dim) and reads s_i tokens of KV, so under the roofline its time
is proportional to Σ s_i, whatever the spread of the s_i. That holds for a *ragged* paged-attention
kernel that balances work across SMs: FlashInfer's and FA3's decode kernels split a long
sequence's KV into chunks (split-KV / flash-decoding), schedule the chunks over all SMs and merge
the partial softmaxes, so 4 long sequences among 60 short ones cost what their tokens cost. A
*padded* (non-ragged) kernel pays every sequence as if it were the longest, n·max(s); a kernel
that gives each (sequence, KV head) a fixed share of the SMs without splitting finishes when the
longest sequence does, which costs part of that padding. The model charges a share κ of the
padding waste as extra KV bytes read:

    decode attention tokens = Σ s_i + κ·(n·max(s) − Σ s_i)   (over the decode sequences of the pass)

κ = 0 is the pure roofline (the default: SGLang 0.5.23 decodes with FlashInfer or FA3 on
Hopper, both split-KV kernels, and every anchor above was fitted with κ = 0); κ = 1 is a fully
padded kernel. :data:`DECODE_SPREAD_PRESETS` names ``roofline`` (0) and ``alignedserve``
(:data:`ALIGNEDSERVE_DECODE_SPREAD`, fitted by :func:`fit_alignedserve_spread` to AlignedServe's
figure: Llama-7B on an H100, 64 decoding requests with 600 generated tokens each take 13.49 ms per
iteration when all prompts are 32 tokens and 21.73 ms (+61%) when 4 of them have 4,096-token
prompts). How much of that +61% a roofline explains: with the bandwidth fitted to the 13.49 ms
point (83% of the H100's peak), the extra Σ s_i alone (16,256 more KV tokens) gives 16.57 ms
(+23%, 37% of the increase); the other 5.17 ms (63%) is imbalance, which needs κ = 0.112 (11% of
the 243,840 padding tokens; a fully padded kernel, κ = 1, would take 63 ms).
That imbalance is what split-KV kernels remove, so under the default model grouping requests by
length changes a step's time only through Σ s_i, which placement moves between engines but does
not reduce; with κ > 0 it also removes padding, the effect AlignedServe exploits.
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
    decode, tokens for prefill), None when it ran eagerly. ``spread_s``: the part of
    ``memory_s`` charged for the decode sequences' length spread (κ·padding, module doc).
    """

    flops: float
    bytes: float
    compute_s: float
    memory_s: float
    launch_s: float
    comm_s: float
    fixed_s: float
    graph: int | None
    spread_s: float = 0.0

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
    ``decode_spread_fraction``: κ in [0, 1], the share of the decode padding waste
    n·max(s) − Σ s that attention pays (module doc; 0: pure roofline).
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
    decode_spread_fraction: float = 0.0
    _const: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.decode_spread_fraction <= 1.0:
            raise ValueError(f"decode_spread_fraction must be in [0, 1], got {self.decode_spread_fraction}")
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
        (prefill) pass, priced with the prefill graph. The sequences with L_i = 1 are the
        decodes whose spread ``decode_spread_fraction`` charges (module doc).

        Raises:
            ValueError: on an empty batch, L_i < 1 or H_i < 0.
        """
        if not batch:
            raise ValueError("a forward pass needs at least one sequence")
        tokens = pairs = kv = 0
        decodes = decode_ctx = longest = 0
        for new, cached in batch:
            if new < 1 or cached < 0:
                raise ValueError(f"bad sequence shape (L={new}, H={cached})")
            tokens += new
            pairs += new * cached + new * (new + 1) // 2
            kv += new + cached + new
            if new == 1:
                decodes += 1
                decode_ctx += cached
                longest = max(longest, cached)
        return self.breakdown_totals(len(batch), tokens, pairs, kv, decode=tokens == len(batch),
                                     decode_padding_tokens=decodes * longest - decode_ctx)

    def breakdown_totals(self, seqs: int, tokens: int, attn_pairs: float, kv_tokens: int, decode: bool,
                         decode_padding_tokens: float = 0.0) -> Breakdown:
        """:meth:`breakdown` from a batch's totals: S sequences, N new tokens, Σ L_i(H_i + (L_i+1)/2)
        attention pairs and Σ (2·L_i + H_i) KV tokens moved; ``decode`` picks the decode graph;
        ``decode_padding_tokens``: n·max(H) − Σ H over the pass's decode sequences (0 when they
        are all as long), of which ``decode_spread_fraction`` is read as extra KV (module doc)."""
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
        spread_s = c_kv * self.decode_spread_fraction * decode_padding_tokens
        memory_s = c_weights + c_kv * kv_tokens + spread_s
        comm_s = 0.0
        if tp > 1:
            per_allreduce = 2 * (tp - 1) / tp * tokens * m.hidden * m.dtype_bytes / self.gpu.nvlink_bw
            comm_s = 2 * m.layers * (per_allreduce + self.allreduce_latency_s)
        fixed = self.pass_overhead_s + self.per_seq_overhead_s * seqs
        flop_rate = self.gpu.measured_flops * self.compute_efficiency
        byte_rate = self.gpu.measured_bw * self.memory_efficiency
        return Breakdown(compute_s * flop_rate, memory_s * byte_rate, compute_s, memory_s, launch, comm_s, fixed,
                         graph, spread_s)

    def predict(self, batch: Sequence[SeqShape]) -> float:
        """Seconds one forward pass over ``batch`` ((L_i new, H_i cached) pairs) takes.

        Raises:
            ValueError: as :meth:`breakdown`.
        """
        return self.breakdown(batch).total_s

    def predict_totals(self, seqs: int, tokens: int, attn_pairs: float, kv_tokens: int, decode: bool,
                       decode_padding_tokens: float = 0.0) -> float:
        """Seconds of a pass given by its totals (see :meth:`breakdown_totals`); the engine's hot path."""
        return self.breakdown_totals(seqs, tokens, attn_pairs, kv_tokens, decode, decode_padding_tokens).total_s

    def prefill_s(self, batch: Sequence[SeqShape]) -> float:
        """One extend pass over ``batch`` ((L_i >= 1, H_i) pairs): :meth:`predict` (the scheduler's
        :class:`~policies.ttft_model.PassCost`)."""
        return self.predict(batch)

    def prefill_compute_s(self, new_tokens: int, cached_tokens: int) -> float:
        """The compute part alone of prefilling one sequence of ``new_tokens`` on ``cached_tokens`` (its linear
        layers, LM head and causal attention at the effective FLOP rate; no graph padding, weight reads, launch or
        fixed cost): a lower bound on what its prefill adds to any pass or passes it runs in, however chunked."""
        c_tok, c_seq, c_pair = self._const[:3]
        return c_tok * new_tokens + c_seq + c_pair * (new_tokens * cached_tokens + new_tokens * (new_tokens + 1) / 2)

    def decode_s(self, seqs: int, context_tokens: int) -> float:
        """One decode pass of ``seqs`` sequences holding ``context_tokens`` KV tokens in all (equal lengths assumed:
        no spread charge); the scheduler's :class:`~policies.ttft_model.PassCost`."""
        return self.predict_totals(seqs, seqs, context_tokens + seqs, context_tokens + 2 * seqs, decode=True)

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


LLAMA2_7B = ModelSpec("llama-2-7b", "meta-llama/Llama-2-7b-hf", 4096, 32, 32, 32, 11008, 32000, context_length=4096)
"""Llama-2-7B's shape (AlignedServe's model; not a ``--sim-model`` preset). Its layers have no q/k/v
biases; :attr:`ModelSpec.layer_params` counts 3·4096 bias parameters per layer anyway (0.006% more)."""

ALIGNEDSERVE_ANCHOR_S = (13.49e-3, 21.73e-3)
"""AlignedServe's decode-iteration times, Llama-7B on an H100: 64 requests with 32-token prompts at
600 generated tokens, then 4 of them with 4,096-token prompts instead (the other 60 unchanged)."""


def alignedserve_anchor_batches(generated: int = 600) -> tuple[list[SeqShape], list[SeqShape]]:
    """The two decode batches of :data:`ALIGNEDSERVE_ANCHOR_S` as (L = 1, H = prompt + generated) pairs.

    We read the baseline as all 64 requests with 32-token prompts (the paper's text gives the
    mixed batch and the +61%; that the baseline keeps the batch at 64 is our assumption).
    """
    return [(1, 32 + generated)] * 64, [(1, 32 + generated)] * 60 + [(1, 4096 + generated)] * 4


def fit_alignedserve_spread() -> tuple[float, float]:
    """(memory_efficiency, κ) that make :data:`LLAMA2_7B` on an H100 hit both anchor times exactly.

    Both batches are memory-bound full-graph decode passes, t = fixed + bytes / (bw · e): the
    uniform batch fixes the bandwidth efficiency e, the mixed one then fixes κ (closed form).
    κ is a share of padding, dimensionless, so it carries over to other models and GPUs as
    :data:`ALIGNEDSERVE_DECODE_SPREAD`; e stays specific to this anchor.
    """
    uniform, mixed = alignedserve_anchor_batches()
    probe = LatencyModel(LLAMA2_7B, GPUS["h100"], memory_efficiency=1.0)
    t_uniform, t_mixed = ALIGNEDSERVE_ANCHOR_S
    b_u, b_m = probe.breakdown(uniform), probe.breakdown(mixed)
    efficiency = b_u.memory_s / (t_uniform - b_u.fixed_s)  # memory_s at e = 1 is bytes / bw
    padding = len(mixed) * max(h for _, h in mixed) - sum(h for _, h in mixed)
    per_token_s = LLAMA2_7B.kv_bytes_per_token / (GPUS["h100"].measured_bw * efficiency)
    kappa = ((t_mixed - b_m.fixed_s) - b_m.memory_s / efficiency) / (per_token_s * padding)
    return efficiency, kappa


ALIGNEDSERVE_DECODE_SPREAD = 0.112
"""κ fitted to AlignedServe's anchor (:func:`fit_alignedserve_spread` gives 0.1119)."""

DECODE_SPREAD_PRESETS: dict[str, float] = {"roofline": 0.0, "alignedserve": ALIGNEDSERVE_DECODE_SPREAD}
"""``--sim-decode-spread`` names: the pure roofline (default) and the AlignedServe calibration."""


def decode_spread_fraction(value: str | float) -> float:
    """κ from a :data:`DECODE_SPREAD_PRESETS` name or a number in [0, 1].

    Raises:
        ValueError: an unknown name, or a number outside [0, 1].
    """
    if isinstance(value, str) and value in DECODE_SPREAD_PRESETS:
        return DECODE_SPREAD_PRESETS[value]
    try:
        kappa = float(value)
    except ValueError:
        raise ValueError(f"decode spread must be one of {sorted(DECODE_SPREAD_PRESETS)} or a number in [0, 1], got {value!r}") from None
    if not 0.0 <= kappa <= 1.0:
        raise ValueError(f"decode spread must be in [0, 1], got {kappa}")
    return kappa


def make_latency_model(
    model: str = "qwen2.5-7b",
    gpu: str = "h200",
    tp_size: int = 1,
    decode_graph: GraphSpec = DEFAULT_DECODE_GRAPH,
    prefill_graph: GraphSpec = DEFAULT_PREFILL_GRAPH,
    decode_spread: str | float = "roofline",
) -> LatencyModel:
    """A :class:`LatencyModel` from preset names (keys of :data:`MODELS` and :data:`GPUS`);
    ``decode_spread``: κ as for :func:`decode_spread_fraction`.

    Raises:
        ValueError: on an unknown preset name, tp_size < 1 or a bad ``decode_spread``.
    """
    if model not in MODELS:
        raise ValueError(f"unknown sim model {model!r}; choose from {sorted(MODELS)}")
    if gpu not in GPUS:
        raise ValueError(f"unknown sim gpu {gpu!r}; choose from {sorted(GPUS)}")
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    return LatencyModel(MODELS[model], GPUS[gpu], tp_size, decode_graph, prefill_graph,
                        decode_spread_fraction=decode_spread_fraction(decode_spread))
