"""OpenAI request schemas: what the gateway checks before it tokenizes and routes.

Unknown fields are kept and forwarded to the engine unchanged (SGLang accepts
many extensions such as ``ignore_eos`` and ``rid``). Known fields are strict:
``"max_tokens": "10"`` or ``"stream": "yes"`` is an error here rather than
coerced here and refused by the engine.
"""

from __future__ import annotations

import functools
import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from laps.tokenizer import Message, final_assistant_message, template_tool_calls, tool_call_arguments


class TextPart(BaseModel):
    """One ``{"type": "text", "text": ...}`` part of a message's content (images and audio are not served)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    """The ``function`` of an assistant turn's tool call: its ``name`` (a string, as OpenAI's API has it; SGLang
    0.5.23 also takes none) and ``arguments``, a JSON object sent as a string (OpenAI's form) or as an object (SGLang
    takes both), held here as the object (:func:`laps.tokenizer.tool_call_arguments`), as the chat template prints it."""

    model_config = ConfigDict(extra="allow", strict=True)
    name: str
    arguments: str | dict

    @field_validator("arguments")
    @classmethod
    def _a_json_object(cls, v):
        return tool_call_arguments(v)  # SGLang's check: a ValueError saying what is wrong


class ToolCall(BaseModel):
    """One entry of an assistant message's ``tool_calls``: ``{"id", "type": "function", "function": {...}}``."""

    model_config = ConfigDict(extra="allow", strict=True)
    id: str | None = None  # the tool message's tool_call_id that answers it
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    """One chat message; list content must be text parts (images are not served).

    ``content`` is required, as in OpenAI's API (absent or ``null`` is an error), except in an assistant message
    with ``tool_calls`` (or the older ``function_call``): the model's turn that only called tools.
    """

    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    name: str | None = None  # the participant's name, which some chat templates print (a number would break them)
    tool_call_id: str | None = None  # the tool message's answer to this call id
    tool_calls: list[ToolCall] | None = None  # declared before content, which is checked against them
    function_call: dict | None = None
    content: str | list[TextPart] | None = Field(None, validate_default=True)

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v):
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list) and not v:  # OpenAI's API refuses an empty content array too
            raise ValueError("content is an empty list: give a string or at least one text part")
        if isinstance(v, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in v):
            return v
        raise ValueError('content must be a string or a list of text parts {"type": "text", "text": "..."}; laps serves text only')

    @field_validator("content")
    @classmethod
    def _required(cls, v, info: ValidationInfo):
        role = info.data.get("role")
        if v is not None or role is None:  # no role: that error is reported
            return v
        if role == "assistant":
            if info.data.get("tool_calls") or info.data.get("function_call"):
                return v
            raise PydanticCustomError("missing", "an assistant message needs content unless it has tool_calls")
        raise PydanticCustomError("missing", f"a {role} message needs content (a string or a list of text parts)")  # the param keeps "content"

    def text(self) -> str:
        """The content as one string; text parts are joined with a space, as SGLang 0.5.23
        flattens them for string-format chat templates (``process_content_for_template_format``)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return " ".join(p.text for p in self.content)


class FunctionDefinition(BaseModel):
    """A tool's ``function``: its ``name`` (OpenAI's rule: letters, digits, ``_`` and ``-``, at most 64) and JSON-schema ``parameters``."""

    model_config = ConfigDict(extra="allow", strict=True)
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    """One entry of ``tools``: ``{"type": "function", "function": {...}}``."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["function"]
    function: FunctionDefinition


