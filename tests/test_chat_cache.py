"""Incremental chat encoding (laps.chat_cache) gives exactly the block keys and length of full encoding."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engines.tiny_model import write_tiny_qwen2_model
from laps.chat_cache import ENTRY_OVERHEAD_BYTES, ChatPrefixCache
from laps.tokenizer import QWEN25_DEFAULT_SYSTEM, ChatML, HFChatTokenizer, detect_chatml, load_tokenizer, render_chatml
from policies.prefix_index import BlockChain, block_keys

# Text that stresses the segment boundaries: combining marks (NFC), newlines and spaces (the split pattern),
# special-token strings, digits and CJK.
PIECES = ["a", "b", " ", "  ", "\n", "\r\n", "\u0301", "e\u0301", "é", "1", "23", "日本", "<|im_start|>", "<|im_end|>",
          "<|endoftext|>", "'s", "!", "\t", "😀"]
TEXT = st.lists(st.sampled_from(PIECES) | st.text(max_size=5), max_size=20).map("".join)
TURN = st.tuples(st.sampled_from(["user", "assistant", "system", "tool"]), TEXT)
CHAT = st.lists(TURN, min_size=1, max_size=8)


def full_chain(tokenizer, messages, block_tokens: int) -> tuple[list[int], int]:
    ids = tokenizer.encode_chat(messages)
    return block_keys(ids, block_tokens), len(ids)


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory) -> HFChatTokenizer:
    return HFChatTokenizer(write_tiny_qwen2_model(tmp_path_factory.mktemp("tiny-qwen2")))


@settings(max_examples=150, deadline=None)
@given(chat=CHAT, block_tokens=st.sampled_from([1, 4, 16]))
def test_every_prefix_of_a_growing_chat_matches_full_encoding(chat, block_tokens):
    tokenizer = load_tokenizer()
    cache = ChatPrefixCache(tokenizer, block_tokens)
    for n in range(1, len(chat) + 1):  # the conversation grows turn by turn, as a client resends it
        messages = [{"role": r, "content": c} for r, c in chat[:n]]
        prompt = cache.prompt(messages).prompt
        keys, tokens = full_chain(tokenizer, messages, block_tokens)
        assert list(prompt.keys) == keys
        assert prompt.tokens == tokens


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chat=CHAT)
def test_hf_chatml_directory_is_incremental_and_matches_full_encoding(hf_tokenizer, chat):
    assert hf_tokenizer.chatml == ChatML(QWEN25_DEFAULT_SYSTEM)
    cache = ChatPrefixCache(hf_tokenizer, 16)
    for n in range(1, len(chat) + 1):
        messages = [{"role": r, "content": c} for r, c in chat[:n]]
        prompt = cache.prompt(messages).prompt
        assert (list(prompt.keys), prompt.tokens) == full_chain(hf_tokenizer, messages, 16)


def test_a_follow_up_turn_tokenizes_only_the_new_messages():
    cache = ChatPrefixCache(load_tokenizer(), 16)
    first = [{"role": "user", "content": "What is the capital of France? " * 5}]
    history = cache.prompt(first).prompt
    follow_up = first + [{"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Spain?"}]
    lookup = cache.lookup(follow_up)
    assert lookup.turns == ("<|im_start|>assistant\nParis.<|im_end|>\n", "<|im_start|>user\nAnd of Spain?<|im_end|>\n")
    assert lookup.new_chars == sum(map(len, lookup.turns))
    # The cached base is the first chat without its generation prompt (3 tokens: <|im_start|> assistant \n).
    assert lookup.base.tokens == history.tokens - 3
    assert list(lookup.base.keys) == block_keys(load_tokenizer().encode_chat(first)[:-3], 16)


@settings(max_examples=100, deadline=None)
@given(exchanges=st.lists(st.tuples(TEXT, TEXT), min_size=1, max_size=5), system=st.none() | TEXT)
def test_a_conversation_whose_replies_are_stored_tokenizes_only_new_user_messages(exchanges, system):
    tokenizer = load_tokenizer()
    cache = ChatPrefixCache(tokenizer, 16)
    messages = [] if system is None else [{"role": "system", "content": system}]
    for user, assistant in exchanges:
        messages.append({"role": "user", "content": user})
        lookup = cache.lookup(messages)
        if len(messages) > 2:  # a follow-up: everything up to the last reply is cached
            assert lookup.turns == (f"<|im_start|>user\n{user}<|im_end|>\n",)
        encoded = cache.encode(lookup)
        cache.store(lookup, encoded)
        assert (list(encoded.prompt.keys), encoded.prompt.tokens) == full_chain(tokenizer, messages, 16)
        chain = cache.reply_chain(encoded, assistant)
        cache.store_reply(encoded, assistant, chain)
        messages.append({"role": "assistant", "content": assistant})
        # The stored chain is the next request's history: the chat so far, without a generation prompt.
        assert list(chain.keys) == block_keys(tokenizer.encode_chat(messages)[:-3], 16)


def test_the_byte_budget_holds_and_evicts_least_recently_used_chats():
    tokenizer = load_tokenizer()
    one = ChatPrefixCache(tokenizer, 16)
    one.prompt([{"role": "user", "content": "chat 0"}])
    per_chat = one.nbytes
    assert per_chat == BlockChain(16).extend(tokenizer.encode_chat([{"role": "user", "content": "chat 0"}])[:-3]).nbytes + ENTRY_OVERHEAD_BYTES
    cache = ChatPrefixCache(tokenizer, 16, max_bytes=3 * per_chat)
    for i in range(3):
        cache.prompt([{"role": "user", "content": f"chat {i}"}])
    cache.lookup([{"role": "user", "content": "chat 0"}])  # chat 0 is now the most recently used
    cache.prompt([{"role": "user", "content": "chat 3"}])
    assert len(cache) == 3 and cache.nbytes <= cache.max_bytes
    assert cache.lookup([{"role": "user", "content": "chat 1"}]).base.tokens == 0  # evicted
    assert cache.lookup([{"role": "user", "content": "chat 0"}]).base.tokens > 0
    for i in range(100):
        cache.prompt([{"role": "user", "content": f"chat {i} " * (i % 7)}])
        assert cache.nbytes <= cache.max_bytes


def test_detect_chatml_tells_default_system_no_default_and_other_templates():
    assert detect_chatml(lambda m: render_chatml(m, None)) == ChatML(None)
    assert detect_chatml(lambda m: render_chatml(m)) == ChatML(QWEN25_DEFAULT_SYSTEM)
    assert detect_chatml(lambda m: render_chatml(m).replace("<think>r</think>", "")) is None  # strips reasoning
    assert detect_chatml(lambda m: "".join(f"[{x['role']}] {x['content']}\n" for x in m)) is None


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "weather?"}, {"role": "tool", "content": '{"temp": 21}'}],
    # an assistant turn that called a tool, with no tool answer yet: its <tool_call> block is more than a ChatML turn
    [{"role": "user", "content": "weather?"},
     {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"place": "Oslo"}}}]},
     {"role": "user", "content": "never mind"}],
])
def test_chats_with_other_roles_or_tool_calls_are_encoded_whole_and_not_cached(messages):
    tokenizer = load_tokenizer()
    cache = ChatPrefixCache(tokenizer, 16)
    encoded = cache.prompt(messages)
    assert encoded.digest is None and len(cache) == 0
    assert (list(encoded.prompt.keys), encoded.prompt.tokens) == full_chain(tokenizer, messages, 16)


def test_non_chatml_tokenizer_is_encoded_whole():
    tokenizer = load_tokenizer()

    class Plain:  # the built-in vocabulary behind a template the cache cannot split
        chatml = None
        encode = tokenizer.encode

        def encode_chat(self, messages, tools=None):
            return tokenizer.encode("".join(f"[{m['role']}] {m['content']}\n" for m in messages))

    cache = ChatPrefixCache(Plain(), 16)
    messages = [{"role": "user", "content": "hello there " * 20}]
    encoded = cache.prompt(messages)
    assert (list(encoded.prompt.keys), encoded.prompt.tokens) == full_chain(Plain(), messages, 16)
    assert encoded.digest is None and len(cache) == 0
    reply = cache.reply_chain(encoded, "general Kenobi")  # the prompt followed by the reply's tokens
    assert list(reply.keys) == block_keys(Plain().encode_chat(messages) + tokenizer.encode("general Kenobi"), 16)
    cache.store_reply(encoded, "general Kenobi", reply)
    assert len(cache) == 0


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="block_tokens"):
        ChatPrefixCache(load_tokenizer(), 0)
