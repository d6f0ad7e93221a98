"""Mooncake prompts: exact templated lengths, equal hash ids are equal 512-token blocks, and end to end in `laps simulate`."""

import random

import orjson
import pytest

from laps.cli import main as laps_main
from laps.config import parse_config
from laps.tokenizer import load_tokenizer
from loadgen.block_prompts import BlockPrompts
from loadgen.simulate import simulate
from loadgen.workloads import build_workload, real_text_corpus

TOK = load_tokenizer()
# (timestamp ms, input_length, output_length, hash_ids): r1 shares blocks 0-1 with r0, r3 blocks 0-1 and 3 with r1
# (its last block, full, holds the template's closing tokens), r5 is r0 again, r4 has a block 0 of its own.
ROWS = [
    (0, 1400, 5, [0, 1, 2]),
    (1000, 2000, 4, [0, 1, 3, 4]),
    (2000, 1024, 3, [0, 5]),
    (3000, 2048, 6, [0, 1, 3, 7]),
    (4000, 300, 2, [8]),
    (5000, 1400, 5, [0, 1, 2]),
    (6000, 40_000, 10, [100 + k for k in range(79)]),  # past a 32,768-token context
]


def write_trace(path, rows=ROWS):
    path.write_bytes(b"".join(orjson.dumps({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": h}) + b"\n"
                              for t, n, o, h in rows))
    return path


@pytest.fixture(scope="module")
def prompt_ids():
    prompts = BlockPrompts(TOK, random.Random(0), real_text_corpus())
    return [TOK.encode_chat([{"role": "user", "content": prompts.make(n, h)}]) for _, n, _, h in ROWS[:-1]]


def test_every_prompt_has_exactly_its_input_length(prompt_ids):
    assert [len(ids) for ids in prompt_ids] == [n for _, n, _, _ in ROWS[:-1]]


def test_equal_hash_ids_are_equal_token_blocks_and_others_differ(prompt_ids):
    blocks = {}
    for (_, n, _, ids_of_row), ids in zip(ROWS, prompt_ids):
        for k, h in enumerate(ids_of_row):
            block = tuple(ids[512 * k: 512 * (k + 1)])
            last = k == len(ids_of_row) - 1
            blocks.setdefault((k, h, last, len(block)), set()).add(block)
    assert all(len(found) == 1 for found in blocks.values())  # same id, same place, same length: same tokens
    middle = {(k, h): found.pop() for (k, h, last, _), found in blocks.items() if not last}
    assert len(set(middle.values())) == len(middle)  # distinct ids: distinct blocks
    assert middle[(0, 0)] != tuple(prompt_ids[4][:300])[:512]
    # r3's last block (id 7, 512 tokens) ends with the chat template's closing tokens; its id 3 block is r1's.
    assert prompt_ids[3][1024:1536] == prompt_ids[1][1024:1536]
    closing = TOK.encode("<|im_end|>\n<|im_start|>assistant\n")
    assert prompt_ids[3][-len(closing):] == closing and prompt_ids[0] == prompt_ids[5]


def test_a_tokenizer_that_does_not_tokenize_word_by_word_is_refused():
    class WholeText:  # one token per text: joined units are not the sum of their tokens
        name, chatml = "whole", None

        def encode(self, text):
            return [hash(text) % 1000] if text else []

        def encode_chat(self, messages):
            return [1, 2] + self.encode(messages[0]["content"]) + [3]

    with pytest.raises(ValueError, match="does not tokenize word by word"):
        BlockPrompts(WholeText(), random.Random(0), ["the cat sat on the mat"] * 50, block_tokens=8)


def test_mooncake_workload_leaves_out_and_counts_rows_past_the_context(tmp_path):
    path = write_trace(tmp_path / "mc.jsonl")
    w = build_workload(f"mooncake:{path}", random.Random(0), tokenizer=TOK, max_context_tokens=32768)
    assert w.timed and w.rows.to_dict() == {"read": 7, "over_context": 1, "context_tokens": 32768}
    convs = list(w.conversations)
    assert [(c.id, c.start_s, c.turns[0].max_tokens) for c in convs] == [
        (f"mooncake-{i}", t / 1000, o) for i, (t, _, o, _) in enumerate(ROWS[:-1])]
    assert w.notes == [f"mooncake:{path}: 1 of 7 rows left out: prompt plus output tokens pass the context of 32768 tokens"]  # none below the minimum: no note


def test_shared_blocks_are_prefix_cache_hits_in_the_simulated_engine(tmp_path):
    config = parse_config({"roles": {"chat": {"pool": "short"}}, "engines": [{"name": "e0", "role": "chat", "gpus": [0]}],
                           "scheduling": {"policy": "round_robin"}})
    w = build_workload(f"mooncake:{write_trace(tmp_path / 'mc.jsonl')}", random.Random(0), tokenizer=TOK,
                       max_context_tokens=32768)
    records = {r.conversation_id: r for r in simulate(config, w, duration_s=10.0, seed=0)}
    assert [records[f"mooncake-{i}"].prompt_tokens for i in range(6)] == [n for _, n, _, _ in ROWS[:-1]]
    # r1 reuses r0's blocks 0-1 (1,024 tokens; a different block 2 may still start with the same word or two).
    assert 1024 <= records["mooncake-1"].cached_tokens < 1024 + 8
    assert 1536 <= records["mooncake-3"].cached_tokens < 1536 + 8  # r1's blocks 0, 1 and 3
    assert records["mooncake-5"].cached_tokens == 1399  # all of r0 but the last token, recomputed as SGLang does


def test_laps_simulate_runs_mooncake_and_azure_files_end_to_end(tmp_path, capsys):
    mooncake = write_trace(tmp_path / "mc.jsonl")
    azure = tmp_path / "az.csv"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-12 00:00:00+00:00,120,8\n"
                     "2024-05-12 00:00:00.25+00:00,2500,4\n2024-05-12 00:00:01+00:00,40000,9\n"
                     "2024-05-12 00:00:09+00:00,64,4\n")
    out = tmp_path / "sim.json"
    assert laps_main(["simulate", "--dataset", f"mooncake:{mooncake}", "--duration", "30", "--time-scale", "0.5",
                      "--max-requests", "4", "--out", str(out)]) == 0
    report = orjson.loads(out.read_bytes())
    assert report["requests"] == {"sent": 4, "ok": 4, "errors": 0} and report["max_requests"] == 4
    assert report["trace_rows"] == {"read": 7, "over_context": 1, "context_tokens": 32768}
    printed = " ".join(capsys.readouterr().out.split())  # the console wraps long lines
    assert "1 of 7 trace rows left out: prompt plus output tokens pass the 32768-token context" in printed
    assert laps_main(["simulate", "--dataset", f"azure:{azure}", "--duration", "5", "--max-context-tokens", "3000",
                      "--out", str(out), "--quiet"]) == 0
    report = orjson.loads(out.read_bytes())
    assert report["requests"]["sent"] == 2 and report["time_scale"] == 1.0  # the 09 s row is after --duration
    assert report["trace_rows"] == {"read": 4, "over_context": 1, "context_tokens": 3000}
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-12 00:00:00+00:00,12o,8\n")
    assert laps_main(["simulate", "--dataset", f"azure:{bad}", "--duration", "5", "--out", str(out), "--quiet"]) == 2
    assert capsys.readouterr().err == f"laps simulate: {bad} line 2: ContextTokens '12o' is not an integer\n"
