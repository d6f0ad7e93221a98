"""``python -m engines.sim``: run one simulated SGLang engine (see ``--help``)."""

from __future__ import annotations

import argparse
import logging
import sys

from engines.sim.latency import GPUS, MODELS
from engines.sim.server import SimServerArgs, resolve_args, run

SGLANG_SCHEDULE_POLICIES = ("lpm", "random", "fcfs", "dfs-weight", "lof", "priority", "routing-key", "hrrn",
                            "shortest-prefill-first")

EPILOG = """\
example:
  python -m engines.sim --model-path Qwen/Qwen2.5-7B-Instruct --port 30001 \\
      --chunked-prefill-size 2048 --enable-metrics --enable-cache-report

Flags keep SGLang 0.5.23's names and defaults; --sim-* flags pick the simulated
model and GPU. --model-path is only a name unless it is a directory holding a
Hugging Face tokenizer, which is then used (so is --tokenizer-path)."""


def build_parser() -> argparse.ArgumentParser:
    """The command line; unset flags take :class:`SimServerArgs`'s defaults."""
    p = argparse.ArgumentParser(
        prog="python -m engines.sim",
        description="A simulated SGLang 0.5.23 engine: SGLang's HTTP API and batching on a roofline model of a "
                    "GPU, in real time, on CPU only.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS)
    d = SimServerArgs()
    p.add_argument("--model-path", help=f"model name, or a HF model directory (default {d.model_path})")
    p.add_argument("--served-model-name", help="name in /v1/models (default: --model-path)")
    p.add_argument("--tokenizer-path", help="HF tokenizer directory (default: built-in Qwen2.5 vocabulary)")
    p.add_argument("--host", help=f"bind address (default {d.host})")
    p.add_argument("--port", type=int, help=f"port (default {d.port})")
    p.add_argument("--tp-size", type=int, help="tensor-parallel GPUs (default 1)")
    p.add_argument("--chunked-prefill-size", type=int, help="max tokens of one prefill chunk; -1 disables (default 8192)")
    p.add_argument("--max-prefill-tokens", type=int, help=f"max new tokens of one prefill batch (default {d.max_prefill_tokens})")
    p.add_argument("--max-running-requests", type=int, help="max running requests (default: from the KV pool)")
    p.add_argument("--max-total-tokens", type=int, help="KV pool size in tokens (default: from GPU memory)")
    p.add_argument("--mem-fraction-static", type=float, help="GPU memory share for weights + KV pool (default 0.88)")
    p.add_argument("--context-length", type=int, help="context length (default: the model's, 32768)")
    p.add_argument("--schedule-policy", choices=SGLANG_SCHEDULE_POLICIES, help="only fcfs is simulated (default fcfs)")
    p.add_argument("--cuda-graph-max-bs-decode", type=int, help="largest decode batch a CUDA graph covers (default 256)")
    p.add_argument("--disable-cuda-graph", action="store_true", help="price every pass as eager")
    p.add_argument("--enable-mixed-chunk", action="store_true", help="run decodes in the same pass as prefill chunks")
    p.add_argument("--enable-metrics", action="store_true", help="serve Prometheus metrics at /metrics")
    p.add_argument("--enable-cache-report", action="store_true",
                   help="put usage.prompt_tokens_details.cached_tokens in OpenAI responses")
    p.add_argument("--sim-model", choices=sorted(MODELS), help="simulated model (default: from --model-path)")
    p.add_argument("--sim-gpu", choices=sorted(GPUS), help=f"simulated GPU (default {d.sim_gpu})")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), help="log level (default info)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, serve until SIGINT/SIGTERM; 0 on a clean shutdown, 2 on bad arguments."""
    parser = build_parser()
    args = SimServerArgs(**vars(parser.parse_args(argv)))
    try:
        resolve_args(args)
    except ValueError as err:
        parser.error(str(err))
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
