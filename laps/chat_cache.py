"""Incremental prompt encoding per conversation: earlier turns are reused, only new messages are tokenized.

A conversation's next request repeats its whole history and adds the
assistant's reply and a new user message. With a ChatML tokenizer
(:attr:`laps.tokenizer.ChatTokenizer.chatml`) a chat's token ids are the
concatenation of its turns' ids, so the block keys of the history
(:class:`policies.prefix_index.BlockChain`) can be kept and extended by the
new turns alone (chats of system, user and assistant turns; others, e.g. with
``tool`` turns, are encoded whole). :class:`ChatPrefixCache` keeps, for each
chat it has encoded, the chain of that chat without the generation prompt,
under a digest of its messages (``hash((previous digest, role, content))`` chained
over the turns, the default system turn included when the template adds one);
a new request looks for the longest of its message prefixes that is cached.
When the engine's answer is in, :meth:`ChatPrefixCache.reply_chain` and
:meth:`ChatPrefixCache.store_reply` add the chat followed by the assistant's
reply, so the conversation's next request (which sends that reply back) only
tokenizes its new user message.

A chain keeps the token ids too (4 bytes a token): an engine whose KV cache
events the gateway follows answers H inside a block from them
(:mod:`policies.exact_prefix`). Memory per cached chat is 8 bytes per block, 4
per token, plus ``CHAIN_OVERHEAD_BYTES`` and ``ENTRY_OVERHEAD_BYTES``; the
least recently used chats go when the byte budget is exceeded. A digest collision (64-bit)
would give a wrong count for one request; nothing else depends on it.

Not thread-safe except :meth:`ChatPrefixCache.encode`,
:meth:`ChatPrefixCache.encode_text` and :meth:`ChatPrefixCache.reply_chain`,
which only tokenize: call the others from one thread (the event loop).
:class:`EncodePool` runs those three where the text's size says: inline, in a
thread, or in worker processes.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import signal
from collections import OrderedDict
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Sequence

from laps.heap import freeze_heap
from laps.tokenizer import CHATML_GENERATION_PROMPT, CHATML_ROLES, ChatTokenizer, Message, load_tokenizer, render_chatml_turn
from policies.prefix_index import BlockChain

log = logging.getLogger("laps.chat_cache")

DEFAULT_CACHE_BYTES = 64 * 2**20
# OrderedDict entry and node, digest int, allocator slack: with BlockChain.nbytes this covers the RSS measured by
# bench/decision_cost.py (~755 bytes for a short chat under LRU churn, 1M chats passing through).
ENTRY_OVERHEAD_BYTES = 450


@dataclass(frozen=True)
class PromptLookup:
    """What :meth:`ChatPrefixCache.lookup` found: the cached ``base`` chain and the turns still to encode.

    ``turns``: rendered ChatML turns after ``base`` (every turn when nothing was
    cached); ``digest``: the whole chat's digest (None: the tokenizer is not
    ChatML, the chat has other roles or comes with ``tools``, and ``messages``
    are encoded whole, with ``tools`` in the template; else ``messages`` is empty:
    ``turns`` hold what is left); ``new_chars``: characters left to tokenize.
    """

    base: BlockChain
    turns: tuple[str, ...]
    digest: int | None
    messages: Sequence[Message]
    new_chars: int
    tools: list[dict] | None = None


@dataclass(frozen=True)
class EncodedPrompt:
    """A chat's block chains: ``prompt`` as the engine prefills it (generation prompt included) and ``history``
    without the generation prompt; ``digest`` identifies the chat (None: not ChatML, and ``history`` is ``prompt``)."""

    prompt: BlockChain
    history: BlockChain
    digest: int | None


class ChatPrefixCache:
    """Block chains of recently seen chats, keyed by message digests (module doc).

    Args:
        tokenizer: its ``chatml`` decides whether encoding is incremental.
        block_tokens: tokens per prefix block (``scheduling.prefix_block_tokens``).
        max_bytes: memory budget of the cached chains (LRU eviction beyond it).

    Raises:
        ValueError: ``block_tokens`` < 1 or ``max_bytes`` < 0.
    """

    def __init__(self, tokenizer: ChatTokenizer, block_tokens: int, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        if block_tokens < 1 or max_bytes < 0:
            raise ValueError(f"block_tokens must be >= 1 and max_bytes >= 0, got {block_tokens} and {max_bytes}")
        self.tokenizer = tokenizer
        self.block_tokens = block_tokens
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._chains: OrderedDict[int, BlockChain] = OrderedDict()
        self._generation_ids = tokenizer.encode(CHATML_GENERATION_PROMPT) if tokenizer.chatml is not None else []
        self._empty = BlockChain(block_tokens)

    def __len__(self) -> int:
        return len(self._chains)

    def lookup(self, messages: Sequence[Message], tools: list[dict] | None = None) -> PromptLookup:
        """The longest cached prefix of ``messages`` and the turns after it (marks that prefix recently used).

        ``tools`` (as :func:`laps.tokenizer.template_tools` gives them) open the system turn, so such a chat is
        encoded whole, as one without ChatML is, and one with ``tool`` answers or ``tool_calls`` (more than one
        ChatML turn each).
        """
        chatml = self.tokenizer.chatml
        if tools is not None or chatml is None or any(m["role"] not in CHATML_ROLES or m.get("tool_calls") for m in messages):
            return PromptLookup(self._empty, (), None, messages, sum(len(m["content"]) for m in messages), tools)
        turns = [(m["role"], m["content"]) for m in messages]
        if chatml.default_system is not None and (not turns or turns[0][0] != "system"):
            turns.insert(0, ("system", chatml.default_system))
        digests = []
        digest = 0
        for role, content in turns:
            digest = hash((digest, role, content))
            digests.append(digest)
        for k in range(len(digests) - 1, -1, -1):
            base = self._chains.get(digests[k])
            if base is not None:
                self._chains.move_to_end(digests[k])
                break
        else:
            k, base = -1, self._empty
        rest = tuple(render_chatml_turn(role, content) for role, content in turns[k + 1:])
        return PromptLookup(base, rest, digest, (), sum(map(len, rest)))

    def encode(self, lookup: PromptLookup) -> EncodedPrompt:
        """Tokenize what ``lookup`` left. Thread-safe."""
        if lookup.digest is None:
            prompt = lookup.base.extend(self.tokenizer.encode_chat(lookup.messages, lookup.tools))
            return EncodedPrompt(prompt, prompt, None)
        history = lookup.base
        if lookup.turns:
            history = history.extend(self.tokenizer.encode("".join(lookup.turns)))
        return EncodedPrompt(history.extend(self._generation_ids), history, lookup.digest)

    def encode_text(self, text: str) -> EncodedPrompt:
        """A plain-text prompt (``/v1/completions``) encoded; nothing is cached. Thread-safe."""
        prompt = self._empty.extend(self.tokenizer.encode(text))
        return EncodedPrompt(prompt, prompt, None)

    def store(self, lookup: PromptLookup, encoded: EncodedPrompt) -> None:
        """Cache ``encoded`` (from :meth:`encode` of ``lookup``); evict LRU chats over budget."""
        if encoded.digest is not None and lookup.turns:
            self._put(encoded.digest, encoded.history)

    def reply_chain(self, encoded: EncodedPrompt, reply: str) -> BlockChain:
        """The chain of ``encoded``'s chat followed by the assistant turn ``reply``, exactly as the next request of the
        conversation will encode it (ChatML); without ChatML, the prompt followed by the reply's tokens. Thread-safe."""
        if encoded.digest is None:
            return encoded.prompt.extend(self.tokenizer.encode(reply) if reply else [])
        return encoded.history.extend(self.tokenizer.encode(render_chatml_turn("assistant", reply)))

    def store_reply(self, encoded: EncodedPrompt, reply: str, chain: BlockChain) -> None:
        """Cache ``chain`` (from :meth:`reply_chain`) as the chat of ``encoded`` followed by the assistant's ``reply``."""
        if encoded.digest is not None:
            self._put(hash((encoded.digest, "assistant", reply)), chain)

    def _put(self, digest: int, chain: BlockChain) -> None:
        old = self._chains.pop(digest, None)
        if old is not None:
            self.nbytes -= old.nbytes + ENTRY_OVERHEAD_BYTES
        self._chains[digest] = chain
        self.nbytes += chain.nbytes + ENTRY_OVERHEAD_BYTES
        while self.nbytes > self.max_bytes and self._chains:
            _, evicted = self._chains.popitem(last=False)
            self.nbytes -= evicted.nbytes + ENTRY_OVERHEAD_BYTES

    def prompt(self, messages: Sequence[Message]) -> EncodedPrompt:
        """``messages`` encoded and their chat cached: :meth:`lookup`, :meth:`encode`, :meth:`store`."""
        lookup = self.lookup(messages)
        encoded = self.encode(lookup)
        self.store(lookup, encoded)
        return encoded


