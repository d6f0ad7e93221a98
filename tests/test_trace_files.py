"""Public trace files: Mooncake JSONL, Azure CSV (2023 and 2024 stamps), ShareGPT JSON; bad rows name file and line."""

import gzip
import itertools
import random

import orjson
import pytest

from laps.tokenizer import load_tokenizer
from loadgen.runner import plan_arrivals
from loadgen.trace_files import ChatExchange, read_azure, read_lengths, read_mooncake, read_sharegpt
from loadgen.workloads import build_workload

TOK = load_tokenizer()


def write_jsonl(path, rows):
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def test_mooncake_rows_are_sorted_with_seconds_from_the_first(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [
        {"timestamp": 3050, "input_length": 600, "output_length": 7, "hash_ids": [0, 2]},
        {"timestamp": 1000, "input_length": 512, "output_length": 0, "hash_ids": [0]},
    ])
    rows = read_mooncake(path)
    assert [(r.arrival_s, r.input_length, r.output_length, r.hash_ids) for r in rows] == [
        (0.0, 512, 0, (0,)), (2.05, 600, 7, (0, 2))]


def test_mooncake_reads_gzip(tmp_path):
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": [5]}\n'))
    assert read_mooncake(path)[0].hash_ids == (5,)


@pytest.mark.parametrize(("line", "expected"), [
    ("[1]", "line 2: expected a Mooncake trace record (a JSON object), got list"),
    ('{"timestamp": 0}', "line 2: not a Mooncake trace record: missing input_length, output_length, hash_ids"),
    ('{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [0]}', "line 2: timestamp must be a number of ms >= 0, got -1"),
    ('{"timestamp": 0, "input_length": "5", "output_length": 1, "hash_ids": [0]}', "line 2: input_length must be an integer, got '5'"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', "line 2: input_length must be >= 1, got 0"),
    ('{"timestamp": 0, "input_length": 513, "output_length": 1, "hash_ids": [0]}',
     "line 2: 1 hash_ids for input_length 513; expected 2 (one per 512-token block)"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}', "line 2: hash_ids must be a list of integers"),
    ("{oops", "line 2: not valid JSON"),
])
def test_a_bad_mooncake_row_names_the_file_and_line(tmp_path, line, expected):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n' + line + "\n")
    with pytest.raises(ValueError) as info:
        read_mooncake(path)
    assert str(info.value).startswith(f"{path} {expected}")


def test_azure_reads_the_2023_and_the_2024_stamps(tmp_path):
    old = tmp_path / "2023.csv"
    old.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
                   "2023-11-16 18:15:50.9951690,396,109\n")
    new = tmp_path / "2024.csv"
    new.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\r\n2024-05-12 00:00:01+00:00,584,3\r\n"
                   "2024-05-12 00:00:00.001163+00:00,1452,0\r\n")
    assert [(r.arrival_s, r.context_tokens, r.generated_tokens) for r in read_azure(old)] == [
        (0.0, 374, 44), (pytest.approx(4.314579), 396, 109)]
    assert [(r.arrival_s, r.context_tokens, r.generated_tokens) for r in read_azure(new)] == [
        (0.0, 1452, 0), (pytest.approx(0.998837), 584, 3)]


