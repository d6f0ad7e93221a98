"""How far the engine model lands from every published anchor, each on the model it was measured on (one H200).

Fits the latency model's compute and memory efficiencies to the Qwen2.5-7B
forward-pass anchors (engines.sim.calibration.fit_latency: bounded least squares
on log(model / published), a compromise between anchors that contradict each
other, not a match to any one), checks the shipped defaults are that fit, and
prints and writes one row per anchor, priced on the preset of the model it was
measured on:

* Qwen2.5-7B forward passes (LAPS slides): prefill 16/256/1024/2048 tokens and
  8 × 64 tokens, fitted;
* the interference pair (LAPS slides): 8 × 64-token prefills, then 7 × 64 + 1 ×
  2048 in one pass, on Qwen2.5-7B (19 → 567 ms) and Qwen2.5-32B (74 → 2,289 ms),
  with the model's ragged pass (what SGLang runs) and the same batch padded to
  its longest sequence (8 × 2048 tokens); not fitted;
* P90 TTFT of short requests alone and mixed with long ones at concurrency
  8/16/32 (LAPS paper Figs. 1 and 3, Qwen2.5-32B), from the closed-loop runs of
  bench/interference.py on the 32B preset (long share 0.2 when mixed, 3000
  requests); not fitted.

and the median |error| over each model's anchors.

The published interference slowdown (29.8× for 7B, 30.9× for 32B) is not what a
ragged pass costs: the roofline gives 4.9× and 5.0×, since the long prefill adds
2,048 tokens to 448. A batch padded to its longest sequence gives 31.6× and
32.4×, the published ratios, at absolute times 1.3–1.6× below the published
ones, about as far as the 8 × 64 batch itself lands (19 vs 11.5 ms, 74 vs
53.3 ms): the slides' figures look like a padded (static-batch) execution. SGLang 0.5.23 has no
such path for this model: ScheduleBatch.prepare_for_extend
(managers/schedule_batch.py) concatenates each request's new tokens into one
flat input_ids of Σ L_i tokens, so the linear layers run 2,496 tokens (2,560
with the default breakable prefill CUDA graph, which replays the next token
bucket: PrefillCudaGraphRunner, model_executor/runner/prefill_cuda_graph_runner.py);
the default attention backend on Hopper, fa3 (FlashAttentionBackend.forward_extend,
layers/attention/flashattention_backend.py), calls flash_attn_with_kvcache with
cu_seqlens_q and max_seqlen_q = max(extend_seq_lens), a varlen kernel that does
each sequence's own tiles; the full prefill graph backend bakes max_seqlen_q as
an upper bound but the kernel reads the real extents from cu_seqlens; the Triton
extend kernel (_fwd_kernel, kernels/ops/attention/extend_attention.py) returns
at once from the tiles past a sequence's length; only the torch_native backend
(TorchNativeAttnBackend._run_sdpa_forward_extend) pads anything, each query to
its sequence's cached prefix, which these prefix-free batches do not have. A
padded harness outside SGLang (an HF transformers batch padded to the longest
prompt, say) would explain the figure; so would timing something other than one
pass. The model is not bent to it: bench/gpu_check.py measures both shapes on
a GPU.

    python bench/sim_calibration.py --out runs/sim_calibration.json

JSON: {"fit": {...}, "anchors": [{"name", "model", "source", "published_ms", "model_ms",
"error_pct", "padded_ms", "padded_error_pct"}], "median_abs_error_pct": {model: pct},
"interference_slowdown": {model: {"published", "ragged", "padded"}}} (the TTFT rows have no
padded keys; padded keys are null where padding changes nothing).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import orjson
from rich.console import Console
from rich.table import Table

from engines.sim.args import SimServerArgs, resolve_args
from engines.sim.calibration import (
    INTERFERENCE_ANCHORS,
    PASS_ANCHORS,
    TTFT_ANCHORS,
    fit_latency,
    median_abs_error_pct,
    pass_anchor_rows,
    ttft_anchor_rows,
)
from engines.sim.core import EngineCore
from engines.sim.latency import MODELS
from laps.doc_help import doc_parser
from laps.tokenizer import load_tokenizer
from loadgen.workloads import short_and_long_prompts

LONG_SHARE = 0.2
REQUESTS = 3000
SHORT_NAMES = {"qwen2.5-7b": "7B", "qwen2.5-14b": "14B", "qwen2.5-32b": "32B"}
SHORT, MIXED = "8 x prefill 64", "7 x prefill 64 + 2048"


def interference_slowdown(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per model with both interference rows: the mixed pass's time over the short one's, published,
    ragged (the model's) and padded (the mixed batch padded to 8 × 2048; the short batch needs none)."""
    by_name = {(r["model"], r["name"]): r for r in rows}
    out = {}
    for model in dict.fromkeys(r["model"] for r in rows):
        short, mixed = by_name.get((model, SHORT)), by_name.get((model, MIXED))
        if short and mixed:
            out[model] = {"published": mixed["published_ms"] / short["published_ms"],
                          "ragged": mixed["model_ms"] / short["model_ms"],
                          "padded": mixed["padded_ms"] / short["model_ms"]}
    return out


