"""Cost of the gateway's per-request decisions with many conversations tracked, and the memory of that tracking.

    python bench/decision_cost.py --out runs/decision_cost.json          # 100k conversations, 8 engines, 1M for memory
    python bench/decision_cost.py --conversations 20000 --requests 5000 --memory-conversations 200000 --out runs/dc.json

Decision (what `gateway/handlers.py` does for a follow-up turn once the new
message is tokenized): extend the conversation's block chain by the new tokens
(`policies.prefix_index.BlockChain.extend`: only new blocks are hashed, as
`laps.chat_cache.ChatPrefixCache` does), the prefix lookup on every engine and
classification (`policies.admission.classified_view_of_chain`), the scheduler's
`submit` + `decide` (the ``pools`` scheduler, which dispatches at once so each
timed decision ends in a dispatch); then, when the answer is in, `observe` of
prompt + reply. The index first holds ``--conversations`` conversations of
--turns turns each (the shipped 64 MiB budget over the engines, so older ones
are evicted as on a busy gateway); then ``--requests`` follow-up turns of
random tracked conversations are timed one by one (``time.perf_counter_ns``,
with ``gc.freeze()`` after set-up so the collector does not rescan the
long-lived index). Side by side: the same keys by full re-hashing
(`block_keys` of the whole prompt, the cost before incremental chains), and
tokenization of a ~100-token follow-up by full `encode_chat` vs the cache.

Memory (``--memory-conversations``, default 1M distinct conversations; run
first, in a fresh process, so the RSS growth is not hidden by freed memory):
the RSS growth of a `PrefixIndex` with the shipped byte budget and of a
`ChatPrefixCache` with its default budget while that many conversations pass
through them; both must stay within their budgets.
Targets: decision p99 <= 50 µs; bounded memory under 1M conversations.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import track
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.dominance import Claim, bench_console, claim_out, save, stopped  # noqa: E402
from laps.chat_cache import ChatPrefixCache  # noqa: E402
from laps.config import load_config  # noqa: E402
from laps.doc_help import doc_parser  # noqa: E402
from laps.tokenizer import load_tokenizer  # noqa: E402
from loadgen.cli import output_file  # noqa: E402
from policies.admission import classified_view_of_chain  # noqa: E402
from policies.exact_prefix import PrefixCaches  # noqa: E402
from policies.prefix_index import BYTES_PER_BLOCK_ENTRY, BlockChain, PrefixIndex, block_keys  # noqa: E402
from policies.registry import make_classifier, make_scheduler  # noqa: E402
from policies.types import EngineView  # noqa: E402

TARGET_P99_US = 50.0
console = Console(stderr=True)


def percentiles_us(samples_ns: list[int]) -> dict[str, float]:
    """p50, p90, p99 and max of nanosecond samples, in microseconds."""
    q = statistics.quantiles(samples_ns, n=100, method="inclusive")
    return {"p50": q[49] / 1e3, "p90": q[89] / 1e3, "p99": q[98] / 1e3, "max": max(samples_ns) / 1e3}


def rss_bytes() -> int:
    """Resident set size of this process (``/proc/self/statm``)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Turns:
    """Synthetic token ids with chat-like lengths: turns of 20-200 tokens (numpy-drawn, seeded)."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def __call__(self) -> list[int]:
        return self.rng.integers(1000, 150000, size=int(self.rng.integers(20, 201))).tolist()


def decision_cost(args: argparse.Namespace) -> dict:
    """Track ``args.conversations`` conversations, then time ``args.requests`` follow-up decisions (module doc)."""
    config = load_config()
    rng = random.Random(args.seed)
    turn = Turns(args.seed)
    engines = [EngineView(f"e{i}", "short" if i < args.engines // 2 else "long") for i in range(args.engines)]
    engine_ids = [e.id for e in engines]
    block_tokens = config.scheduling.prefix_block_tokens
    index = PrefixIndex.from_byte_budget(block_tokens, config.scheduling.prefix_index_bytes, args.engines)
    caches = PrefixCaches(index)  # no engine followed: every H is the estimate's
    classifier = make_classifier(config.scheduling)
    scheduler = make_scheduler(config.scheduling.model_copy(update={"policy": "pools"}))

    chains: list[BlockChain] = []
    for c in track(range(args.conversations), description=f"tracking {args.conversations:,} conversations", console=console):
        chain = BlockChain(block_tokens).extend([151644, 8948, 198])
        for _ in range(args.turns):
            chain = chain.extend(turn()).extend(turn())  # user message, then the reply
        index.observe(engine_ids[c % args.engines], chain.keys, None)
        chains.append(chain)
    gc.collect()
    gc.freeze()

    decide_ns, observe_ns, prompt_tokens = [], [], []
    now = 0.0
    for r in track(range(args.requests), description=f"timing {args.requests:,} decisions", console=console):
        c = rng.randrange(args.conversations)
        new = turn()
        now += 0.001
        t0 = time.perf_counter_ns()
        prompt = chains[c].extend(new)
        view = classified_view_of_chain(f"r{r}", prompt, now, now + config.slo.ttft_s, engine_ids, caches, classifier)
        scheduler.submit(view, now)
        decision = scheduler.decide(engines, now)
        t1 = time.perf_counter_ns()
        engine_id = decision.dispatches[0].engine_id
        chains[c] = prompt.extend(turn())
        index.observe(engine_id, chains[c].keys, None)
        scheduler.on_complete(view.rid, engine_id, now)
        t2 = time.perf_counter_ns()
        decide_ns.append(t1 - t0)
        observe_ns.append(t2 - t1)
        prompt_tokens.append(prompt.tokens)
    gc.unfreeze()

    full_keys_ns = []
    for n in rng.sample(prompt_tokens, min(2000, len(prompt_tokens))):
        ids = list(range(1000, 1000 + n))
        t0 = time.perf_counter_ns()
        block_keys(ids, block_tokens)
        full_keys_ns.append(time.perf_counter_ns() - t0)

    tokenizer = load_tokenizer()
    cache = ChatPrefixCache(tokenizer, block_tokens)
    history = [{"role": "user", "content": "Explain in a few sentences why the sky is blue and why sunsets are red. " * 3},
               {"role": "assistant", "content": "Sunlight scatters off air molecules; blue light scatters most. " * 3}]
    cache.prompt(history[:1])
    cache.prompt(history)
    follow_up = history + [{"role": "user", "content": "And why is the sea blue? Answer in two sentences, please."}]
    tok_full_ns, tok_cached_ns = [], []
    for _ in range(2000):
        t0 = time.perf_counter_ns()
        tokenizer.encode_chat(follow_up)
        t1 = time.perf_counter_ns()
        lookup = cache.lookup(follow_up)
        cache.encode(lookup)  # not stored: every iteration tokenizes the new message again
        t2 = time.perf_counter_ns()
        tok_full_ns.append(t1 - t0)
        tok_cached_ns.append(t2 - t1)

    blocks = sum(index.blocks(e) for e in engine_ids)
    return {
        "conversations": args.conversations, "turns": args.turns, "requests": args.requests, "engines": args.engines,
        "prompt_tokens_mean": statistics.fmean(prompt_tokens),
        "index_blocks": blocks, "index_capacity_per_engine": index.max_blocks,
        "decision_us": percentiles_us(decide_ns),
        "observe_us": percentiles_us(observe_ns),
        "full_block_keys_us": percentiles_us(full_keys_ns),
        "follow_up_tokens": len(tokenizer.encode_chat(follow_up)),
        "tokenize_full_us": percentiles_us(tok_full_ns),
        "tokenize_cached_us": percentiles_us(tok_cached_ns),
    }


def memory(args: argparse.Namespace) -> dict:
    """RSS growth of the prefix index and the chat cache while ``args.memory_conversations`` distinct conversations pass."""
    config = load_config()
    block_tokens = config.scheduling.prefix_block_tokens
    budget = config.scheduling.prefix_index_bytes
    index = PrefixIndex.from_byte_budget(block_tokens, budget, args.engines)
    rng = random.Random(args.seed)
    gc.collect()
    rss0 = rss_bytes()
    offered = 0
    for c in track(range(args.memory_conversations), description=f"prefix index: {args.memory_conversations:,} conversations", console=console):
        prev, keys = c, []
        for k in range(rng.randint(8, 40)):  # 128-640 tokens of distinct prefix per conversation
            prev = hash((prev, k))
            keys.append(prev)
        offered += len(keys)
        index.insert(f"e{c % args.engines}", keys)
    gc.collect()
    index_rss = rss_bytes() - rss0
    blocks = sum(index.blocks(f"e{i}") for i in range(args.engines))

    tokenizer = load_tokenizer()
    cache = ChatPrefixCache(tokenizer, block_tokens)
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly boxing frogs".split()
    gc.collect()
    rss1 = rss_bytes()
    for c in track(range(args.memory_conversations), description=f"chat cache: {args.memory_conversations:,} conversations", console=console):
        cache.prompt([{"role": "user", "content": f"conversation {c}: " + " ".join(rng.choices(words, k=rng.randint(20, 120)))}])
    gc.collect()
    cache_rss = rss_bytes() - rss1
    return {
        "conversations": args.memory_conversations,
        "prefix_index": {
            "budget_bytes": budget, "blocks_offered": offered, "blocks_held": blocks,
            "capacity_blocks": index.max_blocks * args.engines, "rss_growth_bytes": index_rss,
            "rss_bytes_per_block": index_rss / blocks, "assumed_bytes_per_block": BYTES_PER_BLOCK_ENTRY,
            "bytes_per_conversation": index_rss / blocks * offered / args.memory_conversations,
            "within_budget": index_rss <= budget,
        },
        "chat_cache": {
            "budget_bytes": cache.max_bytes, "accounted_bytes": cache.nbytes, "chats_held": len(cache),
            "rss_growth_bytes": cache_rss, "rss_bytes_per_chat": cache_rss / max(len(cache), 1),
            "within_budget": cache_rss <= cache.max_bytes,
        },
        "rss_end_bytes": rss_bytes(),
    }


def print_report(result: dict, out: Console) -> None:
    """The decision percentiles against the target and full re-hashing; the memory figures against the budgets (on
    ``out``)."""
    d = result["decision"]
    table = Table(title=f"per-request decision cost: {os.cpu_count()} CPU cores, {d['conversations']:,} conversations "
                        f"× {d['turns']} turns tracked, {d['engines']} engines, prompts ~{d['prompt_tokens_mean']:.0f} tokens; "
                        f"index {d['index_blocks']:,} blocks")
    for col in ("", "p50 µs", "p90 µs", "p99 µs", "max µs"):
        table.add_column(col, justify="right" if col else "left")
    rows = (("decision (extend keys + lookup + classify + submit + decide)", "decision_us"),
            ("after the answer (observe prompt + reply)", "observe_us"),
            ("baseline: block_keys of the whole prompt", "full_block_keys_us"),
            (f"tokenize a {d['follow_up_tokens']}-token follow-up: whole chat", "tokenize_full_us"),
            ("tokenize it: chat cache (new message only)", "tokenize_cached_us"))
    for label, key in rows:
        p = d[key]
        table.add_row(label, *(f"{p[s]:.1f}" for s in ("p50", "p90", "p99", "max")))
    out.print(table)
    p99 = d["decision_us"]["p99"]
    out.print(f"decision p99 {p99:.1f} µs vs target {TARGET_P99_US:.0f} µs: {'met' if p99 <= TARGET_P99_US else 'NOT met'}")
    m = result.get("memory")
    if m:
        pi, cc = m["prefix_index"], m["chat_cache"]
        out.print(
            f"{m['conversations']:,} distinct conversations: prefix index holds {pi['blocks_held']:,} of {pi['blocks_offered']:,} blocks, "
            f"RSS +{pi['rss_growth_bytes'] / 2**20:.1f} MiB (budget {pi['budget_bytes'] / 2**20:.0f} MiB, "
            f"{'within' if pi['within_budget'] else 'OVER'}), {pi['rss_bytes_per_block']:.0f} B/block "
            f"(assumed {pi['assumed_bytes_per_block']}), ~{pi['bytes_per_conversation']:.0f} B per tracked conversation; "
            f"chat cache holds {cc['chats_held']:,} chats, RSS +{cc['rss_growth_bytes'] / 2**20:.1f} MiB "
            f"(budget {cc['budget_bytes'] / 2**20:.0f} MiB, {'within' if cc['within_budget'] else 'OVER'}); "
            f"process RSS {m['rss_end_bytes'] / 2**20:.0f} MiB")


def main(argv: list[str] | None = None) -> int:
    parser = doc_parser(__doc__)
    parser.add_argument("--conversations", type=int, default=100_000, help="conversations tracked before timing (default: %(default)s)")
    parser.add_argument("--turns", type=int, default=3, help="turns of each tracked conversation (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=20_000, help="follow-up turns timed (default: %(default)s)")
    parser.add_argument("--engines", type=int, default=8, help="engines, half short and half long (default: %(default)s)")
    parser.add_argument("--memory-conversations", type=int, default=1_000_000,
                        help="distinct conversations for the memory check; 0 skips it (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic conversations (default: %(default)s)")
    parser.add_argument("--out", type=output_file, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    if min(args.conversations, args.turns, args.requests, args.engines) < 1 or args.memory_conversations < 0:
        parser.error("--conversations, --turns, --requests and --engines must be >= 1, --memory-conversations >= 0")
    claim = claim_out(parser, args.out) if args.out is not None else Claim()  # before the runs, not after minutes of them
    result = {"cpu_cores": os.cpu_count(), "loadavg": os.getloadavg()}
    try:
        if args.memory_conversations:  # first, while the process has no freed memory that the structures could reuse
            result["memory"] = memory(args)
        result["decision"] = decision_cost(args)
    except BaseException as err:
        return stopped(parser, claim, err)
    out = bench_console(150, args.out)
    print_report(result, out)
    if args.out is not None and not save(parser, out, args.out, result, claim):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
