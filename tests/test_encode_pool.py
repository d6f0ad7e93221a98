"""EncodePool (laps.chat_cache): large texts are tokenized in worker processes, with the results of inline encoding,
without holding up mid-size texts or costing the gateway process the tokenizer's CPU."""

import asyncio
import os
import signal
import time

import pytest

from laps.chat_cache import ChatPrefixCache, EncodePool
from laps.tokenizer import load_tokenizer, template_tools
from loadgen.workloads import real_text_corpus
from policies.prefix_index import BlockChain

CORPUS = "\n\n".join(real_text_corpus())
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Find a word.", "parameters": {"type": "object"}}}]


def text(start: int, chars: int) -> str:
    return CORPUS[start:start + chars]


def chain(c: BlockChain) -> tuple[list[int], list[int], int]:
    return list(c.keys), list(c.tail), c.tokens


@pytest.fixture(scope="module")
def pool():
    """One worker process for every text over 4 KB (started once for the module: spawning costs ~0.5 s)."""
    encoder = EncodePool(ChatPrefixCache(load_tokenizer(), 16), None, processes=1, process_min_chars=4096)
    asyncio.run(encoder.run(5000, "encode_text", text(0, 5000)))  # the worker is up and has its tokenizer
    yield encoder
    asyncio.run(encoder.close())


async def test_pooled_encoding_equals_inline_encoding_with_the_chat_cache(pool):
    inline = ChatPrefixCache(load_tokenizer(), 16)
    history = [{"role": "system", "content": "Answer from the document."}, {"role": "user", "content": text(100, 30_000)}]
    for turn in range(2):  # the follow-up finds the first turn and its reply cached and sends only its new turn on
        lookup = pool.cache.lookup(history)
        assert len(lookup.turns) == (2 if turn == 0 else 1) and lookup.new_chars > pool.process_min_chars
        encoded = await pool.run(lookup.new_chars, "encode", lookup)
        expected = inline.prompt(history)
        assert (chain(encoded.prompt), chain(encoded.history), encoded.digest) == (
            chain(expected.prompt), chain(expected.history), expected.digest)
        assert encoded.prompt.tokens == len(load_tokenizer().encode_chat(history))
        pool.cache.store(lookup, encoded)
        reply = text(50_000 + turn, 9000)
        reply_chain = await pool.run(len(reply), "reply_chain", encoded, reply)
        assert chain(reply_chain) == chain(inline.reply_chain(expected, reply))
        pool.cache.store_reply(encoded, reply, reply_chain)
        history += [{"role": "assistant", "content": reply}, {"role": "user", "content": text(70_000 + turn, 6000)}]


async def test_pooled_tools_chats_and_text_prompts_equal_inline_encoding(pool):
    tokenizer = load_tokenizer()
    messages = [{"role": "user", "content": text(3, 20_000)}]
    tools = template_tools(TOOLS)
    lookup = pool.cache.lookup(messages, tools)
    encoded = await pool.run(lookup.new_chars, "encode", lookup)
    assert encoded.digest is None
    assert chain(encoded.prompt) == chain(BlockChain(16).extend(tokenizer.encode_chat(messages, tools)))
    prompt = text(7, 12_000)
    assert chain((await pool.run(len(prompt), "encode_text", prompt)).prompt) == chain(BlockChain(16).extend(tokenizer.encode(prompt)))


async def test_large_texts_do_not_hold_up_a_mid_size_one(pool):
    """A mid-size text (threads) does not queue behind 20 large ones (the worker process, ~15 ms each): it is done
    before most of them are (in the executor threads that all took before, it came after 14 or more)."""
    big = [asyncio.ensure_future(pool.run(100_000, "encode_text", text(i, 100_000))) for i in range(20)]
    await asyncio.sleep(0)  # every large one is submitted first
    mid = text(1, 2000)
    encoded = await pool.run(len(mid), "encode_text", mid)
    assert sum(f.done() for f in big) <= 5
    assert encoded.prompt.tokens == len(load_tokenizer().encode(mid))
    await asyncio.gather(*big)


async def test_large_texts_cost_this_process_a_small_part_of_their_tokenizing():
    """Tokenizing is CPU time of the worker, not of the gateway process (which pickles texts and chains only)."""
    prompts = [text(i, 220_000) for i in range(6)]
    cache = ChatPrefixCache(load_tokenizer(), 16)
    cpu0 = time.process_time()
    expected = [cache.encode_text(p) for p in prompts]
    inline_s = time.process_time() - cpu0
    encoder = EncodePool(cache, None, processes=1, process_min_chars=4096)
    await encoder.run(5000, "encode_text", text(0, 5000))
    cpu0 = time.process_time()
    pooled = await asyncio.gather(*(encoder.run(len(p), "encode_text", p) for p in prompts))
    pooled_s = time.process_time() - cpu0
    await encoder.close()
    assert [chain(e.prompt) for e in pooled] == [chain(e.prompt) for e in expected]
    assert pooled_s < 0.25 * inline_s, (pooled_s, inline_s)


async def test_workers_ignore_sigint(pool):
    """A Ctrl-C reaches the whole process group: the workers leave the shutdown to the gateway (EncodePool.close)."""
    assert await asyncio.wrap_future(pool._pool.submit(signal.getsignal, signal.SIGINT)) == signal.SIG_IGN
    pid = await asyncio.wrap_future(pool._pool.submit(os.getpid))
    os.kill(pid, signal.SIGINT)
    assert await asyncio.wrap_future(pool._pool.submit(os.getpid)) == pid  # the same worker, still serving


async def test_no_pool_until_a_text_needs_one():
    """A pool's queues hold named semaphores; a gateway process that never tokenizes a large text makes none (one
    killed would leave them to the resource tracker)."""
    encoder = EncodePool(ChatPrefixCache(load_tokenizer(), 16), None, processes=1, process_min_chars=4096)
    await encoder.run(4095, "encode_text", text(0, 4095))
    assert encoder._pool is None
    await encoder.run(4096, "encode_text", text(0, 4096))
    assert encoder._pool is not None
    await encoder.close()


async def test_a_dead_worker_is_replaced_and_its_texts_still_encoded(caplog):
    cache = ChatPrefixCache(load_tokenizer(), 16)
    encoder = EncodePool(cache, None, processes=1, process_min_chars=4096)
    prompt = text(11, 8000)
    expected = chain(cache.encode_text(prompt).prompt)
    assert chain((await encoder.run(len(prompt), "encode_text", prompt)).prompt) == expected  # in the worker
    broken = encoder._pool
    with pytest.raises(Exception):
        await asyncio.wrap_future(broken.submit(os._exit, 1))  # the worker process dies
    assert chain((await encoder.run(len(prompt), "encode_text", prompt)).prompt) == expected  # in a thread
    assert "a tokenizer worker process died" in caplog.text
    assert chain((await encoder.run(len(prompt), "encode_text", prompt)).prompt) == expected  # in the new worker
    assert encoder._pool not in (None, broken)
    await encoder.close()


async def test_no_processes_tokenizes_large_texts_in_threads():
    cache = ChatPrefixCache(load_tokenizer(), 16)
    encoder = EncodePool(cache, None, processes=0, process_min_chars=4096)
    prompt = text(5, 40_000)
    assert chain((await encoder.run(len(prompt), "encode_text", prompt)).prompt) == chain(cache.encode_text(prompt).prompt)
    await encoder.close()