@pytest.mark.parametrize(("reader", "text", "expected"), [
    (read_azure, "time,ctx\n1,2\n", " line 1: not an Azure LLM trace: no column TIMESTAMP, ContextTokens, GeneratedTokens"),
    (read_azure, "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,1,1\nyesterday,1,1\n",
     " line 3: TIMESTAMP 'yesterday' is not a date and time"),
    (read_azure, "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,1,1\n2023-11-16 18:15:47,x,1\n",
     " line 3: ContextTokens 'x' is not an integer"),
    (read_azure, "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,1,-2\n", " line 2: GeneratedTokens must be >= 0, got -2"),
    (read_azure, "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,1,1\n2023-11-16 18:15:47+00:00,1,1\n",
     " line 3: TIMESTAMP '2023-11-16 18:15:47+00:00' mixes stamps with and without a UTC offset"),
    (read_azure, "TIMESTAMP,ContextTokens,GeneratedTokens\n", ": no rows after the header"),
    (read_lengths, "a,b\n1,2\n", " line 1: not a token-count CSV: expected the columns num_prefill_tokens,num_decode_tokens "
                                 "or input_tokens,output_tokens (header: a,b)"),
    (read_lengths, "input_tokens,output_tokens\n1,2\n3,x\n", " line 3: output_tokens 'x' is not an integer"),
    (read_lengths, "input_tokens,output_tokens\n1,2\n3\n", " line 3: no output_tokens field (the row has fewer fields than the header)"),
    (read_lengths, "input_tokens,output_tokens\n-1,2\n", " line 2: input_tokens must be >= 0, got -1"),
    (read_lengths, "input_tokens,output_tokens\n", ": no rows after the header"),
])
def test_a_bad_csv_trace_names_the_file_and_line(tmp_path, reader, text, expected):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        reader(path)
    assert str(info.value).startswith(f"{path}{expected}")


def _cut(data: bytes) -> bytes:
    return data[:20]


def _flipped(data: bytes) -> bytes:
    return data[:20] + bytes(b ^ 0xFF for b in data[20:60]) + data[60:]


@pytest.mark.parametrize("reader", [read_azure, read_lengths, read_mooncake, read_sharegpt])
@pytest.mark.parametrize("damage", [_cut, _flipped])
def test_a_corrupt_gzip_file_is_a_read_error(tmp_path, reader, damage):
    path = tmp_path / "trace.gz"
    path.write_bytes(damage(gzip.compress(b"input_tokens,output_tokens\n" + b"1000,20\n" * 2000)))
    with pytest.raises(ValueError, match=f"^{path}: cannot read: "):
        reader(path)


SHAREGPT = [
    {"id": "a", "conversations": [{"from": "system", "value": "be nice"}, {"from": "human", "value": "hi"},
                                  {"from": "gpt", "value": "Hello there, how can I help?"},
                                  {"from": "human", "value": "tell me more"}]},
    {"id": "b", "conversations": [{"from": "gpt", "value": "I start"}, {"from": "human", "value": " "}]},
    {"id": "c", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a1"},
                             {"role": "assistant", "content": " a2"}]},
]


def test_sharegpt_pairs_each_user_message_with_its_reply(tmp_path):
    path = tmp_path / "sg.json"
    path.write_bytes(orjson.dumps(SHAREGPT, option=orjson.OPT_INDENT_2))
    convs = read_sharegpt(path)
    assert [(c.id, c.exchanges) for c in convs] == [
        ("a", (ChatExchange("hi", "Hello there, how can I help?"), ChatExchange("tell me more", None))),
        ("c", (ChatExchange("q", "a1 a2"),)),
    ]
    jsonl = write_jsonl(tmp_path / "sg.jsonl", SHAREGPT)
    assert read_sharegpt(jsonl) == convs


def test_a_file_of_first_turn_prompts_reads_as_one_user_message_each(tmp_path):
    rows = [{"id": "d", "prompt": "a first turn alone", "prompt_tokens_cl100k": 4}, {"id": "e", "prompt": " "}]
    convs = read_sharegpt(write_jsonl(tmp_path / "first.jsonl", rows))  # an empty prompt is dropped, as an empty message
    assert [(c.id, c.exchanges) for c in convs] == [("d", (ChatExchange("a first turn alone", None),))]


def test_conversations_with_a_repeated_or_no_id_get_ids_of_their_own(tmp_path):
    rows = [{"id": "same", "prompt": "a"}, {"id": "same", "prompt": "b"}, {"id": None, "prompt": "c"}, {"prompt": "d"}]
    convs = read_sharegpt(write_jsonl(tmp_path / "ids.jsonl", rows))
    assert [c.id for c in convs] == ["same", "same@line2", "line3", "line4"]


def test_a_jsonl_line_holding_a_unicode_line_separator_is_one_item(tmp_path):
    path = tmp_path / "sep.jsonl"  # JSON lets U+2028 stand unescaped in a string, as in real ShareGPT prompts
    path.write_text('{"id": "k", "prompt": "one\u2028two"}\r\n{"id": "m", "prompt": "three"}\n', encoding="utf-8")
    assert "\u2028" in path.read_text(encoding="utf-8")
    assert [(c.id, c.exchanges[0].user) for c in read_sharegpt(path)] == [("k", "one\u2028two"), ("m", "three")]


