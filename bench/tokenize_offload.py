"""What tokenizing huge prompts costs the gateway's event loop: inline, in threads, in worker processes.

    python bench/tokenize_offload.py                       # ~20 s on 2 cores
    python bench/tokenize_offload.py --big 60 --processes 4

``--big`` prompts of ``--big-kb`` KB of real text (router_overhead.py's large
bodies) are tokenized at once through :class:`laps.chat_cache.EncodePool` as
the gateway does, in three modes: ``inline`` (on the event loop, as if there
were no off-loading), ``threads`` (``gateway.tokenizer_processes: 0``: the
loop's executor threads) and ``processes`` (``--processes`` workers, started
before the measurement). Meanwhile a 1 ms ticker on the loop records how late
it runs (the loop's stalls) and a 2 KB chat is tokenized every 10 ms (how long
a mid-size request waits for its tokens). Per mode: ticker lag p50 / p99 / max,
the mid-size chat's latency p50 / p99, the wall time to tokenize every large
prompt, and this process's CPU time (all threads) per large prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from laps.chat_cache import INLINE_ENCODE_CHARS, ChatPrefixCache, EncodePool  # noqa: E402
from laps.config import GatewayConfig  # noqa: E402
from laps.doc_help import doc_parser  # noqa: E402
from laps.tokenizer import load_tokenizer  # noqa: E402
from loadgen.workloads import real_text_corpus  # noqa: E402

TICK_S = 0.001
MID_EVERY_S = 0.01
MID_CHARS = 2000
PROCESS_MIN_CHARS = GatewayConfig.model_fields["tokenizer_process_min_chars"].default  # the gateway's


async def measure(encoder: EncodePool, bigs: list[str], mids: list[str]) -> dict:
    """Tokenize ``bigs`` at once through ``encoder`` while ticking and tokenizing ``mids`` (module doc)."""
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    lags, mid_s = [], []

    async def ticker() -> None:
        while not done.is_set():
            t0 = loop.time()
            await asyncio.sleep(TICK_S)
            lags.append(loop.time() - t0 - TICK_S)

    async def mid_size() -> None:
        for text in mids:
            if done.is_set():
                return
            t0 = time.perf_counter()
            lookup = encoder.cache.lookup([{"role": "user", "content": text}])
            await encoder.run(lookup.new_chars, "encode", lookup)
            mid_s.append(time.perf_counter() - t0)
            await asyncio.sleep(MID_EVERY_S)

    side = [asyncio.ensure_future(ticker()), asyncio.ensure_future(mid_size())]
    await asyncio.sleep(0.05)
    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(encoder.run(len(b), "encode_text", b) for b in bigs))
    wall_s, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    done.set()
    await asyncio.gather(*side)
    lag_ms = np.percentile(lags, [50, 99, 100]) * 1e3
    mid_ms = np.percentile(mid_s, [50, 99]) * 1e3
    return {"lag_p50_ms": lag_ms[0], "lag_p99_ms": lag_ms[1], "lag_max_ms": lag_ms[2], "mid_p50_ms": mid_ms[0],
            "mid_p99_ms": mid_ms[1], "wall_s": wall_s, "cpu_ms_per_big": cpu_s / len(bigs) * 1e3}


async def main_async(args: argparse.Namespace) -> None:
    rng = random.Random(0)
    texts = real_text_corpus()
    corpus = "\n\n".join(texts)
    size = args.big_kb * 1000
    bigs = [corpus[(start := rng.randrange(len(corpus) - size)):start + size] for _ in range(args.big)]
    mids = [f"{rng.choice(texts)[:MID_CHARS]} (chat {i})" for i in range(10_000)]
    print(f"{args.big} prompts of {args.big_kb} KB at once; a {MID_CHARS}-char chat every {MID_EVERY_S * 1e3:.0f} ms; "
          f"loop ticker {TICK_S * 1e3:.0f} ms")
    print(f"{'mode':<22} {'lag p50/p99/max (ms)':>24} {'mid p50/p99 (ms)':>18} {'wall (s)':>9} {'CPU/prompt here (ms)':>21}")
    for mode in ("inline", "threads", "processes"):
        cache = ChatPrefixCache(load_tokenizer(), 16)
        encoder = EncodePool(cache, None, args.processes if mode == "processes" else 0, PROCESS_MIN_CHARS,
                             inline_chars=size if mode == "inline" else INLINE_ENCODE_CHARS)
        if mode == "processes":
            await asyncio.gather(*(encoder.run(size, "encode_text", bigs[0]) for _ in range(args.processes)))  # spawn
        r = await measure(encoder, bigs, mids)
        await encoder.close()
        label = f"{mode} ({args.processes})" if mode == "processes" else mode
        print(f"{label:<22} {r['lag_p50_ms']:>8.2f} / {r['lag_p99_ms']:>6.2f} / {r['lag_max_ms']:>6.1f} "
              f"{r['mid_p50_ms']:>8.2f} / {r['mid_p99_ms']:>7.1f} {r['wall_s']:>9.2f} {r['cpu_ms_per_big']:>21.1f}")


def main() -> None:
    parser = doc_parser(__doc__, split=False)
    parser.add_argument("--big", type=int, default=30, help="large prompts tokenized at once (default: %(default)s)")
    parser.add_argument("--big-kb", type=int, default=220, help="size of each in KB (default: %(default)s)")
    parser.add_argument("--processes", type=int, default=2, help="worker processes of the processes mode (default: %(default)s)")
    args = parser.parse_args()
    if min(args.big, args.big_kb, args.processes) < 1:
        parser.error("--big, --big-kb and --processes must be >= 1")
    import uvloop
    uvloop.run(main_async(args))


if __name__ == "__main__":
    main()
