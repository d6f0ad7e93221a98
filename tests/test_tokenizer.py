"""Exact token counts: the built-in Qwen2.5 ChatML tokenizer, and a HF model directory agreeing with it."""

import gzip
import json
from pathlib import Path

import pytest

from engines.tiny_model import write_tiny_qwen2_model
from laps.tokenizer import (CHATML_GENERATION_PROMPT, QWEN25_DEFAULT_SYSTEM, HFChatTokenizer, load_tokenizer, min_tokens, render_chatml,
                            render_chatml_turn, template_tool_calls, template_tools)

DATA = Path(__file__).resolve().parent.parent / "loadgen" / "data"

# Qwen2.5-Instruct's default system turn, as Qwen2.5's own tokenizer encodes it.
QWEN25_SYSTEM_IDS = [151644, 8948, 198, 2610, 525, 1207, 16948, 11, 3465, 553, 54364, 14817, 13, 1446, 525, 264, 10950, 17847, 13, 151645, 198]


def real_chats(limit: int = 60) -> list[list[dict]]:
    with gzip.open(DATA / "hh_rlhf_harmless_base_test_conversations.jsonl.gz", "rt") as f:
        convs = [json.loads(line) for _, line in zip(range(limit), f)]
    return [[{"role": m["role"], "content": m["content"]} for m in c["messages"]] for c in convs]


def test_default_system_prompt_matches_qwen25_ids():
    tok = load_tokenizer()
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[: len(QWEN25_SYSTEM_IDS)] == QWEN25_SYSTEM_IDS
    # <|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n
    assert ids[len(QWEN25_SYSTEM_IDS):] == [151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198]


def test_explicit_system_message_replaces_the_default():
    tok = load_tokenizer()
    text = tok.render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_decode_round_trips_real_text():
    tok = load_tokenizer()
    for chat in real_chats(20):
        text = chat[0]["content"]
        assert tok.decode(tok.encode(text)) == text


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return write_tiny_qwen2_model(tmp_path_factory.mktemp("tiny-qwen2"))


def test_hf_model_directory_gives_identical_ids_on_real_multiturn_chats(hf_dir):
    builtin, hf = load_tokenizer(), HFChatTokenizer(hf_dir)
    for chat in real_chats():
        assert hf.render_chat(chat) == builtin.render_chat(chat)
        assert hf.encode_chat(chat) == builtin.encode_chat(chat)
    assert {151645} <= hf.eos_token_ids


def test_min_tokens_is_a_lower_bound_where_tokens_are_longest(hf_dir):
    builtin, hf = load_tokenizer(), HFChatTokenizer(hf_dir)
    assert builtin.max_token_chars == hf.max_token_chars == 128  # Qwen2.5's longest token: 128 bytes
    longest = max(range(151643), key=lambda i: len(builtin.decode([i])))
    texts = [builtin.decode([longest]) * 40, " " * 20_000, "=" * 20_000, "\n" * 20_000] + [c[0]["content"] for c in real_chats(20)]
    for text in texts:
        assert min_tokens(len(text), builtin) <= len(builtin.encode(text))
    assert min_tokens(512 * 3 + 511, builtin) == 3


def test_qwen25_added_tokens_are_single_tokens_like_the_hf_tokenizer(hf_dir):
    builtin, hf = load_tokenizer(), HFChatTokenizer(hf_dir)
    assert builtin.encode("<tool_call>") == [151657]
    text = '<tool_call>\n{"name": "f"}\n</tool_call><|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|><|file_sep|>x'
    ids = builtin.encode(text)
    assert ids == hf.encode(text)
    assert [i for i in ids if i >= 151643] == [151657, 151658, 151659, 151661, 151660, 151664]
    assert builtin.decode(ids) == text
    # Ids up to <|file_sep|> (151664) are inside the vocabulary the gateway checks completions prompts against.
    assert builtin.vocab_size == hf.vocab_size == 151665
    assert builtin.decode([151657]) == "<tool_call>"