@pytest.mark.parametrize(("items", "expected"), [
    ('[\n  {"id": "x", "conversations": []},\n  {"id": "y"}\n]', "line 3: not a ShareGPT conversation"),
    ('[\n  {"id": "x", "prompt": ["hi"]}\n]', "line 2: 'prompt' must be a string"),
    ('[\n  {"conversations": [{"from": "human", "value": 3}]}\n]', "line 2: message 0 must be an object with string 'from' and 'value'"),
    ('[\n  {"conversations": [{"from": "robot", "value": "x"}]}\n]', "line 2: message 0 has an unknown from 'robot'"),
    ('[\n  {"conversations": [{"from": "human", "value": "x"}]},\n  7\n]', "line 3: expected a ShareGPT conversation (a JSON object), got int"),
    ('[\n  {"conversations": [{"from": "human", "value": "x"}]}\n  {"a": 1}]', "line 3: expected ',' or ']' after an array item"),
    ('[\n  {"conversations": [{"from": "human" "value": "x"}]}]', "line 2: not valid JSON"),
])
def test_a_bad_sharegpt_file_names_the_file_and_line(tmp_path, items, expected):
    path = tmp_path / "bad.json"
    path.write_text(items)
    with pytest.raises(ValueError) as info:
        read_sharegpt(path)
    assert str(info.value).startswith(f"{path} {expected}")


def test_sharegpt_workload_asks_the_recorded_reply_lengths_and_cuts_at_the_context(tmp_path):
    path = tmp_path / "sg.json"
    path.write_bytes(orjson.dumps(SHAREGPT))
    w = build_workload(f"sharegpt:{path}", random.Random(0), tokenizer=TOK, default_max_tokens=99)
    assert not w.timed and (w.rows.read, w.rows.over_context) == (3, 0)
    convs = {c.id: c for c in itertools.islice(w.conversations, 2)}
    assert [(t.content, t.max_tokens) for t in convs["sharegpt-a"].turns] == [
        ("hi", len(TOK.encode("Hello there, how can I help?"))), ("tell me more", 99)]
    # The second turn of "a" is sent with the first exchange before it: that chat plus 99 tokens passes 60.
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello there, how can I help?"},
            {"role": "user", "content": "tell me more"}]
    assert len(TOK.encode_chat(chat)) + 99 > 60 >= len(TOK.encode_chat(chat[:1])) + len(TOK.encode("Hello there, how can I help?"))
    cut = build_workload(f"sharegpt:{path}", random.Random(0), tokenizer=TOK, default_max_tokens=99, max_context_tokens=60)
    assert (cut.rows.read, cut.rows.over_context, cut.rows.context_tokens) == (3, 1, 60)
    assert cut.notes[-1] == f"sharegpt:{path}: 1 of 3 turns left out: prompt plus output tokens pass the context of 60 tokens"
    assert {c.id: len(c.turns) for c in itertools.islice(cut.conversations, 2)} == {"sharegpt-a": 1, "sharegpt-c": 1}


def test_azure_file_workload_replays_exact_lengths_and_counts_over_long_rows(tmp_path):
    path = tmp_path / "az.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-12 00:00:00+00:00,10,0\n"
                    "2024-05-12 00:00:00.5+00:00,700,50\n2024-05-12 00:00:02+00:00,2000,100\n")
    w = build_workload(f"azure:{path}", random.Random(0), tokenizer=TOK, max_context_tokens=2050)
    assert w.timed and w.rows.to_dict() == {"read": 3, "over_context": 1, "context_tokens": 2050}
    convs = list(w.conversations)
    assert [(c.id, c.source, c.start_s, c.turns[0].max_tokens) for c in convs] == [
        ("azure-0", "azure", 0.0, 1), ("azure-1", "azure", 0.5, 50)]
    assert [len(TOK.encode_chat([{"role": "user", "content": c.turns[0].content}])) for c in convs] == [30, 700]
    assert w.notes == [f"azure:{path}: 1 of 3 trace rows have ContextTokens below the chat template's minimum of 30 tokens; their prompts are 30 tokens",
                       f"azure:{path}: 1 of 3 trace rows have GeneratedTokens 0; they ask max_tokens 1",
                           f"azure:{path}: 1 of 3 rows left out: prompt plus output tokens pass the context of 2050 tokens"]


