"""Readers of public LLM-serving trace files: Mooncake JSONL, Azure LLM inference CSV, ShareGPT JSON, token-count CSV.

Each reader returns plain rows (no prompts, no tokenizer) and refuses a bad
row with a ``ValueError`` whose message starts ``PATH line N:`` and says what
is wrong, so a user can fix the file. Files ending in ``.gz`` are read through
gzip.

* **Mooncake** (kvcache-ai/Mooncake, ``FAST25-release/traces/*.jsonl``): one
  JSON object a line, ``timestamp`` (ms from the trace start), ``input_length``
  and ``output_length`` (tokens), ``hash_ids`` (one id per 512-token block of
  the prompt; equal ids are equal blocks, i.e. reusable prefix KV).
* **Azure LLM inference** (Azure/AzurePublicDataset, 2023
  ``AzureLLMInferenceTrace_{conv,code}.csv`` and 2024
  ``AzureLLMInferenceTrace_{conv,code}_1week.csv``): ``TIMESTAMP,ContextTokens,
  GeneratedTokens``. The 2023 stamps are naive with 7 fractional digits
  (``2023-11-16 18:15:46.6805900``); the 2024 ones carry an offset and 0 or 6
  digits (``2024-05-12 00:00:00.001163+00:00``, ``2024-05-12 00:00:00+00:00``).
* **ShareGPT** (``ShareGPT_V3_unfiltered_cleaned_split.json`` and its
  derivatives): a JSON array of ``{"id", "conversations": [{"from", "value"}]}``
  (``from``: ``human``/``user`` or ``gpt``/``chatgpt``/``assistant``/``bing``/
  ``bard``/``model``; ``system`` messages are dropped), or the same objects one
  per line (JSONL); OpenAI-style ``"messages": [{"role", "content"}]`` is
  accepted too.
* **Token counts** (e.g. project-etalon/etalon's
  ``sharegpt_8k_filtered_stats_llama2_tokenizer.csv``): a CSV with one request
  a row and no times, its prompt and output tokens in the columns
  ``num_prefill_tokens,num_decode_tokens`` (etalon's names) or
  ``input_tokens,output_tokens``; other columns are ignored.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import orjson

MOONCAKE_BLOCK_TOKENS = 512
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
LENGTHS_COLUMNS = (("num_prefill_tokens", "num_decode_tokens"), ("input_tokens", "output_tokens"))
SHAREGPT_USER_ROLES = frozenset({"human", "user"})
SHAREGPT_REPLY_ROLES = frozenset({"gpt", "chatgpt", "assistant", "bing", "bard", "model"})
SHAREGPT_SYSTEM_ROLES = frozenset({"system"})


@dataclass(frozen=True)
class TraceRow:
    """One request of a length trace: ``arrival_s`` after the first request, prompt and output token counts."""

    arrival_s: float
    context_tokens: int
    generated_tokens: int


@dataclass(frozen=True)
class MooncakeRow:
    """One Mooncake request: ``arrival_s`` after the first request, token counts, and one hash id per 512-token block."""

    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class ChatExchange:
    """One user message of a recorded conversation and the recorded reply that followed it (``None``: none did)."""

    user: str
    reply: str | None


@dataclass(frozen=True)
class RecordedConversation:
    """A ShareGPT conversation: its ``id`` (the file's, else ``line<N>``) and its user messages with their replies."""

    id: str
    exchanges: tuple[ChatExchange, ...]


def _open_text(path: Path) -> IO[str]:
    """``path`` opened for text (UTF-8, a leading byte-order mark dropped, universal newlines; through gzip for ``.gz``).

    Raises:
        ValueError: it cannot be opened (the message names the file).
    """
    try:
        if path.suffix == ".gz":
            return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8-sig", newline="")
        return open(path, encoding="utf-8-sig", newline="")
    except OSError as err:
        raise ValueError(f"{path}: cannot read: {err.strerror or err}") from None


def read_jsonl_lines(path: Path) -> list[tuple[int, Any]]:
    """The values of a JSONL file (gzip when it ends in ``.gz``) with their 1-based line numbers; blank lines skipped.

    Raises:
        ValueError: the file cannot be read, or a line is not JSON (the message names the file and line).
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    try:
        with opener(path, "rb") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append((line_no, orjson.loads(line)))
                except orjson.JSONDecodeError as err:
                    raise ValueError(f"{path} line {line_no}: not valid JSON ({err})") from None
    except (OSError, EOFError, zlib.error) as err:
        raise ValueError(f"{path}: cannot read: {getattr(err, 'strerror', None) or err}") from None
    return rows


def _int_field(rec: dict, key: str, where: str, minimum: int) -> int:
    value = rec.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{where}: {key} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{where}: {key} must be >= {minimum}, got {value}")
    return value


def read_mooncake(path: Path) -> list[MooncakeRow]:
    """The rows of a Mooncake trace, sorted by ``timestamp`` (stable), ``arrival_s`` relative to the earliest.

    Raises:
        ValueError: the file cannot be read; a line is not JSON, not an object,
            lacks a field, has a negative timestamp, an ``input_length`` < 1, an
            ``output_length`` < 0, or not ``ceil(input_length / 512)`` integer
            ``hash_ids``; or the file holds no row (messages name file and line).
    """
    path = Path(path)
    raw = []
    for line_no, rec in read_jsonl_lines(path):
        where = f"{path} line {line_no}"
        if not isinstance(rec, dict):
            raise ValueError(f"{where}: expected a Mooncake trace record (a JSON object), got {type(rec).__name__}")
        missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in rec]
        if missing:
            raise ValueError(f"{where}: not a Mooncake trace record: missing {', '.join(missing)}")
        stamp = rec["timestamp"]
        if not isinstance(stamp, (int, float)) or isinstance(stamp, bool) or not stamp >= 0:
            raise ValueError(f"{where}: timestamp must be a number of ms >= 0, got {stamp!r}")
        n_in = _int_field(rec, "input_length", where, 1)
        n_out = _int_field(rec, "output_length", where, 0)
        ids = rec["hash_ids"]
        blocks = math.ceil(n_in / MOONCAKE_BLOCK_TOKENS)
        if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
            raise ValueError(f"{where}: hash_ids must be a list of integers")
        if len(ids) != blocks:
            raise ValueError(f"{where}: {len(ids)} hash_ids for input_length {n_in}; "
                             f"expected {blocks} (one per {MOONCAKE_BLOCK_TOKENS}-token block)")
        raw.append((stamp, n_in, n_out, tuple(ids)))
    if not raw:
        raise ValueError(f"{path}: no Mooncake trace records")
    raw.sort(key=lambda r: r[0])
    t0 = raw[0][0]
    return [MooncakeRow((t - t0) / 1000.0, n_in, n_out, ids) for t, n_in, n_out, ids in raw]


def parse_azure_time(stamp: str) -> datetime:
    """An Azure trace ``TIMESTAMP`` (2023 or 2024 style, see module doc) as a datetime (microsecond resolution).

    Raises:
        ValueError: not an ISO date and time.
    """
    return datetime.fromisoformat(stamp.strip())


def _count(row: dict, column: str, where: str) -> int:
    """A CSV row's token count in ``column``: an integer >= 0.

    Raises:
        ValueError: it is not, or the row is too short to have it (the message starts with ``where``).
    """
    if row[column] is None:
        raise ValueError(f"{where}: no {column} field (the row has fewer fields than the header)")
    try:
        value = int(row[column])
    except ValueError:
        raise ValueError(f"{where}: {column} {row[column]!r} is not an integer") from None
    if value < 0:
        raise ValueError(f"{where}: {column} must be >= 0, got {value}")
    return value


def _csv_rows(path: Path, check_header: Callable[[list[str]], str | None]) -> Iterator[tuple[str, dict[str, str]]]:
    """The rows of a CSV file with a header, each with ``PATH line N`` for messages.

    ``check_header(header)`` returns None to accept the header, or why it refuses it.

    Raises:
        ValueError: the file cannot be read (a corrupt ``.gz`` too), is not CSV, or its header is refused;
            or the file holds no row after the header (messages name file and line).
    """
    with _open_text(path) as f:
        reader = csv.DictReader(f)
        rows = 0
        try:
            header = reader.fieldnames or []
            refusal = check_header(header)
            if refusal:
                raise ValueError(f"{path} line 1: {refusal} (header: {','.join(header) or 'empty'})")
            for row in reader:
                rows += 1
                yield f"{path} line {reader.line_num}", row
        except (csv.Error, UnicodeDecodeError) as err:
            raise ValueError(f"{path} line {max(1, reader.line_num)}: not CSV ({err})") from None
        except (OSError, EOFError, zlib.error) as err:  # zlib.error: a .gz corrupt inside
            raise ValueError(f"{path}: cannot read: {getattr(err, 'strerror', None) or err}") from None
    if not rows:
        raise ValueError(f"{path}: no rows after the header")


def read_azure(path: Path) -> list[TraceRow]:
    """The rows of an Azure LLM inference trace CSV (2023 or 2024 schema), sorted by arrival (stable).

    ``arrival_s`` is seconds after the earliest row at microsecond resolution
    (the 2023 files' 100 ns digit is dropped).

    Raises:
        ValueError: the file cannot be read, its header lacks a column of
            :data:`AZURE_COLUMNS`, a row has a bad timestamp (or mixes stamps
            with and without an offset), a token count that is not an integer
            or is < 0; or the file holds no row (messages name file and line).
    """
    def check(header: list[str]) -> str | None:
        missing = [c for c in AZURE_COLUMNS if c not in header]
        return (f"not an Azure LLM trace: no column {', '.join(missing)}; expected {','.join(AZURE_COLUMNS)}"
                if missing else None)

    path = Path(path)
    raw = []
    aware: bool | None = None
    for where, row in _csv_rows(path, check):
        try:
            t = parse_azure_time(row["TIMESTAMP"] or "")
        except ValueError:
            raise ValueError(f"{where}: TIMESTAMP {row['TIMESTAMP']!r} is not a date and time") from None
        if aware is None:
            aware = t.tzinfo is not None
        elif aware != (t.tzinfo is not None):
            raise ValueError(f"{where}: TIMESTAMP {row['TIMESTAMP']!r} mixes stamps with and without a UTC offset")
        raw.append((t, _count(row, AZURE_COLUMNS[1], where), _count(row, AZURE_COLUMNS[2], where)))
    raw.sort(key=lambda r: r[0])
    t0 = raw[0][0]
    return [TraceRow((t - t0).total_seconds(), ctx, gen) for t, ctx, gen in raw]


def read_lengths(path: Path) -> list[tuple[int, int]]:
    """The (prompt, output) token counts of a token-count CSV, one request a row, in file order.

    The columns are the first pair of :data:`LENGTHS_COLUMNS` that the header holds.

    Raises:
        ValueError: the file cannot be read, its header holds neither pair, a count is not an integer or is < 0,
            or the file holds no row (messages name file and line).
    """
    columns: list[tuple[str, str]] = []

    def check(header: list[str]) -> str | None:
        columns.extend(pair for pair in LENGTHS_COLUMNS if all(c in header for c in pair))
        expected = " or ".join(",".join(pair) for pair in LENGTHS_COLUMNS)
        return None if columns else f"not a token-count CSV: expected the columns {expected}"

    path = Path(path)
    rows = []
    for where, row in _csv_rows(path, check):
        prompt, output = columns[0]
        rows.append((_count(row, prompt, where), _count(row, output, where)))
    return rows


def _json_items(path: Path) -> Iterator[tuple[int, Any]]:
    """The items of a JSON array file, or the values of a JSONL file, each with the line it starts on.

    Raises:
        ValueError: the file cannot be read or is neither (the message names the file and line).
    """
    with _open_text(path) as f:
        try:
            text = f.read()
        except (OSError, EOFError, zlib.error, UnicodeDecodeError) as err:
            raise ValueError(f"{path}: cannot read: {err}") from None
    if not text.lstrip().startswith("["):
        # "\n" alone ends a JSONL line: str.splitlines() also splits at U+2028 and other separators that JSON strings
        # may hold unescaped (a ShareGPT prompt does)
        for line_no, line in enumerate(text.split("\n"), 1):
            if line.strip():
                try:
                    yield line_no, orjson.loads(line)
                except orjson.JSONDecodeError as err:
                    raise ValueError(f"{path} line {line_no}: not valid JSON ({err})") from None
        return
    decoder = json.JSONDecoder()
    pos, line_no, counted = text.index("[") + 1, 1, 0

    def skip(p: int) -> int:
        while p < len(text) and text[p] in " \t\r\n":
            p += 1
        return p

    def line_of(p: int) -> int:
        nonlocal line_no, counted
        line_no += text.count("\n", counted, p)
        counted = p
        return line_no

    pos = skip(pos)
    if pos < len(text) and text[pos] == "]":
        return
    while True:
        try:
            item, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} line {err.lineno}: not valid JSON ({err.msg})") from None
        yield line_of(pos), item
        pos = skip(end)
        if pos < len(text) and text[pos] == ",":
            pos = skip(pos + 1)
            continue
        if pos < len(text) and text[pos] == "]":
            return
        raise ValueError(f"{path} line {line_of(min(pos, len(text)))}: expected ',' or ']' after an array item")


def _messages(item: dict, where: str) -> list[tuple[str, str]]:
    """``(role, text)`` of a ShareGPT item's ``conversations`` (or an OpenAI-style ``messages`` list, or one user
    message ``prompt``, as in files of first-turn prompts)."""
    if "conversations" not in item and "messages" not in item and "prompt" in item:
        if not isinstance(item["prompt"], str):
            raise ValueError(f"{where}: 'prompt' must be a string")
        return [("user", item["prompt"])]
    if "conversations" in item:
        messages, role_key, text_key = item["conversations"], "from", "value"
    elif "messages" in item:
        messages, role_key, text_key = item["messages"], "role", "content"
    else:
        raise ValueError(f"{where}: not a ShareGPT conversation: no 'conversations' (or 'messages') list, nor a 'prompt'")
    if not isinstance(messages, list):
        raise ValueError(f"{where}: '{'conversations' if role_key == 'from' else 'messages'}' must be a list")
    out = []
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get(role_key), str) or not isinstance(m.get(text_key), str):
            raise ValueError(f"{where}: message {k} must be an object with string '{role_key}' and '{text_key}'")
        role = m[role_key].lower()
        if role not in SHAREGPT_USER_ROLES | SHAREGPT_REPLY_ROLES | SHAREGPT_SYSTEM_ROLES:
            raise ValueError(f"{where}: message {k} has an unknown {role_key} {m[role_key]!r}")
        out.append((role, m[text_key]))
    return out


def read_sharegpt(path: Path) -> list[RecordedConversation]:
    """The conversations of a ShareGPT-style file, in file order.

    Each user message is paired with the reply messages up to the next user
    message (joined; ``None`` when there is none). Replies before the first
    user message, ``system`` messages and empty (all-whitespace) user messages
    with their replies are dropped; conversations left with no user message
    are skipped. A conversation's id is its ``id`` (``lineN``, its line, where
    it has none; ``ID@lineN`` where an earlier conversation has the same id).

    Raises:
        ValueError: the file cannot be read, is not a JSON array or JSONL, an
            item is not an object with a ``conversations`` list of
            ``{from, value}`` strings (or ``messages`` of ``{role, content}``,
            or a string ``prompt``: one user message), or no conversation is
            left (messages name file and line).
    """
    path = Path(path)
    conversations = []
    seen: set[str] = set()
    for line_no, item in _json_items(path):
        where = f"{path} line {line_no}"
        if not isinstance(item, dict):
            raise ValueError(f"{where}: expected a ShareGPT conversation (a JSON object), got {type(item).__name__}")
        exchanges: list[ChatExchange] = []
        user: str | None = None
        reply: list[str] = []
        for role, text in _messages(item, where):
            if role in SHAREGPT_USER_ROLES:
                if user is not None:
                    exchanges.append(ChatExchange(user, "".join(reply) if reply else None))
                user, reply = text, []
            elif role in SHAREGPT_REPLY_ROLES and user is not None:
                reply.append(text)
        if user is not None:
            exchanges.append(ChatExchange(user, "".join(reply) if reply else None))
        exchanges = [e for e in exchanges if e.user.strip()]
        if exchanges:
            cid = f"line{line_no}" if item.get("id") is None else str(item["id"])
            cid = f"{cid}@line{line_no}" if cid in seen else cid  # each conversation's requests need their own ids
            seen.add(cid)
            conversations.append(RecordedConversation(cid, tuple(exchanges)))
    if not conversations:
        raise ValueError(f"{path}: no conversation with a user message")
    return conversations
