"""Workloads: streams of conversations (ordered user turns) built from real data.

A :class:`Conversation` is a tuple of :class:`Turn` (user message text and the
``max_tokens`` to request) plus, for trace replay, a scheduled start time. The
assistant replies are not part of the workload: the runner sends each turn with
the replies it actually received.

Data sets (``--dataset`` names; files and licences in ``loadgen/data/README.md``):

* ``hh-rlhf``   real multi-turn red-team chats (Anthropic hh-rlhf harmless-base
  test, 2,312 conversations, 5,756 user turns); ``max_tokens`` is the Qwen2.5
  token count of the real assistant reply.
* ``mtbench``   MT-Bench, 80 conversations of 2 turns; default ``max_tokens``.
* ``arena``     Arena-hard v0.1, 500 single-turn prompts; default ``max_tokens``.
* ``sharegpt``  ShareGPT V3 filtered first turns, 1,000 single-turn prompts.
* ``azure-conv`` replay of the Azure LLM inference trace 2023 (conversation,
  19,366 requests, ~1 h): arrival times relative to the first request, and
  prompts of exactly ``ContextTokens`` templated tokens made from real text
  (see :class:`ExactLengthPrompts`); ``max_tokens`` = ``GeneratedTokens``.
* ``mixed``     real chats (hh-rlhf and mtbench) plus a share of long
  single-turn requests: real text cut to a ``ContextTokens`` value drawn from
  the Azure rows above 1,024 tokens (so 1,025–14,050), ``max_tokens`` from the
  same row.
* ``docs``      the ``mixed`` stream with half the requests long (document-heavy).
* ``chat-single`` single-turn chats: every first user turn of hh-rlhf, Arena,
  ShareGPT and MT-Bench (3,891 prompts, 90% under 256 templated tokens),
  each asking the default ``max_tokens`` (256).
* ``shared-docs`` prefix-heavy long context, our own construction: documents
  of 10k–30k templated tokens cut from real text, each asked 3–8 questions
  (a real chat first turn after the document); four documents are open at a
  time and their questions arrive interleaved, so most of a request's tokens
  are a document an earlier request already sent; 10% of arrivals are a
  short chat question alone. Replies ask 128 tokens.
* ``code-burst`` bursty code completion, our own construction in the shape of
  Splitwise's coding trace (median prompt 1,500 tokens, median output 13):
  one hour of single-turn requests at 5.5 per second on average, arriving in
  bursts (:func:`code_burst_rows`), prompts of exact token counts made from
  real chat text as ``azure-conv``'s (the lengths are code completion's, the
  text is not code). Replayed like a trace (``--time-scale``).
* shifting (:func:`shifting_workload`, not a ``--dataset`` name: it takes
  its own rate and phases) the ``mixed`` stream with a long share that
  changes phase by phase, e.g. chat-heavy, then document-heavy, then back.
* ``replay:PATH`` the turns recorded in a ``--trace-out`` JSONL file, each
  conversation starting at its recorded time.
* public trace files (readers in :mod:`loadgen.trace_files`):
  ``mooncake:PATH`` a Mooncake JSONL trace replayed at its times, prompts of
  exactly ``input_length`` tokens whose 512-token blocks are equal where the
  hash ids are (:mod:`loadgen.block_prompts`); ``azure:PATH`` any Azure LLM
  inference CSV (2023 or 2024) replayed as ``azure-conv``; ``sharegpt:PATH``
  ShareGPT conversations (or first-turn prompts), multi-turn, each turn asking its recorded reply's
  length, Poisson arrivals; ``lengths:PATH`` a token-count CSV, single-turn
  requests of each row's prompt and output tokens, Poisson arrivals. Requests
  that would pass the model's context are left out and counted
  (:attr:`Workload.rows`).

Poisson data sets are endless: each pass over the file is a fresh seeded
shuffle. Every random choice comes from the ``random.Random`` passed in.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from laps.tokenizer import CHATML_GENERATION_PROMPT, ChatTokenizer, load_tokenizer, render_chatml_turn
from loadgen.block_prompts import BlockPrompts
from loadgen.trace_files import (
    MooncakeRow, RecordedConversation, TraceRow, read_azure, read_jsonl_lines, read_lengths, read_mooncake,
    read_sharegpt,
)

DATA_DIR = Path(__file__).resolve().parent / "data"
DEFAULT_MAX_TOKENS = 256
LONG_MIN_CONTEXT_TOKENS = 1024
DATASETS = ("hh-rlhf", "mtbench", "arena", "sharegpt", "azure-conv", "mixed", "docs", "chat-single", "shared-docs", "code-burst")
TIMED_DATASETS = ("azure-conv", "code-burst")  # replayed at their own arrival times (a speed-up, not a rate)
REPLAY_PREFIX = "replay:"
TRACE_FORMATS = ("mooncake", "azure", "sharegpt", "lengths")  # --dataset FORMAT:PATH
# Special-token strings: a text holding one would be tokenized as a control token.
_SPECIAL_MARK = "<|"


@dataclass(frozen=True)
class Turn:
    """One user turn: ``content`` is the user message, ``max_tokens`` the output length to request (>= 1)."""

    content: str
    max_tokens: int


@dataclass(frozen=True)
class Conversation:
    """Ordered user turns of one conversation.

    ``id`` is unique within a workload stream; ``source`` names the data set it
    came from (``mixed`` streams hold several); ``start_s`` is the scheduled
    start in seconds from the first trace request (trace replay) or ``None``
    (the runner draws Poisson arrivals).
    """

    id: str
    source: str
    turns: tuple[Turn, ...]
    start_s: float | None = None


@dataclass
class Workload:
    """A named stream of conversations.

    ``conversations`` is a one-shot iterator; it is endless for Poisson data
    sets and finite, ordered by ``start_s``, when ``timed`` (trace replay).
    ``notes`` says where the workload departs from its data (goes into the report).
    """

    name: str
    conversations: Iterator[Conversation]
    timed: bool
    notes: list[str] = field(default_factory=list)
    rows: TraceRowCounts | None = None


@dataclass(frozen=True)
class TraceRowCounts:
    """How many rows a trace file had (``read``) and how many were left out because the request would pass the
    model's context (``over_context``: prompt + output tokens > ``context_tokens``; None: no limit known)."""

    read: int
    over_context: int
    context_tokens: int | None

    def to_dict(self) -> dict:
        """The report's ``trace_rows`` entry."""
        return {"read": self.read, "over_context": self.over_context, "context_tokens": self.context_tokens}


