"""Workloads: exact counts of the real data sets, exact prompt lengths, seeded determinism."""

import collections
import itertools
import random
import statistics

import pytest

from laps.tokenizer import load_tokenizer
from loadgen.workloads import (
    ExactLengthPrompts,
    Phase,
    build_workload,
    chat_docs_chat,
    code_burst_rows,
    cycle_shuffled,
    load_arena,
    load_azure_trace,
    load_hh_rlhf,
    load_mtbench,
    load_sharegpt,
    long_arrival_probability,
    shifting_workload,
)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def prompts(tok):
    return ExactLengthPrompts(tok, random.Random(3))


def test_hh_rlhf_has_every_user_turn_with_its_real_reply_length(tok):
    convs = load_hh_rlhf(tok)
    assert len(convs) == 2312
    assert sum(len(c.turns) for c in convs) == 5756
    first = convs[0]
    assert first.id == "hh-0" and first.source == "hh-rlhf"
    assert [t.content for t in first.turns] == [
        "what are some pranks with a pen i can do?",
        "yep",
        "okay some of these do not have anything to do with pens",
    ]
    assert first.turns[0].max_tokens == len(tok.encode("Are you looking for practical joke ideas?"))
    assert all(t.max_tokens >= 1 for c in convs for t in c.turns)


def test_hh_rlhf_joins_consecutive_assistant_messages_into_one_reply(tok):
    conv = next(c for c in load_hh_rlhf(tok) if c.id == "hh-763")
    assert len(conv.turns) == 2
    assert conv.turns[0].max_tokens > len(tok.encode("Not especially!"))


@pytest.mark.parametrize(
    ("loader", "count", "turns"),
    [(load_mtbench, 80, 2), (load_arena, 500, 1), (load_sharegpt, 1000, 1)],
)
def test_text_sets_load_exact_counts_with_default_max_tokens(loader, count, turns):
    convs = loader(max_tokens=77)
    assert len(convs) == count
    assert {len(c.turns) for c in convs} == {turns}
    assert {t.max_tokens for c in convs for t in c.turns} == {77}
    assert len({c.id for c in convs}) == count


def test_azure_trace_is_sorted_relative_to_first_request():
    rows = load_azure_trace()
    assert len(rows) == 19366
    assert rows[0].arrival_s == 0.0
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(rows))
    assert (rows[0].context_tokens, rows[0].generated_tokens) == (374, 44)
    assert rows[1].arrival_s == pytest.approx(4.314579)
    assert 3400 < rows[-1].arrival_s < 3600


@pytest.mark.parametrize("target", [30, 31, 37, 64, 255, 256, 257, 1024, 4142, 14050])
def test_exact_length_prompts_hit_the_templated_token_count(prompts, tok, target):
    text = prompts.make(target)
    assert len(tok.encode_chat([{"role": "user", "content": text}])) == target
    assert text == text.strip() and "<|" not in text


def test_exact_length_prompts_refuse_targets_below_the_template(prompts):
    assert prompts.min_tokens == 30
    with pytest.raises(ValueError, match="below the template minimum"):
        prompts.make(29)


def test_azure_conv_replays_trace_times_and_exact_lengths(tok):
    workload = build_workload("azure-conv", random.Random(0), tokenizer=tok)
    assert workload.timed
    assert "195 of 19366" in workload.notes[0]
    rows = load_azure_trace()
    sample = list(itertools.islice(workload.conversations, 60))
    for conv, row in zip(sample, rows):
        (turn,) = conv.turns
        assert conv.start_s == row.arrival_s
        assert turn.max_tokens == row.generated_tokens
        assert len(tok.encode_chat([{"role": "user", "content": turn.content}])) == max(row.context_tokens, 30)


def test_same_seed_same_stream_other_seed_other_stream(tok):
    def head(seed):
        w = build_workload("mixed", random.Random(seed), tokenizer=tok)
        return [(c.id, c.turns) for c in itertools.islice(w.conversations, 30)]

    assert head(5) == head(5)
    assert head(5) != head(6)


def test_cycle_shuffled_reshuffles_each_pass_and_keeps_ids_unique():
    convs = load_mtbench()
    stream = list(itertools.islice(cycle_shuffled(convs, random.Random(1)), 200))
    assert len({c.id for c in stream}) == 200
    assert sorted(c.id for c in stream[:80]) == sorted(c.id for c in convs)
    assert all(c.id.endswith("#1") for c in stream[80:160])
    assert [c.id[:-2] for c in stream[80:160]] != [c.id for c in stream[:80]]


