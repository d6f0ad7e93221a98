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

Not thread-safe except :meth:`ChatPrefixCache.encode` and
:meth:`ChatPrefixCache.reply_chain`, which only tokenize: call the others from
one thread (the event loop).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from laps.tokenizer import CHATML_GENERATION_PROMPT, CHATML_ROLES, ChatTokenizer, Message, render_chatml_turn
from policies.prefix_index import BlockChain

DEFAULT_CACHE_BYTES = 64 * 2**20
# OrderedDict entry and node, digest int, allocator slack: with BlockChain.nbytes this covers the RSS measured by
# bench/decision_cost.py (~755 bytes for a short chat under LRU churn, 1M chats passing through).
ENTRY_OVERHEAD_BYTES = 450


@dataclass(frozen=True)
class PromptLookup:
    """What :meth:`ChatPrefixCache.lookup` found: the cached ``base`` chain and the turns still to encode.

    ``turns``: rendered ChatML turns after ``base`` (every turn when nothing was
    cached); ``digest``: the whole chat's digest (None: the tokenizer is not
    ChatML or the chat has other roles, and ``messages`` are encoded whole);
    ``new_chars``: characters left to tokenize.
    """

    base: BlockChain
    turns: tuple[str, ...]
    digest: int | None
    messages: Sequence[Message]
    new_chars: int


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

    def lookup(self, messages: Sequence[Message]) -> PromptLookup:
        """The longest cached prefix of ``messages`` and the turns after it (marks that prefix recently used)."""
        chatml = self.tokenizer.chatml
        if chatml is None or any(m["role"] not in CHATML_ROLES for m in messages):
            return PromptLookup(self._empty, (), None, messages, sum(len(m["content"]) for m in messages))
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
        return PromptLookup(base, rest, digest, messages, sum(map(len, rest)))

    def encode(self, lookup: PromptLookup) -> EncodedPrompt:
        """Tokenize what ``lookup`` left. Thread-safe."""
        if lookup.digest is None:
            prompt = lookup.base.extend(self.tokenizer.encode_chat(lookup.messages))
            return EncodedPrompt(prompt, prompt, None)
        history = lookup.base
        if lookup.turns:
            history = history.extend(self.tokenizer.encode("".join(lookup.turns)))
        return EncodedPrompt(history.extend(self._generation_ids), history, lookup.digest)

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