def test_token_counts_read_either_pair_of_columns_in_file_order(tmp_path):
    etalon = tmp_path / "etalon.csv"
    etalon.write_text("num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n74,918,992,0.08\n290,0,290,inf\n")
    plain = tmp_path / "plain.csv"
    plain.write_text("output_tokens,input_tokens\n5,1000\n")
    assert read_lengths(etalon) == [(74, 918), (290, 0)]
    assert read_lengths(plain) == [(1000, 5)]
    bom = tmp_path / "bom.csv"  # as spreadsheet programs save CSV: a byte-order mark, CRLF lines
    bom.write_bytes(b"\xef\xbb\xbfinput_tokens,output_tokens\r\n7,8\r\n")
    assert read_lengths(bom) == [(7, 8)]


def test_token_count_workload_is_poisson_single_turn_at_exact_lengths(tmp_path):
    path = tmp_path / "lengths.csv"
    path.write_text("input_tokens,output_tokens\n10,0\n700,50\n2000,100\n")
    w = build_workload(f"lengths:{path}", random.Random(0), tokenizer=TOK, max_context_tokens=2050)
    assert not w.timed and w.rows.to_dict() == {"read": 3, "over_context": 1, "context_tokens": 2050}
    convs = list(itertools.islice(w.conversations, 4))
    assert sorted((c.id, c.turns[0].max_tokens) for c in convs[:2]) == [("lengths-0", 1), ("lengths-1", 50)]
    assert sorted(c.id for c in convs[2:]) == ["lengths-0#1", "lengths-1#1"]
    assert all(c.start_s is None and len(c.turns) == 1 for c in convs)
    assert sorted(len(TOK.encode_chat([{"role": "user", "content": c.turns[0].content}])) for c in convs) == [30, 30, 700, 700]
    assert w.notes == [f"lengths:{path}: 1 of 3 trace rows have prompt tokens below the chat template's minimum of 30 tokens; their prompts are 30 tokens",
                       f"lengths:{path}: 1 of 3 trace rows have output tokens 0; they ask max_tokens 1",
                       f"lengths:{path}: 1 of 3 rows left out: prompt plus output tokens pass the context of 2050 tokens"]
    path.write_text("input_tokens,output_tokens\n3000,100\n")
    with pytest.raises(ValueError, match="every row passes the context of 2050 tokens"):
        build_workload(f"lengths:{path}", random.Random(0), tokenizer=TOK, max_context_tokens=2050)


def test_max_requests_caps_the_plan_mid_conversation(tmp_path):
    path = tmp_path / "sg.json"
    path.write_bytes(orjson.dumps([SHAREGPT[0]] * 3))
    w = build_workload(f"sharegpt:{path}", random.Random(0), tokenizer=TOK)
    plan = plan_arrivals(w, duration_s=1e6, rng=random.Random(0), rate=1.0, max_requests=5)
    assert [len(a.conversation.turns) for a in plan] == [2, 2, 1]
    assert [len(a.think_s) for a in plan] == [1, 1, 0]
    with pytest.raises(ValueError, match="max_requests must be >= 1"):
        plan_arrivals(w, duration_s=1.0, rng=random.Random(0), rate=1.0, max_requests=0)


def test_a_trace_format_without_a_path_asks_for_one():
    with pytest.raises(ValueError, match=r"dataset 'lengths:': name the trace file, lengths:PATH"):
        build_workload("lengths:", random.Random(0), tokenizer=TOK)


def test_an_unknown_trace_format_lists_the_formats():
    with pytest.raises(ValueError, match=r"mooncake:PATH, azure:PATH, sharegpt:PATH, lengths:PATH"):
        build_workload("splitwise:x.csv", random.Random(0), tokenizer=TOK)