# Up to this many new characters (~200 tokens, ~35 µs of tiktoken) a text is tokenized on the calling thread: a
# hand-off to an executor thread and back costs about as much (~30 µs measured).
INLINE_ENCODE_CHARS = 1024
EncodeMethod = Literal["encode", "encode_text", "reply_chain"]

_worker_cache: ChatPrefixCache | None = None  # in an EncodePool worker process: its own encoder


def _start_worker(model_path: Path | None, block_tokens: int) -> None:
    """An :class:`EncodePool` worker's initializer: ignore SIGINT (a Ctrl-C reaches the terminal's whole process
    group; the gateway shuts down and then stops its workers, :meth:`EncodePool.close`), and load the tokenizer once
    for the process's life, out of the garbage collector's full passes (:mod:`laps.heap`)."""
    global _worker_cache
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker_cache = ChatPrefixCache(load_tokenizer(model_path), block_tokens, max_bytes=0)
    freeze_heap()


def _in_worker(method: EncodeMethod, *args: Any) -> Any:
    return getattr(_worker_cache, method)(*args)


class EncodePool:
    """Runs ``cache``'s thread-safe encoders (``encode``, ``encode_text``, ``reply_chain``) where a text's size says.

    Up to ``inline_chars`` new characters: on the calling thread (the event loop). Up to
    ``process_min_chars``: in the loop's default executor threads (tiktoken and HF ``tokenizers`` release the GIL
    while they encode; the block hashing, ~1 ms per 50k tokens, does not). Longer texts (a 220 KB prompt is ~49k
    tokens, ~40 ms of tiktoken) go to one of ``processes`` worker processes, each with its own tokenizer loaded from
    ``model_path`` (None: the built-in one), so neither their GIL-held part nor a queue of them holds up the event
    loop or the threads that tokenize mid-size chats. The results are the same wherever a text runs: block keys hash
    tuples of token ids, whose hashes, unlike strings', do not vary between processes (the chat digests, which hash
    strings, are computed here). ``processes`` 0: threads for every text over the inline size.

    The pool (its queues hold named semaphores) is made on the first text that needs it, and its workers are spawned
    (not forked: the gateway runs threads) then, ~0.5 s each with the built-in tokenizer; they ignore SIGINT. A worker
    that dies (e.g. killed for memory) breaks the pool: the texts then in it are tokenized in threads instead and the
    next one makes a new pool. :meth:`close` stops the workers and frees the semaphores; a process killed before it
    could (SIGKILL) leaves them to multiprocessing's resource tracker, which removes them and warns about them.
    """

    def __init__(self, cache: ChatPrefixCache, model_path: Path | None, processes: int, process_min_chars: int,
                 inline_chars: int = INLINE_ENCODE_CHARS) -> None:
        self.cache = cache
        self.process_min_chars = process_min_chars
        self.inline_chars = inline_chars
        self._model_path = model_path
        self._processes = processes
        self._pool: ProcessPoolExecutor | None = None  # made on the first text that needs it

    def _worker_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self._processes, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_start_worker, initargs=(self._model_path, self.cache.block_tokens))
        return self._pool

    async def run(self, chars: int, method: EncodeMethod, *args: Any) -> Any:
        """``cache.<method>(*args)``, for a text of ``chars`` new characters, run where its size says (class doc)."""
        if chars <= self.inline_chars:
            return getattr(self.cache, method)(*args)
        loop = asyncio.get_running_loop()
        if self._processes > 0 and chars >= self.process_min_chars:
            pool = self._worker_pool()
            try:
                return await loop.run_in_executor(pool, _in_worker, method, *args)
            except BrokenProcessPool:
                if self._pool is pool:
                    log.warning("a tokenizer worker process died; new ones start with the next large text (texts in flight are tokenized in threads)")
                    pool.shutdown(wait=False, cancel_futures=True)
                    self._pool = None
        return await loop.run_in_executor(None, getattr(self.cache, method), *args)

    async def close(self) -> None:
        """Stop the worker processes: the texts they are tokenizing finish, those still queued are dropped."""
        if self._pool is not None:
            await asyncio.to_thread(self._pool.shutdown, wait=True, cancel_futures=True)