def _read_jsonl(path: Path) -> list[dict]:
    return [row for _, row in read_jsonl_lines(path)]


def load_hh_rlhf(tokenizer: ChatTokenizer, path: Path = DATA_DIR / "hh_rlhf_harmless_base_test_conversations.jsonl.gz") -> list[Conversation]:
    """The hh-rlhf conversations in file order (2,312 conversations, 5,756 user turns).

    A turn's reply is every assistant message up to the next user message,
    joined (8 conversations have two assistant messages in a row);
    ``max_tokens`` is the reply's token count with ``tokenizer``, floored at 1
    (4 replies in the file are empty).
    """
    conversations = []
    for row in _read_jsonl(path):
        turns: list[Turn] = []
        pending: str | None = None
        reply: list[str] = []
        for message in row["messages"]:
            if message["role"] == "user":
                if pending is not None:
                    turns.append(Turn(pending, max(1, len(tokenizer.encode("".join(reply))))))
                pending, reply = message["content"], []
            else:
                reply.append(message["content"])
        if pending is not None:
            turns.append(Turn(pending, max(1, len(tokenizer.encode("".join(reply))))))
        conversations.append(Conversation(f"hh-{row['conversation_id']}", "hh-rlhf", tuple(turns)))
    return conversations


def load_mtbench(max_tokens: int = DEFAULT_MAX_TOKENS, path: Path = DATA_DIR / "mtbench_questions_2turn.jsonl") -> list[Conversation]:
    """The 80 MT-Bench questions as 2-turn conversations, each turn asking ``max_tokens``."""
    return [
        Conversation(f"mtbench-{row['question_id']}", "mtbench", tuple(Turn(t, max_tokens) for t in row["turns"]))
        for row in _read_jsonl(path)
    ]


def load_arena(max_tokens: int = DEFAULT_MAX_TOKENS, path: Path = DATA_DIR / "arena_hard_v0.1_prompts.jsonl") -> list[Conversation]:
    """The 500 Arena-hard v0.1 prompts as single-turn conversations asking ``max_tokens``."""
    return [Conversation(f"arena-{row['uid']}", "arena", (Turn(row["prompt"], max_tokens),)) for row in _read_jsonl(path)]


def load_sharegpt(
    max_tokens: int = DEFAULT_MAX_TOKENS, path: Path = DATA_DIR / "sharegpt_first_turn_v3_filtered_1000.jsonl"
) -> list[Conversation]:
    """The 1,000 ShareGPT V3 first-turn prompts as single-turn conversations asking ``max_tokens``."""
    return [Conversation(f"sharegpt-{row['id']}", "sharegpt", (Turn(row["prompt"], max_tokens),)) for row in _read_jsonl(path)]


def load_azure_trace(path: Path = DATA_DIR / "azure_llm_2023_conv.csv") -> list[TraceRow]:
    """The Azure 2023 conversation trace, 19,366 rows sorted by arrival (see :func:`loadgen.trace_files.read_azure`)."""
    return read_azure(path)


def real_text_corpus() -> list[str]:
    """Real prompt texts for filler: the ShareGPT and Arena prompts, minus those holding ``<|`` (1 text)."""
    texts = [c.turns[0].content for c in load_sharegpt() + load_arena()]
    return [t for t in texts if _SPECIAL_MARK not in t]