def main() -> int:
    """Fit, price every anchor on its own model, print the table and write the JSON."""
    parser = doc_parser(__doc__, split=False)
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--seed", type=int, default=0, help="seed of the TTFT runs (default: 0)")
    args = parser.parse_args()
    console = Console(width=160)

    pass_anchors = PASS_ANCHORS + INTERFERENCE_ANCHORS
    names = list(dict.fromkeys(a.model for a in (*pass_anchors, *TTFT_ANCHORS)))  # 7B first
    sims = {name: resolve_args(SimServerArgs(model_path=MODELS[name].hf_name, sim_model=name)) for name in names}
    model = sims["qwen2.5-7b"].latency
    fitted = fit_latency(model)
    fit = {"compute_efficiency": fitted.compute_efficiency, "memory_efficiency": fitted.memory_efficiency,
           "mfu": fitted.mfu, "mbu": fitted.mbu, "pass_overhead_ms": fitted.pass_overhead_s * 1e3,
           "defaults": {"compute_efficiency": model.compute_efficiency, "memory_efficiency": model.memory_efficiency}}
    console.print(f"fit (Qwen2.5-7B pass anchors, log least squares): compute_efficiency {fitted.compute_efficiency:.3f}"
                  f" (mfu {fitted.mfu:.3f}), memory_efficiency {fitted.memory_efficiency:.3f} (mbu {fitted.mbu:.3f}), "
                  f"pass overhead {fitted.pass_overhead_s * 1e3:.2f} ms; shipped defaults {model.compute_efficiency:.3f}"
                  f" / {model.memory_efficiency:.3f}")

    rows = []
    for name in names:
        rows += pass_anchor_rows(sims[name].latency, [a for a in pass_anchors if a.model == name])
    tok = load_tokenizer()
    shorts, longs = short_and_long_prompts(tok, random.Random(f"prompts/{args.seed}"), 1000, 300)
    for name in names:
        anchors = [a for a in TTFT_ANCHORS if a.model == name]
        if anchors:
            sim = sims[name]
            rows += ttft_anchor_rows(lambda sim=sim: EngineCore(sim.config, sim.latency, tok), shorts, longs,
                                     LONG_SHARE, REQUESTS, args.seed, anchors)
    medians = median_abs_error_pct(rows)
    slowdown = interference_slowdown(rows)

    table = Table(title="engine model vs published anchors, each on its own model (one H200)")
    for col in ("anchor", "model", "source", "published ms", "model ms", "error", "padded ms", "padded error"):
        table.add_column(col, justify="left" if col in ("anchor", "model", "source") else "right")
    for r in rows:
        padded = r.get("padded_ms")
        table.add_row(r["name"], SHORT_NAMES[r["model"]], r["source"], f"{r['published_ms']:.1f}",
                      f"{r['model_ms']:.1f}", f"{r['error_pct']:+.0f}%", "—" if padded is None else f"{padded:.1f}",
                      "—" if padded is None else f"{r['padded_error_pct']:+.0f}%")
    console.print(table)
    console.print("median |error|: " + ", ".join(f"{SHORT_NAMES[m]} {pct:.1f}% ({sum(r['model'] == m for r in rows)} "
                                                 "anchors)" for m, pct in medians.items()))
    for m, ratios in slowdown.items():
        console.print(f"{SHORT_NAMES[m]}: {MIXED} over {SHORT}: published {ratios['published']:.1f}x, model ragged "
                      f"{ratios['ragged']:.1f}x, padded {ratios['padded']:.1f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps({"fit": fit, "anchors": rows, "median_abs_error_pct": medians,
                                       "interference_slowdown": slowdown},
                                      option=orjson.OPT_INDENT_2) + b"\n")
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