def test_chat_ids_stay_the_concatenation_of_turn_ids_with_added_tokens_in_content():
    tok = load_tokenizer()
    chat = [{"role": "user", "content": "call<tool_call>"}, {"role": "assistant", "content": "</tool_call>ok<|fim_pad|>"}]
    turns = [render_chatml_turn("system", QWEN25_DEFAULT_SYSTEM)] + [render_chatml_turn(m["role"], m["content"]) for m in chat]
    assert tok.encode_chat(chat) == [i for t in turns for i in tok.encode(t)] + tok.encode(CHATML_GENERATION_PROMPT)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather at a place",
                                            "parameters": {"type": "object", "properties": {"place": {"type": "string"}}}}}


def test_tool_calls_render_as_qwen25_prints_them_with_either_template(hf_dir):
    calls = template_tool_calls([
        {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"place": "Tromsø", "days": [1, 2.5]}'}},
        {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": {"place": "Bergen"}}},
    ])
    assert calls[0] == {"id": "a", "index": None, "type": "function",
                        "function": {"name": "get_weather", "arguments": {"place": "Tromsø", "days": [1, 2.5]}}}
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Looking.", "tool_calls": calls},
            {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "rain"}, {"role": "user", "content": "And?"}]
    # Qwen2.5-Instruct's template: the text, then one <tool_call> block a call with the arguments as JSON; tool answers
    # in a row share one user turn
    assert render_chatml(chat) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWeather?<|im_end|>\n"
        '<|im_start|>assistant\nLooking.\n<tool_call>\n{"name": "get_weather", "arguments": {"place": "Tromsø", "days": [1, 2.5]}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"place": "Bergen"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response><|im_end|>\n"
        "<|im_start|>user\nAnd?<|im_end|>\n<|im_start|>assistant\n")
    builtin, hf = load_tokenizer(), HFChatTokenizer(hf_dir)
    quiet = [{"role": "assistant", "content": "", "tool_calls": calls[1:]}, {"role": "tool", "content": "x"}]
    for messages in (chat, chat[1:], quiet):
        for tools in (None, template_tools([WEATHER])):
            assert hf.render_chat(messages, tools) == builtin.render_chat(messages, tools)
            assert hf.encode_chat(messages, tools) == builtin.encode_chat(messages, tools)
    assert render_chatml(quiet, None).startswith('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", ')


def test_roles_qwen25s_template_does_not_know_are_not_printed(hf_dir):
    chat = [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hi"}]
    # Qwen2.5-Instruct's template prints system, user, assistant and tool messages only (SGLang 0.5.23 hands a
    # developer message on as it is): the default system turn, then the user's
    assert render_chatml(chat) == render_chatml(chat[1:])
    builtin, hf = load_tokenizer(), HFChatTokenizer(hf_dir)
    assert hf.encode_chat(chat) == builtin.encode_chat(chat) == builtin.encode_chat(chat[1:])


@pytest.mark.parametrize("arguments, message", [
    ("{'a': 1}", "must be valid JSON"), ('{"a": NaN}', "must be valid JSON"), ("[1]", "must be a JSON object"), ('"x"', "must be a JSON object"),
    ('{"a": ' * 255 + "1" + "}" * 255, "nest deeper than 254 levels"),  # orjson reads it but cannot write it again
    ('{"a": ' * 2000 + "1" + "}" * 2000, "nest deeper than 254 levels"),  # past what orjson reads: valid JSON all the same
])
def test_tool_call_arguments_must_hold_a_json_object_as_sglang_demands(arguments, message):
    with pytest.raises(ValueError, match=message):
        template_tool_calls([{"function": {"name": "f", "arguments": arguments}}])


def test_bad_model_directory_raises_value_error(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json or tokenizer_config.json in the directory"):
        HFChatTokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("not json")
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        HFChatTokenizer(tmp_path)