class ResponseFormat(BaseModel):
    """``response_format``: its ``type`` one of SGLang 0.5.23's (``ResponseFormat``, ``StructuralTagResponseFormat``,
    whose xgrammar ``StructuralTag`` defaults it to ``structural_tag``); the rest (``json_schema``, ``format``, ...)
    passes through to the engine, which checks it."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text", "json_object", "json_schema", "structural_tag"] = "structural_tag"


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    model: str
    stream: bool = False
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=128)  # the engine answers n choices of one prefill
    temperature: float | None = Field(None, ge=0)  # SGLang's range (OpenAI's stops at 2; SGLang takes any finite value)
    top_p: float | None = Field(None, gt=0, le=1)
    # SGLang's extensions, with SGLang 0.5.23's ranges (SamplingParams.verify), so the engine never refuses them
    top_k: int | None = None  # -1 (off) or >= 1: _top_k_off_or_positive
    min_p: float | None = Field(None, ge=0, le=1)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    min_tokens: int | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 63)
    stop: str | list[str] | None = None
    priority: int | None = Field(None, ge=-(1 << 63), lt=1 << 63)  # SGLang's; see gateway/priority.py
    stream_options: dict | None = None  # OpenAI's: only with "stream": true
    user: str | None = None
    response_format: ResponseFormat | None = None  # SGLang types it on both routes
    # token id (a decimal string) -> bias in OpenAI's range, -100 to 100; ids past the vocabulary: handlers
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k_off_or_positive(cls, v):
        if v is not None and v != -1 and v < 1:
            raise ValueError("must be -1 (no limit) or at least 1")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, v):
        bad = next((k for k in v or () if not (k.isascii() and k.isdigit() and len(k) <= 10)), None)
        if bad is not None:  # SGLang's verify calls int() on each key: a ValueError there, not a clear 400
            raise ValueError(f"keys must be token ids (non-negative integers as strings), got {bad!r}")
        return v

    @field_validator("min_tokens")
    @classmethod
    def _min_tokens_within_the_reply(cls, v, info: ValidationInfo):
        most = info.data.get("max_completion_tokens") or info.data.get("max_tokens")  # SGLang's: the first one set
        if v is not None and most is not None and v > most:
            raise ValueError(f"must be at most the reply's limit (max_completion_tokens or max_tokens: {most})")
        return v

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, v, info: ValidationInfo):
        if v is not None and info.data.get("stream") is False:  # absent: False; not a bool: that error is reported
            raise ValueError("only allowed when stream is true")
        return v


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions`` body (the fields laps reads; the rest pass through)."""

    messages: list[ChatMessage] = Field(min_length=1)
    # SGLang's extension: the prompt's token ids, prefilled instead of the messages rendered (which still give the stop
    # tokens); counted, checked against the vocabulary and routed as these ids
    input_ids: list[int] | None = Field(None, min_length=1)
    continue_final_message: bool | None = None  # SGLang's: the reply continues the last (assistant) message's text
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)  # OpenAI's range

    @field_validator("tool_choice")
    @classmethod
    def _chosen_tool_exists(cls, v, info: ValidationInfo):
        if not isinstance(v, dict):
            return v
        name = (v.get("function") or {}).get("name") if isinstance(v.get("function"), dict) else None
        names = [t.function.name for t in info.data.get("tools") or ()]
        if name not in names:
            raise ValueError(f"names function {name!r}, which is not in tools ({', '.join(names) or 'none given'})")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, v, info: ValidationInfo):
        if v is not None and info.data.get("logprobs") is not True:
            raise ValueError("needs logprobs: true")
        return v

    def chat(self) -> list[Message]:
        """The messages as SGLang 0.5.23 hands them to the chat template: ``{"role", "content"}`` dicts of plain text,
        the ``tool_calls`` of an assistant turn that called tools (:func:`laps.tokenizer.template_tool_calls`), and a
        last assistant message as a user one, or left out with ``continue_final_message``
        (:func:`laps.tokenizer.final_assistant_message`; then :meth:`reply_prefix` follows the template's text)."""
        return self.template_chat[0]

    def reply_prefix(self) -> str | None:
        """With ``continue_final_message`` and an assistant message last, its text: the prompt ends with it after the
        generation prompt (SGLang encodes it alone and appends the ids); else None."""
        return self.template_chat[1]

    @functools.cached_property
    def template_chat(self) -> tuple[list[Message], str | None]:
        """(:meth:`chat`, :meth:`reply_prefix`), built once per request (the handler reads them three times)."""
        chat = []
        for m in self.messages:
            message = {"role": m.role, "content": m.text()}
            if m.tool_calls:
                message["tool_calls"] = template_tool_calls([c.model_dump() for c in m.tool_calls])
            chat.append(message)
        return final_assistant_message(chat, bool(self.continue_final_message))

    def template_chars(self) -> int:
        """At most the characters the chat template prints of :meth:`chat`, and :meth:`reply_prefix`: the messages'
        text, and the tool calls' names and arguments (as the JSON the template prints, whatever the spacing they came
        with; not the markup around them)."""
        chat, prefix = self.template_chat
        return len(prefix or "") + sum(
            len(m["content"]) + sum(len(c["function"]["name"]) + len(json.dumps(c["function"]["arguments"], ensure_ascii=False))
                                    for c in m.get("tool_calls") or ()) for m in chat)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions`` body: one prompt, as text or as token ids."""

    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0)  # top alternatives per token (SGLang sets no upper bound)
    echo: bool | None = None
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _single_prompt(cls, v):
        if isinstance(v, list) and v and all(isinstance(p, str) for p in v):
            if len(v) != 1:
                raise ValueError("laps serves one prompt per request; send a list of prompts as separate requests")
            v = v[0]
        if isinstance(v, str) or (isinstance(v, list) and all(type(t) is int for t in v)):
            if not v:
                raise ValueError("prompt is empty")
            return v
        raise ValueError("prompt must be a string, a list of token ids, or a list of one string")