def test_long_arrival_probability_gives_the_requested_share_of_requests():
    p = long_arrival_probability(0.2, 2.5)
    assert p / (p + (1 - p) * 2.5) == pytest.approx(0.2)
    assert long_arrival_probability(0.0, 2.5) == 0.0
    assert long_arrival_probability(1.0, 2.5) == 1.0
    with pytest.raises(ValueError):
        long_arrival_probability(1.5, 2.5)


def test_mixed_long_requests_are_real_text_above_1024_tokens(tok):
    workload = build_workload("mixed", random.Random(11), tokenizer=tok, long_share=0.2)
    convs = list(itertools.islice(workload.conversations, 400))
    long = [c for c in convs if c.source == "long"]
    chats = [c for c in convs if c.source != "long"]
    assert {c.source for c in chats} <= {"hh-rlhf", "mtbench"}
    # per-arrival chance 0.2·m/(0.8+0.2·m) with m = 5916/2392 turns: 0.382; 400 draws -> sd 0.024
    assert 0.382 - 0.08 < len(long) / len(convs) < 0.382 + 0.08
    for c in long[:10]:
        (turn,) = c.turns
        assert len(tok.encode_chat([{"role": "user", "content": turn.content}])) > 1024


def test_unknown_dataset_and_bad_share_are_refused(tok):
    with pytest.raises(ValueError, match="unknown dataset"):
        build_workload("lmsys", random.Random(0), tokenizer=tok)
    with pytest.raises(ValueError, match="long_share"):
        build_workload("mixed", random.Random(0), tokenizer=tok, long_share=-0.1)


def test_shifting_workload_changes_its_long_share_phase_by_phase(tok):
    phases = chat_docs_chat(100.0, 100.0, 100.0, chat_long_share=0.0, docs_long_share=1.0)
    assert phases == (Phase(100.0, 0.0), Phase(100.0, 1.0), Phase(100.0, 0.0))
    workload = shifting_workload(random.Random(0), rate=2.0, phases=phases, tokenizer=tok)
    conversations = list(workload.conversations)
    assert workload.timed and workload.name == "shifting"
    starts = [c.start_s for c in conversations]
    assert starts == sorted(starts) and 0 < starts[0] and starts[-1] < 300.0
    assert 480 < len(conversations) < 720  # Poisson, 2/s for 300 s: 600 ± 5 sigma
    # Share 0 and 1: chats only, then documents only (single turns above 1,024 tokens), then chats only.
    for lo, hi, source in ((0, 100, {"hh-rlhf", "mtbench"}), (100, 200, {"long"}), (200, 300, {"hh-rlhf", "mtbench"})):
        assert {c.source for c in conversations if lo <= c.start_s < hi} <= source
    doc = next(c for c in conversations if c.source == "long")
    assert len(doc.turns) == 1 and len(tok.encode_chat([{"role": "user", "content": doc.turns[0].content}])) > 1024
    again = shifting_workload(random.Random(0), rate=2.0, phases=phases, tokenizer=tok)
    assert [(c.id, c.start_s) for c in again.conversations] == [(c.id, c.start_s) for c in conversations]
    with pytest.raises(ValueError, match="phases"):
        shifting_workload(random.Random(0), rate=2.0, phases=[], tokenizer=tok)


REPLAY_RECORD = b'{"conversation_id": "c", "source": "s", "turn": 0, "user": "hi", "max_tokens": 4, "start_s": 0.0}'


@pytest.mark.parametrize(
    "content, expected",
    [
        (None, "replay.jsonl: cannot read: No such file or directory"),
        (REPLAY_RECORD + b"\n\ngarbage\n", "replay.jsonl line 3: not valid JSON (unexpected character"),
        (b'{"bad": 1}\n', "replay.jsonl line 1: not a --trace-out record: missing conversation_id, source, turn, user, max_tokens, start_s"),
        (b"[1, 2]\n", "replay.jsonl line 1: expected a --trace-out record (a JSON object), got list"),
        (REPLAY_RECORD + b"\n" + REPLAY_RECORD.replace(b'"max_tokens": 4', b'"max_tokens": "4"'), "replay.jsonl line 2: max_tokens has the wrong type ('4')"),
        (REPLAY_RECORD.replace(b'"max_tokens": 4', b'"max_tokens": 0'), "replay.jsonl line 1: max_tokens must be >= 1, got 0"),
    ],
)
def test_a_bad_replay_file_is_a_value_error_naming_the_file_and_line(tmp_path, content, expected):
    path = tmp_path / "replay.jsonl"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError) as info:
        build_workload(f"replay:{path}", random.Random(0))
    assert str(info.value).startswith(f"{tmp_path}/{expected}")