class ExactLengthPrompts:
    """Real text cut so that the templated chat has an exact token count.

    The texts are shuffled with ``rng``, joined by blank lines and tokenized
    once (~220k tokens for :func:`real_text_corpus`; longer targets reuse the
    corpus end to end). :meth:`make` takes a window of token ids at a random
    offset, decodes it, strips outer whitespace and adjusts the window until
    ``len(tokenizer.encode_chat([{"role": "user", "content": text}]))`` equals
    the target (no system message: the template's default one counts).
    """

    _STEPS_PER_OFFSET = 6
    _OFFSETS = 32

    def __init__(self, tokenizer: ChatTokenizer, rng: random.Random, texts: Sequence[str] | None = None) -> None:
        texts = list(real_text_corpus() if texts is None else texts)
        rng.shuffle(texts)
        self._tok = tokenizer
        self._rng = rng
        self._ids = tokenizer.encode("\n\n".join(texts))
        if not self._ids:
            raise ValueError("ExactLengthPrompts needs a non-empty text corpus")
        self.overhead_tokens = len(tokenizer.encode_chat([{"role": "user", "content": ""}]))
        self.min_tokens = self.overhead_tokens + 1

    def count(self, text: str) -> int:
        """Templated token count of a single user message ``text``."""
        return len(self._tok.encode_chat([{"role": "user", "content": text}]))

    def make(self, target_tokens: int) -> str:
        """A user message whose templated chat is exactly ``target_tokens`` tokens.

        Raises:
            ValueError: ``target_tokens`` < :attr:`min_tokens` (template plus one token).
            RuntimeError: no window hit the target after 32 offsets (not seen on real text).
        """
        if target_tokens < self.min_tokens:
            raise ValueError(f"target {target_tokens} tokens is below the template minimum {self.min_tokens}")
        want = target_tokens - self.overhead_tokens
        ids = self._ids * (want * 2 // len(self._ids) + 1) if want * 2 > len(self._ids) else self._ids
        for _ in range(self._OFFSETS):
            start = self._rng.randrange(len(ids) - want)
            k = want
            for _ in range(self._STEPS_PER_OFFSET):
                text = self._tok.decode(ids[start : start + k]).strip()
                n = self.count(text)
                if n == target_tokens:
                    return text
                k = max(1, min(len(ids) - start, k + target_tokens - n))
        raise RuntimeError(f"could not cut real text to exactly {target_tokens} templated tokens")


BURSTINESS_RANGE = (0.01, 100.0)
"""The gamma shapes :func:`arrival_times` takes: coefficients of variation from 10 down to 0.1. Below 0.01 most gaps
round to 0.0 s in floating point (every arrival at one instant); above 100 the gaps are all but equal."""


def arrival_times(rate: float, rng: random.Random, burstiness: float = 1.0) -> Iterator[float]:
    """Endless arrival times (seconds from 0) at ``rate`` per second on average: cumulative gaps drawn from ``rng``.

    ``burstiness`` 1 is a Poisson process (``rng.expovariate(rate)`` gaps); any other value draws gamma gaps of shape
    ``burstiness`` and mean ``1 / rate`` (scale ``1 / (rate * burstiness)``), whose coefficient of variation is
    ``1 / sqrt(burstiness)``: below 1 the arrivals come in bursts (0.25: CV 2), above 1 more evenly than Poisson. The
    meaning ``--burstiness`` has in ``vllm bench serve`` (docs.vllm.ai, CLI reference); SGLang 0.5.23's
    ``bench_serving`` draws Poisson gaps only.

    Raises:
        ValueError: at the call, ``rate`` <= 0 or ``burstiness`` outside :data:`BURSTINESS_RANGE`.
    """
    if rate <= 0:
        raise ValueError(f"rate must be > 0 conversations/s, got {rate}")
    low, high = BURSTINESS_RANGE
    if not low <= burstiness <= high:
        raise ValueError(f"burstiness must be between {low:g} and {high:g} (1 = Poisson), got {burstiness}")
    if burstiness == 1.0:
        gaps = (rng.expovariate(rate) for _ in itertools.count())
    else:
        scale_s = 1.0 / (rate * burstiness)
        gaps = (rng.gammavariate(burstiness, scale_s) for _ in itertools.count())
    return itertools.accumulate(gaps)


def _shuffled_passes(items: Sequence[Any], rng: random.Random) -> Iterator[tuple[str, Any]]:
    """Endless ``(id suffix, item)`` over ``items``, each pass a fresh ``rng`` shuffle: the suffix is ``""`` on the
    first pass and ``#pass`` after it (``#1``, ``#2``, ...), so that ids stay unique."""
    for n in itertools.count():
        order = list(items)
        rng.shuffle(order)
        for item in order:
            yield (f"#{n}" if n else ""), item


def cycle_shuffled(conversations: Sequence[Conversation], rng: random.Random) -> Iterator[Conversation]:
    """Endless stream over ``conversations``: each pass is a fresh ``rng`` shuffle.

    From the second pass on, ids get a ``#pass`` suffix (``mtbench-81#1``) so
    they stay unique.
    """
    if not conversations:
        raise ValueError("cannot cycle over an empty data set")
    for suffix, c in _shuffled_passes(conversations, rng):
        yield Conversation(c.id + suffix, c.source, c.turns, c.start_s) if suffix else c


def _fits(prompt_tokens: int, output_tokens: int, context_tokens: int | None) -> bool:
    """Whether SGLang takes a request of ``prompt_tokens`` asking ``output_tokens``: input + max_new_tokens within
    the context (it refuses ``input >= context`` and ``input + max_new_tokens > context``)."""
    return context_tokens is None or prompt_tokens + output_tokens <= context_tokens


def _over_context_note(name: str, over: int, read: int, context_tokens: int | None, unit: str = "rows") -> list[str]:
    if not over:
        return []
    return [f"{name}: {over} of {read} {unit} left out: prompt plus output tokens pass the context of {context_tokens} tokens"]


def _length_trace(name: str, stream: Iterator[Conversation], lengths: Sequence[tuple[int, int]], kept: int,
                  min_tokens: int, columns: tuple[str, str], max_context_tokens: int | None,
                  timed: bool = True) -> Workload:
    """The workload of a length trace with its notes: rows below the template's minimum (their prompts get
    it), rows asking no output (they ask 1 token) and rows left out past the context. ``lengths``: each row's
    (prompt, output) tokens as the trace gives them; ``columns``: the trace's names for the two; ``timed``: the
    stream carries arrival times (else Poisson)."""
    below = sum(n < min_tokens for n, _ in lengths)
    notes = []
    if below:
        notes.append(f"{name}: {below} of {len(lengths)} trace rows have {columns[0]} below the chat template's minimum "
                     f"of {min_tokens} tokens; their prompts are {min_tokens} tokens")
    no_output = sum(o < 1 for _, o in lengths)
    if no_output:
        notes.append(f"{name}: {no_output} of {len(lengths)} trace rows have {columns[1]} 0; they ask max_tokens 1")
    over = len(lengths) - kept
    notes += _over_context_note(name, over, len(lengths), max_context_tokens)
    return Workload(name, stream, timed=timed, notes=notes, rows=TraceRowCounts(len(lengths), over, max_context_tokens))


# code-burst (code_burst_rows): Splitwise (Patel et al., ISCA 2024) gives its coding trace's median prompt as 1,500
# tokens and its median output as 13; the spreads, the cut and the bursts below are our choices.
CODE_PROMPT_MEDIAN_TOKENS = 1500
CODE_OUTPUT_MEDIAN_TOKENS = 13
CODE_PROMPT_SIGMA = 0.9  # log-normal spread: P90 about 4,800 tokens
CODE_OUTPUT_SIGMA = 1.3
CODE_MAX_PROMPT_TOKENS = 8000
CODE_MAX_OUTPUT_TOKENS = 1000
CODE_BURST_RATE_RPS = 5.5  # mean arrivals per second over the trace (the Azure 2023 traces run at ~5.5)
CODE_BURST_DURATION_S = 3600.0
CODE_BURST_ON_MEAN_S = 15.0  # bursts last 15 s on average, the quiet spells between them 45 s,
CODE_BURST_OFF_MEAN_S = 45.0
CODE_BURST_PEAK_RATIO = 4.0  # and a burst's rate is 4 times a quiet spell's


def code_burst_rows(rng: random.Random, duration_s: float = CODE_BURST_DURATION_S,
                    mean_rate_rps: float = CODE_BURST_RATE_RPS) -> list[TraceRow]:
    """Rows of the ``code-burst`` workload: ``duration_s`` seconds of requests, sorted by arrival.

    Arrivals: an on/off modulated Poisson process. Bursts and quiet spells
    alternate with exponential lengths (means :data:`CODE_BURST_ON_MEAN_S`,
    :data:`CODE_BURST_OFF_MEAN_S`), a burst's rate is :data:`CODE_BURST_PEAK_RATIO`
    times a quiet spell's, and the two rates are set so the time-average rate
    is ``mean_rate_rps`` (quiet rate = mean / (on share * ratio + off share)).
    Lengths: prompt tokens log-normal with median
    :data:`CODE_PROMPT_MEDIAN_TOKENS` (sigma :data:`CODE_PROMPT_SIGMA`) cut to
    [1, :data:`CODE_MAX_PROMPT_TOKENS`], output tokens log-normal with median
    :data:`CODE_OUTPUT_MEDIAN_TOKENS` (sigma :data:`CODE_OUTPUT_SIGMA`) cut to
    [1, :data:`CODE_MAX_OUTPUT_TOKENS`]. The first row arrives at 0.
    """
    on_share = CODE_BURST_ON_MEAN_S / (CODE_BURST_ON_MEAN_S + CODE_BURST_OFF_MEAN_S)
    quiet_rps = mean_rate_rps / (on_share * CODE_BURST_PEAK_RATIO + 1.0 - on_share)
    arrivals: list[float] = []
    t, burst = 0.0, rng.random() < on_share
    while t < duration_s:
        end = min(duration_s, t + rng.expovariate(1.0 / (CODE_BURST_ON_MEAN_S if burst else CODE_BURST_OFF_MEAN_S)))
        rate = quiet_rps * (CODE_BURST_PEAK_RATIO if burst else 1.0)
        while (t := t + rng.expovariate(rate)) < end:
            arrivals.append(t)
        t, burst = end, not burst
    first = arrivals[0] if arrivals else 0.0

    def lognormal(median: int, sigma: float, top: int) -> int:
        return min(top, max(1, round(median * math.exp(rng.gauss(0.0, sigma)))))

    return [TraceRow(a - first, lognormal(CODE_PROMPT_MEDIAN_TOKENS, CODE_PROMPT_SIGMA, CODE_MAX_PROMPT_TOKENS),
                     lognormal(CODE_OUTPUT_MEDIAN_TOKENS, CODE_OUTPUT_SIGMA, CODE_MAX_OUTPUT_TOKENS)) for a in arrivals]


def azure_workload(name: str, rows: Sequence[TraceRow], tokenizer: ChatTokenizer, rng: random.Random,
                   max_context_tokens: int | None = None, source: str = "azure") -> Workload:
    """Replay of an Azure LLM trace: each row a single-turn request at its arrival time.

    The prompt is real text of exactly ``ContextTokens`` templated tokens
    (:class:`ExactLengthPrompts`; rows below the template's minimum get the
    minimum), ``max_tokens`` is ``GeneratedTokens`` (at least 1); rows whose
    prompt plus output pass ``max_context_tokens`` are left out and counted
    (:attr:`Workload.rows`). Conversation ids are ``{source}-{row index}``.
    """
    prompts = ExactLengthPrompts(tokenizer, rng)
    kept = [(i, r) for i, r in enumerate(rows)
            if _fits(max(r.context_tokens, prompts.min_tokens), max(1, r.generated_tokens), max_context_tokens)]

    def stream() -> Iterator[Conversation]:
        for i, row in kept:
            text = prompts.make(max(row.context_tokens, prompts.min_tokens))
            yield Conversation(f"{source}-{i}", source, (Turn(text, max(1, row.generated_tokens)),), row.arrival_s)

    return _length_trace(name, stream(), [(r.context_tokens, r.generated_tokens) for r in rows], len(kept), prompts.min_tokens,
                         ("ContextTokens", "GeneratedTokens"), max_context_tokens)


def mooncake_workload(name: str, rows: Sequence[MooncakeRow], tokenizer: ChatTokenizer, rng: random.Random,
                      max_context_tokens: int | None = None) -> Workload:
    """Replay of a Mooncake trace: each row a single-turn request at its arrival time, prefix reuse kept.

    The prompt is a :class:`~loadgen.block_prompts.BlockPrompts` message from
    :func:`real_text_corpus`: exactly ``input_length`` templated tokens, equal
    512-token blocks where the hash ids are equal; ``max_tokens`` is
    ``output_length`` (at least 1). Rows whose prompt plus output pass
    ``max_context_tokens`` are left out and counted (:attr:`Workload.rows`).
    Conversation ids are ``mooncake-{row index}``.
    """
    prompts = BlockPrompts(tokenizer, rng, real_text_corpus())
    kept = [(i, r) for i, r in enumerate(rows)
            if _fits(max(r.input_length, prompts.min_tokens), max(1, r.output_length), max_context_tokens)]

    def stream() -> Iterator[Conversation]:
        for i, row in kept:
            text = prompts.make(max(row.input_length, prompts.min_tokens), row.hash_ids)
            yield Conversation(f"mooncake-{i}", "mooncake", (Turn(text, max(1, row.output_length)),), row.arrival_s)

    return _length_trace(name, stream(), [(r.input_length, r.output_length) for r in rows], len(kept), prompts.min_tokens,
                         ("input_length", "output_length"), max_context_tokens)


def lengths_workload(name: str, rows: Sequence[tuple[int, int]], tokenizer: ChatTokenizer, rng: random.Random,
                     max_context_tokens: int | None = None) -> Workload:
    """Single-turn requests of a token-count trace's (prompt, output) rows, Poisson arrivals, endless seeded shuffles.

    Each prompt is real text cut to exactly the row's prompt tokens
    (:class:`ExactLengthPrompts`, made as the stream reaches it: prompts share
    no prefix beyond the chat template); ``max_tokens`` is the row's output
    (at least 1). Rows whose prompt plus output pass ``max_context_tokens``
    are left out and counted (:attr:`Workload.rows`). Conversation ids are
    ``lengths-{row index}``, with ``#pass`` from the second pass on.
    """
    prompts = ExactLengthPrompts(tokenizer, rng)
    kept = [(i, max(n, prompts.min_tokens), max(1, o)) for i, (n, o) in enumerate(rows)
            if _fits(max(n, prompts.min_tokens), max(1, o), max_context_tokens)]
    if not kept:
        raise ValueError(f"{name}: every row passes the context of {max_context_tokens} tokens")

    def stream() -> Iterator[Conversation]:
        for suffix, (i, prompt_tokens, output_tokens) in _shuffled_passes(kept, rng):
            yield Conversation(f"lengths-{i}{suffix}", "lengths", (Turn(prompts.make(prompt_tokens), output_tokens),))

    return _length_trace(name, stream(), rows, len(kept), prompts.min_tokens, ("prompt tokens", "output tokens"),
                         max_context_tokens, timed=False)


def _chat_tokens(tokenizer: ChatTokenizer, exchanges: Sequence[tuple[str, str]]) -> Iterator[int]:
    """Templated prompt tokens of the chat before each reply: user 1; user 1, reply 1, user 2; ... (as sent).

    ``exchanges`` are (user, reply) texts. ChatML tokenizers count turn by
    turn (their chats are the concatenation of their turns); others encode
    each chat whole.
    """
    if tokenizer.chatml is not None:
        system = tokenizer.chatml.default_system
        used = len(tokenizer.encode(render_chatml_turn("system", system))) if system is not None else 0
        closing = len(tokenizer.encode(CHATML_GENERATION_PROMPT))
        for user, reply in exchanges:
            used += len(tokenizer.encode(render_chatml_turn("user", user)))
            yield used + closing
            used += len(tokenizer.encode(render_chatml_turn("assistant", reply)))
        return
    history: list[dict[str, str]] = []
    for user, reply in exchanges:
        history.append({"role": "user", "content": user})
        yield len(tokenizer.encode_chat(history))
        history.append({"role": "assistant", "content": reply})


def sharegpt_workload(name: str, recorded: Sequence[RecordedConversation], tokenizer: ChatTokenizer,
                      rng: random.Random, max_tokens: int = DEFAULT_MAX_TOKENS,
                      max_context_tokens: int | None = None) -> Workload:
    """ShareGPT conversations, multi-turn, arriving as a Poisson process (endless seeded shuffles, :func:`cycle_shuffled`).

    Each user message is a turn whose ``max_tokens`` is the token count of the
    recorded reply (at least 1; ``max_tokens`` when the conversation ends
    without one). With ``max_context_tokens``, a conversation stops before the
    first turn whose chat so far (the recorded replies standing in for the
    ones that will come) plus its ``max_tokens`` passes the context; the turns
    left out are counted (:attr:`Workload.rows` counts turns).
    """
    conversations, turns_read, turns_over = [], 0, 0
    for conv in recorded:
        turns = [Turn(e.user, max(1, len(tokenizer.encode(e.reply))) if e.reply is not None else max_tokens)
                 for e in conv.exchanges]
        turns_read += len(turns)
        if max_context_tokens is not None:
            sent = _chat_tokens(tokenizer, [(e.user, e.reply or "") for e in conv.exchanges])
            fit = next((k for k, (t, n) in enumerate(zip(turns, sent)) if not _fits(n, t.max_tokens, max_context_tokens)),
                       len(turns))
            turns_over += len(turns) - fit
            turns = turns[:fit]
        if turns:
            conversations.append(Conversation(f"sharegpt-{conv.id}", "sharegpt", tuple(turns)))
    if not conversations:
        raise ValueError(f"{name}: every conversation passes the context of {max_context_tokens} tokens from its first turn")
    notes = [f"{name}: {len(conversations)} conversations, {turns_read - turns_over} turns"]
    notes += _over_context_note(name, turns_over, turns_read, max_context_tokens, unit="turns")
    return Workload(name, cycle_shuffled(conversations, rng), timed=False, notes=notes,
                    rows=TraceRowCounts(turns_read, turns_over, max_context_tokens))


def long_arrival_probability(long_share: float, mean_chat_turns: float) -> float:
    """Chance that an arrival is a long single-turn request so that ``long_share`` of *requests* are long.

    With p the per-arrival chance and m the chats' mean turns, the long share of
    requests is p / (p + (1 − p)·m); solving for p gives s·m / (1 − s + s·m).
    """
    if not 0.0 <= long_share <= 1.0:
        raise ValueError(f"long_share must be in [0, 1], got {long_share}")
    return long_share * mean_chat_turns / (1.0 - long_share + long_share * mean_chat_turns)


def _mixed_stream(
    chats: Sequence[Conversation], long_rows: Sequence[TraceRow], prompts: ExactLengthPrompts, p_longs: Iterable[float], rng: random.Random
) -> Iterator[Conversation]:
    """Arrival i is a long request with probability ``p_longs[i]``, else the next chat; ends with ``p_longs``."""
    chat_stream = cycle_shuffled(chats, rng)
    for i, p_long in enumerate(p_longs):
        if rng.random() < p_long:
            row = rng.choice(long_rows)
            yield Conversation(f"long-{i}", "long", (Turn(prompts.make(row.context_tokens), row.generated_tokens),))
        else:
            yield next(chat_stream)


def first_turns(tokenizer: ChatTokenizer, max_tokens: int = DEFAULT_MAX_TOKENS) -> list[Conversation]:
    """Every first user turn of hh-rlhf, Arena, ShareGPT and MT-Bench as a single-turn conversation asking ``max_tokens``.

    Texts holding ``<|`` (which would tokenize as control tokens) are left out.
    """
    sources = load_hh_rlhf(tokenizer) + load_arena() + load_sharegpt() + load_mtbench()
    return [Conversation(c.id, c.source, (Turn(c.turns[0].content, max_tokens),)) for c in sources
            if _SPECIAL_MARK not in c.turns[0].content]


SHARED_DOC_TOKENS = (10_000, 30_000)
SHARED_DOC_QUESTIONS = (3, 8)
SHARED_DOCS_OPEN = 4
SHARED_DOCS_SHORT_SHARE = 0.1
SHARED_DOCS_MAX_TOKENS = 128


def _shared_docs_stream(prompts: ExactLengthPrompts, questions: Sequence[str], rng: random.Random) -> Iterator[Conversation]:
    """The ``shared-docs`` stream (module doc): questions on the open documents, interleaved, and a few short chats."""
    def new_doc(k: int) -> list:
        return [k, prompts.make(rng.randint(*SHARED_DOC_TOKENS)), rng.randint(*SHARED_DOC_QUESTIONS)]

    opened = itertools.count()
    docs = [new_doc(next(opened)) for _ in range(SHARED_DOCS_OPEN)]
    for i in itertools.count():
        question = rng.choice(questions)
        if rng.random() < SHARED_DOCS_SHORT_SHARE:
            yield Conversation(f"chat-{i}", "shared-docs", (Turn(question, SHARED_DOCS_MAX_TOKENS),))
            continue
        slot = rng.randrange(len(docs))
        k, text, left = docs[slot]
        yield Conversation(f"doc{k}-q{i}", "shared-docs", (Turn(f"{text}\n\n{question}", SHARED_DOCS_MAX_TOKENS),))
        docs[slot] = [k, text, left - 1] if left > 1 else new_doc(next(opened))


def short_and_long_prompts(tokenizer: ChatTokenizer, rng: random.Random, n_short: int, n_long: int,
                           short_below: int = 64, long_above: int = LONG_MIN_CONTEXT_TOKENS) -> tuple[list[list[int]], list[list[int]]]:
    """Templated single-turn prompts (token ids) for the short/long interference experiment.

    Short: every first user turn of hh-rlhf, MT-Bench, Arena and ShareGPT whose
    templated chat has fewer than ``short_below`` tokens, ``n_short`` of them
    drawn with ``rng``. Long: ``n_long`` Azure 2023 trace rows with more than
    ``long_above`` ContextTokens, drawn with ``rng``, each real text cut to
    exactly that many templated tokens (:class:`ExactLengthPrompts`).
    """
    firsts = [c.turns[0].content for c in load_hh_rlhf(tokenizer) + load_mtbench() + load_arena() + load_sharegpt()]
    shorts = [ids for ids in (tokenizer.encode_chat([{"role": "user", "content": t}]) for t in firsts if _SPECIAL_MARK not in t)
              if len(ids) < short_below]
    rows = [r for r in load_azure_trace() if r.context_tokens > long_above]
    cutter = ExactLengthPrompts(tokenizer, rng)
    longs = [tokenizer.encode_chat([{"role": "user", "content": cutter.make(rng.choice(rows).context_tokens)}])
             for _ in range(n_long)]
    return [rng.choice(shorts) for _ in range(n_short)], longs


@dataclass(frozen=True)
class Phase:
    """``duration_s`` seconds of a shifting workload in which ``long_share`` of the requests are long documents."""

    duration_s: float
    long_share: float


def chat_docs_chat(chat_s: float, docs_s: float, back_s: float, chat_long_share: float = 0.05,
                   docs_long_share: float = 0.5) -> tuple[Phase, Phase, Phase]:
    """The three phases of the rebalancing experiment: chat-heavy, document-heavy, chat-heavy again."""
    return Phase(chat_s, chat_long_share), Phase(docs_s, docs_long_share), Phase(back_s, chat_long_share)


def shifting_workload(rng: random.Random, *, rate: float, phases: Sequence[Phase], tokenizer: ChatTokenizer | None = None,
                      default_max_tokens: int = DEFAULT_MAX_TOKENS) -> Workload:
    """A timed workload whose mix shifts: the ``mixed`` stream with each phase's long share.

    Conversations start as a Poisson process at ``rate`` per second (gaps from
    a generator seeded by ``rng``) until the phases end; a conversation that
    starts in a phase is long with that phase's
    :func:`long_arrival_probability`. Chats (hh-rlhf and MT-Bench) and long
    documents (real text cut to Azure ContextTokens above 1,024) are those of
    ``mixed``; a chat's later turns may fall in the next phase.

    Raises:
        ValueError: no phases, a phase of ``duration_s`` <= 0, a long share
            outside [0, 1], or ``rate`` <= 0.
    """

    if not phases or any(p.duration_s <= 0 for p in phases):
        raise ValueError(f"phases must be at least one phase, each with duration_s > 0; got {list(phases)}")
    tok = tokenizer if tokenizer is not None else load_tokenizer(None)
    chats = load_hh_rlhf(tok) + load_mtbench(default_max_tokens)
    mean_turns = sum(len(c.turns) for c in chats) / len(chats)
    p_long = [long_arrival_probability(p.long_share, mean_turns) for p in phases]
    ends = list(itertools.accumulate(p.duration_s for p in phases))
    times = list(itertools.takewhile(lambda t: t < ends[-1], arrival_times(rate, random.Random(rng.random()))))
    long_rows = [r for r in load_azure_trace() if r.context_tokens > LONG_MIN_CONTEXT_TOKENS]
    phase_of = [bisect.bisect_right(ends, t) for t in times]
    stream = _mixed_stream(chats, long_rows, ExactLengthPrompts(tok, rng), (p_long[i] for i in phase_of), rng)
    conversations = (replace(c, start_s=t) for t, c in zip(times, stream))
    notes = ["shifting: " + ", then ".join(f"{p.duration_s:g} s with long share {p.long_share:g} (p_long {q:.3f})"
                                          for p, q in zip(phases, p_long))]
    return Workload("shifting", conversations, timed=True, notes=notes)


_REPLAY_FIELDS = {"conversation_id": str, "source": str, "turn": int, "user": str, "max_tokens": int, "start_s": (int, float)}
"""The fields :func:`load_replay` reads from each ``--trace-out`` record, with their JSON types."""


def _check_replay_record(rec: Any, where: str) -> None:
    """Raise ``ValueError`` (starting with ``where``) unless ``rec`` is an object with every :data:`_REPLAY_FIELDS` field."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a --trace-out record (a JSON object), got {type(rec).__name__}")
    missing = [key for key in _REPLAY_FIELDS if key not in rec]
    if missing:
        raise ValueError(f"{where}: not a --trace-out record: missing {', '.join(missing)}")
    for key, kind in _REPLAY_FIELDS.items():
        if not isinstance(rec[key], kind) or isinstance(rec[key], bool):
            raise ValueError(f"{where}: {key} has the wrong type ({rec[key]!r})")
    if rec["max_tokens"] < 1:
        raise ValueError(f"{where}: max_tokens must be >= 1, got {rec['max_tokens']}")


def load_replay(path: Path) -> Workload:
    """A timed workload from a ``--trace-out`` JSONL file.

    Records are grouped by ``conversation_id``; turns keep their recorded order
    (``turn``), user text and ``max_tokens``; each conversation starts at its
    first record's ``start_s``. Later turns follow the runner's think time, not
    the recorded send times.

    Raises:
        ValueError: the file cannot be read, or a line is not JSON or not a
            record with the fields above (the message names the file and line).
    """
    path = Path(path)
    by_conv: dict[str, list[dict]] = {}
    for line_no, rec in read_jsonl_lines(path):
        _check_replay_record(rec, f"{path} line {line_no}")
        by_conv.setdefault(rec["conversation_id"], []).append(rec)
    conversations = []
    for cid, recs in by_conv.items():
        recs.sort(key=lambda r: r["turn"])
        turns = tuple(Turn(r["user"], r["max_tokens"]) for r in recs)
        conversations.append(Conversation(cid, recs[0]["source"], turns, recs[0]["start_s"]))
    conversations.sort(key=lambda c: c.start_s)
    return Workload(f"{REPLAY_PREFIX}{path}", iter(conversations), timed=True)


_TEXT_SETS = {"mtbench": load_mtbench, "arena": load_arena, "sharegpt": load_sharegpt}


def build_workload(
    name: str,
    rng: random.Random,
    *,
    tokenizer: ChatTokenizer | None = None,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    long_share: float = 0.2,
    max_context_tokens: int | None = None,
) -> Workload:
    """The workload called ``name``: one of :data:`DATASETS`, ``replay:PATH`` or a trace file ``FORMAT:PATH``
    (``FORMAT`` one of :data:`TRACE_FORMATS`; :func:`mooncake_workload`, :func:`azure_workload`,
    :func:`sharegpt_workload`, :func:`lengths_workload`).

    ``tokenizer`` (default: the built-in Qwen2.5 one) counts reply lengths and
    cuts exact-length prompts; ``default_max_tokens`` is used where the data
    has no output length; ``long_share`` (``mixed`` only) is the expected share
    of *requests* that are long (see :func:`long_arrival_probability`; when
    ``--duration`` cuts chats short the realised share comes out a little higher);
    ``max_context_tokens`` (trace files and ``azure-conv``) leaves out the
    requests that would pass the model's context, counted in :attr:`Workload.rows`.

    Raises:
        ValueError: unknown ``name``, ``long_share`` outside [0, 1], or a
            ``replay:PATH`` or trace file that its reader refuses (the message
            names the file and line).
    """
    if name.startswith(REPLAY_PREFIX):
        return load_replay(Path(name[len(REPLAY_PREFIX) :]))
    tok = tokenizer if tokenizer is not None else load_tokenizer(None)
    kind, colon, path = name.partition(":")
    if colon and not path and kind in TRACE_FORMATS:
        raise ValueError(f"dataset {name!r}: name the trace file, {kind}:PATH")
    if path and kind in TRACE_FORMATS:
        if kind == "mooncake":
            return mooncake_workload(name, read_mooncake(Path(path)), tok, rng, max_context_tokens)
        if kind == "azure":
            return azure_workload(name, read_azure(Path(path)), tok, rng, max_context_tokens)
        if kind == "lengths":
            return lengths_workload(name, read_lengths(Path(path)), tok, rng, max_context_tokens)
        return sharegpt_workload(name, read_sharegpt(Path(path)), tok, rng, default_max_tokens, max_context_tokens)
    if name == "hh-rlhf":
        return Workload(name, cycle_shuffled(load_hh_rlhf(tok), rng), timed=False)
    if name in _TEXT_SETS:
        return Workload(name, cycle_shuffled(_TEXT_SETS[name](default_max_tokens), rng), timed=False)
    if name == "azure-conv":
        return azure_workload(name, load_azure_trace(), tok, rng, max_context_tokens, source="azure-conv")
    if name == "code-burst":
        return azure_workload(name, code_burst_rows(rng), tok, rng, max_context_tokens, source="code-burst")
    if name == "chat-single":
        return Workload(name, cycle_shuffled(first_turns(tok, default_max_tokens), rng), timed=False)
    if name == "shared-docs":
        questions = [c.turns[0].content for c in first_turns(tok) if len(c.turns[0].content) < 400]
        return Workload(name, _shared_docs_stream(ExactLengthPrompts(tok, rng), questions, rng), timed=False)
    if name in ("mixed", "docs"):
        long_share = 0.5 if name == "docs" else long_share
        chats = load_hh_rlhf(tok) + load_mtbench(default_max_tokens)
        p_long = long_arrival_probability(long_share, sum(len(c.turns) for c in chats) / len(chats))
        long_rows = [r for r in load_azure_trace() if r.context_tokens > LONG_MIN_CONTEXT_TOKENS]
        stream = _mixed_stream(chats, long_rows, ExactLengthPrompts(tok, rng), itertools.repeat(p_long), rng)
        notes = [
            f"{name}: {p_long:.3f} of arriving conversations are one long request each, the others multi-turn chats, "
            f"so that {long_share:.0%} of requests are long (long_share); their ContextTokens come from the "
            f"{len(long_rows)} Azure rows above {LONG_MIN_CONTEXT_TOKENS}"
        ]
        return Workload(name, stream, timed=False, notes=notes)
    raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}, replay:PATH or "
                     f"{', '.join(f'{k}:PATH' for k in TRACE_FORMATS)}")