def test_a_good_replay_file_loads(tmp_path):
    path = tmp_path / "replay.jsonl"
    path.write_bytes(REPLAY_RECORD + b"\n")
    (conv,) = build_workload(f"replay:{path}", random.Random(0)).conversations
    assert (conv.id, conv.source, conv.turns[0].content, conv.turns[0].max_tokens, conv.start_s) == ("c", "s", "hi", 4, 0.0)


def test_chat_single_is_every_first_turn_asking_the_default_length(tok):
    w = build_workload("chat-single", random.Random(0), tokenizer=tok)
    convs = list(itertools.islice(w.conversations, 3891))
    assert len({c.id for c in convs}) == 3891 and all(len(c.turns) == 1 and c.turns[0].max_tokens == 256 for c in convs)
    lengths = [len(tok.encode_chat([{"role": "user", "content": c.turns[0].content}])) for c in convs]
    assert sum(n < 256 for n in lengths) / len(lengths) > 0.75


def test_shared_docs_asks_each_long_document_several_times_interleaved(tok):
    w = build_workload("shared-docs", random.Random(0), tokenizer=tok)
    convs = list(itertools.islice(w.conversations, 200))
    docs: dict[str, list[int]] = {}
    for i, c in enumerate(convs):
        if c.id.startswith("doc"):
            docs.setdefault(c.id.split("-")[0], []).append(i)
    assert sum(c.id.startswith("chat") for c in convs) == pytest.approx(20, abs=10)  # ~10% short chats
    sizes = [len(v) for v in list(docs.values())[:-4]]  # the last four documents may still be open
    assert min(sizes) >= 3 and max(sizes) <= 8
    first = convs[next(iter(docs.values()))[0]].turns[0].content
    doc_text = first.rsplit("\n\n", 1)[0]
    n = len(tok.encode_chat([{"role": "user", "content": doc_text}]))
    assert 10_000 <= n <= 30_000
    # Interleaved: some document's questions are not all back to back.
    assert any(v[-1] - v[0] + 1 > len(v) for v in docs.values())


def test_docs_is_the_mixed_stream_with_half_the_requests_long(tok):
    w = build_workload("docs", random.Random(0), tokenizer=tok)
    assert w.notes[0].startswith("docs: ") and "so that 50% of requests are long (long_share)" in w.notes[0]


def test_code_burst_is_bursty_code_completion_of_splitwise_coding_medians(tok):
    rows = code_burst_rows(random.Random(0))
    assert rows[0].arrival_s == 0.0 and all(a.arrival_s <= b.arrival_s for a, b in zip(rows, rows[1:]))
    assert 0.9 * 5.5 * 3600 < len(rows) < 1.1 * 5.5 * 3600
    assert statistics.median(r.context_tokens for r in rows) == pytest.approx(1500, rel=0.05)
    assert statistics.median(r.generated_tokens for r in rows) == pytest.approx(13, abs=1)
    assert max(r.context_tokens for r in rows) == 8000 and min(r.generated_tokens for r in rows) >= 1
    # Bursts: arrivals per minute vary far more than a Poisson process's (count CV ~0.05 at 330 per minute).
    counts = collections.Counter(int(r.arrival_s // 60) for r in rows)
    per_minute = [counts[m] for m in range(60)]
    assert statistics.pstdev(per_minute) / statistics.mean(per_minute) > 0.3
    w = build_workload("code-burst", random.Random(0), tokenizer=tok)
    assert w.timed and w.rows.read == len(rows)
    convs = list(itertools.islice(w.conversations, 5))
    assert [c.start_s for c in convs] == [r.arrival_s for r in rows[:5]]
    assert [c.turns[0].max_tokens for c in convs] == [r.generated_tokens for r in rows[:5]]
    lengths = [len(tok.encode_chat([{"role": "user", "content": c.turns[0].content}])) for c in convs]
    assert lengths == [max(r.context_tokens, ExactLengthPrompts(tok, random.Random(0)).min_tokens) for r in rows[:5]]
