"""Runner: seeded arrivals, real history over a fake OpenAI server, errors, duration cut-off, the CLI."""

import argparse
import asyncio
import itertools
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from loadgen import cli
from loadgen.report import write_trace
from loadgen.runner import draw_think_time, plan_arrivals, run_loadgen
from loadgen.workloads import arrival_times
from loadgen.workloads import Conversation, Turn, Workload, load_replay


class FakeOpenAI:
    """A streaming chat-completions server: replies ``reply <n messages> to <last user text>``, word by word.

    Markers in the last user message change its behaviour: ``FAIL`` -> HTTP 500 with an
    OpenAI error body, ``MIDERR`` -> an in-stream error, ``ABORT`` -> the answer ends with ``finish_reason``
    ``abort``, ``CUT`` -> the stream ends without ``[DONE]``, ``SLOW`` -> waits 2 s after the headers, ``LONG`` -> ``x-laps-class: long``.
    """

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.max_model_len: int | None = None  # listed by /v1/models when set, as SGLang lists it
        self.api_key: str | None = None  # when set, every request needs it as Authorization: Bearer (else a 401)
        self.app = web.Application(middlewares=[self.auth])
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_post("/v1/chat/completions", self.chat)

    @web.middleware
    async def auth(self, request: web.Request, handler):
        if self.api_key is not None and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": {"message": "no valid key", "type": "invalid_request_error", "code": "invalid_api_key"}}, status=401)
        return await handler(request)

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": "fake-model", "object": "model"}
        if self.max_model_len is not None:
            card["max_model_len"] = self.max_model_len
        return web.json_response({"object": "list", "data": [card]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        last = body["messages"][-1]["content"]
        if "FAIL" in last:
            return web.json_response({"error": {"message": "boom", "type": "server_error"}}, status=500)
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "x-laps-class": "long" if "LONG" in last else "short"}
        )
        await resp.prepare(request)
        if "SLOW" in last:
            await asyncio.sleep(2)

        async def send(obj) -> None:
            await resp.write(b"data: " + (obj if isinstance(obj, bytes) else orjson.dumps(obj)) + b"\n\n")

        words = f"reply {len(body['messages'])} to {last}".split(" ")
        await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for i, word in enumerate(words):
            await send({"choices": [{"index": 0, "delta": {"content": word if i == 0 else " " + word}}]})
            await asyncio.sleep(0.002)
        if "MIDERR" in last:
            await send({"error": {"message": "engine died"}})
            return resp
        if "CUT" in last:
            return resp
        if "ABORT" in last:  # SGLang's end of a request aborted without an error status
            await send({"choices": [{"index": 0, "delta": {}, "finish_reason": "abort"}]})
        usage = {"prompt_tokens": 10, "completion_tokens": len(words), "prompt_tokens_details": {"cached_tokens": 4}}
        await send({"choices": [], "usage": usage})
        await send(b"[DONE]")
        return resp


@pytest.fixture
async def fake():
    server = FakeOpenAI()
    test_server = TestServer(server.app, host="127.0.0.1", port=0)
    await test_server.start_server()
    server.url = str(test_server.make_url("/"))
    yield server
    await test_server.close()


def timed(*convs: Conversation) -> Workload:
    return Workload("test", iter(convs), timed=True)


def chat(cid: str, *texts: str, start_s: float = 0.0) -> Conversation:
    return Conversation(cid, "test", tuple(Turn(t, 8) for t in texts), start_s)


def test_arrival_times_are_cumulative_seeded_exponential_gaps_by_default():
    times = list(itertools.islice(arrival_times(4.0, random.Random(7)), 20000))
    ref = random.Random(7)
    expected = list(itertools.accumulate(ref.expovariate(4.0) for _ in range(3)))
    assert times[:3] == expected
    gaps = [b - a for a, b in itertools.pairwise([0.0, *times])]
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.02)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.03)
    with pytest.raises(ValueError, match="rate must be > 0"):
        next(arrival_times(0.0, random.Random(0)))


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_arrival_times_with_burstiness_are_gamma_gaps_of_the_same_mean(burstiness):
    """Gamma gaps of shape ``burstiness`` and mean 1 / rate: coefficient of variation 1 / sqrt(burstiness)."""
    times = list(itertools.islice(arrival_times(4.0, random.Random(7), burstiness), 40000))
    ref = random.Random(7)
    assert times[:3] == list(itertools.accumulate(ref.gammavariate(burstiness, 0.25 / burstiness) for _ in range(3)))
    gaps = [b - a for a, b in itertools.pairwise([0.0, *times])]
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(burstiness ** -0.5, rel=0.05)


@pytest.mark.parametrize("burstiness", [0.0, -1.0, 1e-300, 0.0099, 100.01, 1e300, math.inf, math.nan])
def test_arrival_times_refuse_a_burstiness_outside_its_range_at_the_call(burstiness):
    """Below 0.01 most gamma gaps round to 0.0 s (every arrival at one instant: an endless plan); the range is
    refused when the generator is made, not when it is first read."""
    with pytest.raises(ValueError, match="burstiness must be between 0.01 and 100"):
        arrival_times(1.0, random.Random(0), burstiness)


@pytest.mark.parametrize("burstiness", [0.01, 100.0])
def test_arrival_times_at_the_ends_of_the_range_still_move_forward(burstiness):
    times = list(itertools.islice(arrival_times(200.0, random.Random(3), burstiness), 2000))
    assert len(set(times)) > 100 and times[-1] > 0


def test_think_time_is_exponential_or_fixed():
    assert draw_think_time(1.5, "fixed", random.Random(0)) == 1.5
    assert draw_think_time(2.0, "exp", random.Random(3)) == random.Random(3).expovariate(0.5)
    assert draw_think_time(0.0, "exp", random.Random(3)) == 0.0
    with pytest.raises(ValueError):
        draw_think_time(1.0, "uniform", random.Random(0))


def test_poisson_plan_stops_at_duration_and_draws_think_times_per_turn():
    convs = [chat(f"c{i}", "a", "b", "c", start_s=None) for i in range(1000)]
    plan = plan_arrivals(Workload("p", iter(convs), timed=False), duration_s=50.0, rng=random.Random(1), rate=2.0)
    ref = random.Random(1)
    first_gap = ref.expovariate(2.0)
    assert plan[0].start_s == first_gap
    assert plan[0].think_s == (ref.expovariate(1.0), ref.expovariate(1.0))
    assert all(a.start_s < 50.0 for a in plan)
    assert 70 < len(plan) < 130  # Poisson(100)
    assert [a.conversation.id for a in plan] == [f"c{i}" for i in range(len(plan))]


def test_bursty_plan_draws_gamma_gaps_then_think_times():
    convs = [chat(f"c{i}", "a", "b", start_s=None) for i in range(10)]
    plan = plan_arrivals(Workload("p", iter(convs), timed=False), duration_s=50.0, rng=random.Random(1), rate=2.0,
                         burstiness=0.25)
    ref = random.Random(1)
    assert plan[0].start_s == ref.gammavariate(0.25, 2.0)  # scale 1 / (rate * burstiness)
    assert plan[0].think_s == (ref.expovariate(1.0),)


def test_timed_plan_scales_trace_times_and_ignores_rate_and_burstiness():
    w = timed(chat("a", "x", start_s=0.0), chat("b", "x", "y", start_s=10.0), chat("c", "x", start_s=30.0))
    plan = plan_arrivals(w, duration_s=10.0, rng=random.Random(0), rate=99.0, burstiness=0.25, time_scale=0.5,
                         think_dist="fixed", think_time_s=0.25)
    assert [(a.start_s, a.conversation.id, a.think_s) for a in plan] == [(0.0, "a", ()), (5.0, "b", (0.25,))]


def test_poisson_plan_needs_a_rate():
    with pytest.raises(ValueError, match="needs a rate"):
        plan_arrivals(Workload("p", iter([]), timed=False), duration_s=1.0, rng=random.Random(0))


async def test_turns_carry_the_received_replies_as_history(fake):
    w = timed(chat("a", "hello", "again", "third"), chat("b", "solo LONG", start_s=0.01))
    records = await run_loadgen(fake.url, w, duration_s=5.0, seed=0, think_time_s=0.0)
    a_bodies = [b for b in fake.bodies if b["messages"][0]["content"] == "hello"]
    assert [b["messages"] for b in a_bodies] == [
        [{"role": "user", "content": "hello"}],
        [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "reply 1 to hello"},
            {"role": "user", "content": "again"},
        ],
        [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "reply 1 to hello"},
            {"role": "user", "content": "again"},
            {"role": "assistant", "content": "reply 3 to again"},
            {"role": "user", "content": "third"},
        ],
    ]
    body = a_bodies[0]
    assert body["model"] == "fake-model" and body["max_tokens"] == 8 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert len(records) == 4 and all(r.ok for r in records)
    by_key = {(r.conversation_id, r.turn): r for r in records}
    solo = by_key[("b", 0)]
    assert solo.laps_class == "long" and by_key[("a", 0)].laps_class == "short"
    first = by_key[("a", 0)]
    assert (first.status, first.prompt_tokens, first.completion_tokens, first.cached_tokens) == (200, 10, 4, 4)
    assert 0 < first.ttft_s <= first.e2e_s and len(first.itl_s) == 3
    assert first.tpot_s == pytest.approx((first.e2e_s - first.ttft_s) / 3)
    assert first.end_s == pytest.approx(first.start_s + first.e2e_s)


async def test_errors_are_recorded_and_end_their_conversation(fake):
    w = timed(
        chat("fail", "FAIL now", "never sent"),
        chat("mid", "MIDERR", "never sent"),
        chat("cut", "CUT", "never sent"),
        chat("abort", "ABORT", "never sent"),
        chat("fine", "ok", "ok too"),
    )
    records = await run_loadgen(fake.url, w, duration_s=5.0, seed=0, think_time_s=0.0, model="m")
    errors = {r.conversation_id: (r.status, r.error) for r in records if not r.ok}
    assert errors == {
        "fail": (500, "HTTP 500: boom"),
        "mid": (200, "stream error: engine died"),
        "cut": (200, "stream ended before [DONE]"),
        "abort": (200, "the engine aborted the request (finish_reason abort)"),
    }
    assert not any(m["content"] == "never sent" for b in fake.bodies for m in b["messages"])
    assert sorted((r.conversation_id, r.turn) for r in records if r.ok) == [("fine", 0), ("fine", 1)]
    assert all(r.e2e_s is None for r in records if not r.ok)


async def test_timeouts_and_unreachable_servers_are_errors(fake):
    records = await run_loadgen(fake.url, timed(chat("s", "SLOW")), duration_s=1.0, seed=0, model="m", request_timeout_s=0.2)
    assert [(r.status, r.error) for r in records] == [(200, "timeout after 0.2 s")]
    records = await run_loadgen("http://127.0.0.1:9", timed(chat("x", "hi")), duration_s=1.0, seed=0, model="m")
    assert len(records) == 1 and records[0].status is None and records[0].error.startswith("ClientConnectorError")


async def test_no_turn_starts_after_the_duration(fake):
    w = timed(chat("a", "one", "two"), chat("late", "x", start_s=0.5))
    records = await run_loadgen(fake.url, w, duration_s=0.3, seed=0, think_time_s=0.4, think_dist="fixed", model="m")
    assert [(r.conversation_id, r.turn) for r in records] == [("a", 0)]


async def test_trace_out_replays_the_same_turns(fake, tmp_path):
    w = timed(chat("a", "hello", "again"), chat("b", "solo", start_s=0.05))
    records = await run_loadgen(fake.url, w, duration_s=5.0, seed=0, think_time_s=0.0, model="m")
    path = tmp_path / "trace.jsonl"
    write_trace(records, path)
    replay = load_replay(path)
    assert replay.timed
    convs = list(replay.conversations)
    assert [(c.id, [t.content for t in c.turns]) for c in convs] == [("a", ["hello", "again"]), ("b", ["solo"])]
    # b starts at its recorded start (up to the trace origin, the run start rather than a's; never before its
    # scheduled 0.05 s; how late depends on the machine).
    first = min(r.start_s for r in records)
    b_start = min(r.start_s for r in records if r.conversation_id == "b")
    assert convs[1].start_s == pytest.approx(b_start - first, abs=0.01) and convs[1].start_s >= 0.05 - 1e-3


@contextmanager
def fake_in_thread():
    """The fake server on its own loop in a thread, for the synchronous CLI entry point."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = FakeOpenAI()
    test_server = TestServer(server.app, host="127.0.0.1", port=0)
    asyncio.run_coroutine_threadsafe(test_server.start_server(), loop).result()
    try:
        yield server, str(test_server.make_url("/"))
    finally:
        asyncio.run_coroutine_threadsafe(test_server.close(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.configure_parser(parser)
    return parser.parse_args(list(argv))


def test_cli_writes_report_png_and_trace_and_exits_0(tmp_path):
    out = tmp_path / "run" / "report.json"
    with fake_in_thread() as (server, url):
        args = parse(
            "--url", url, "--dataset", "mtbench", "--rate", "20", "--duration", "0.4", "--think-time-s", "0",
            "--seed", "3", "--out", str(out), "--trace-out", str(tmp_path / "trace.jsonl"), "--quiet",
        )
        assert cli.main(args) == 0
    report = orjson.loads(out.read_bytes())
    assert report["dataset"] == "mtbench" and report["seed"] == 3 and report["rate"] == 20.0
    assert report["requests"]["sent"] == len(server.bodies) > 0 and report["requests"]["errors"] == 0
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len((tmp_path / "trace.jsonl").read_text().splitlines()) == report["requests"]["sent"]


def test_cli_sends_bursty_arrivals_with_burstiness(tmp_path, monkeypatch):
    """--burstiness reaches the arrival plan of a live run (the real run_loadgen, watched) and the report."""
    seen = []
    real = cli.run_loadgen

    async def watched(*args, **kwargs):
        seen.append(kwargs["burstiness"])
        return await real(*args, **kwargs)

    monkeypatch.setattr(cli, "run_loadgen", watched)
    out = tmp_path / "report.json"
    with fake_in_thread() as (_, url):
        args = parse("--url", url, "--dataset", "arena", "--rate", "20", "--burstiness", "0.5", "--duration", "0.3",
                     "--out", str(out), "--quiet")
        assert cli.main(args) == 0
    assert seen == [0.5]
    assert orjson.loads(out.read_bytes())["burstiness"] == 0.5


def test_cli_exits_1_on_request_errors_and_2_without_rate(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(orjson.dumps({"conversation_id": "f", "source": "x", "turn": 0, "user": "FAIL", "max_tokens": 4, "start_s": 0.0}).decode() + "\n")
    with fake_in_thread() as (_, url):
        args = parse("--url", url, "--dataset", f"replay:{trace}", "--duration", "1", "--out", str(tmp_path / "r.json"), "--quiet")
        assert cli.main(args) == 1
        report = orjson.loads((tmp_path / "r.json").read_bytes())
        assert report["errors_by_message"] == {"HTTP 500: boom": 1}
        assert cli.main(parse("--url", url, "--dataset", "arena", "--out", str(tmp_path / "x.json"), "--quiet")) == 2


@pytest.mark.parametrize(("keys", "message"), [({"duration_s": 0.0}, "duration must be > 0 s, got 0.0"),
                                               ({"think_time_s": -1.0}, "think time must be >= 0 s, got -1.0")])
def test_plan_refuses_a_non_positive_duration_and_a_negative_think_time(keys, message):
    with pytest.raises(ValueError, match=message):
        plan_arrivals(Workload("p", iter([]), timed=False), **{"duration_s": 1.0, **keys}, rng=random.Random(0), rate=1.0)


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--duration", "0", "argument --duration: must be > 0, got 0"),
    ("--duration", "-5", "argument --duration: must be > 0, got -5"),
    ("--duration", "soon", "argument --duration: not a number: 'soon'"),
    ("--think-time-s", "-1", "argument --think-time-s: must be >= 0, got -1"),
    ("--max-tokens", "0", "argument --max-tokens: must be >= 1, got 0"),
    ("--max-tokens", "1.5", "argument --max-tokens: not an integer: '1.5'"),
    ("--long-share", "1.5", "argument --long-share: must be in [0, 1], got 1.5"),
    ("--long-share", "-0.1", "argument --long-share: must be in [0, 1], got -0.1"),
])
def test_cli_refuses_bad_durations_think_times_max_tokens_and_long_shares(flag, value, message, capsys):
    with pytest.raises(SystemExit) as info:
        parse("--url", "http://127.0.0.1:9", flag, value)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_an_integer_past_a_floats_range_is_taken_as_an_integer():
    assert parse("--url", "http://127.0.0.1:9", "--max-requests", "1" + "0" * 400).max_requests == 10**400  # no OverflowError


def test_a_ctrl_c_during_the_run_says_how_many_requests_had_finished_and_writes_no_report(tmp_path):
    """A Ctrl-C at the terminal (SIGINT to the process group) once a first turn's answer is in: exit status 130 and one
    line, as before no report (it was 130 and nothing at all)."""
    out = tmp_path / "r.json"
    with fake_in_thread() as (server, url):
        argv = ["loadgen", "--url", url, "--dataset", "mtbench", "--rate", "5", "--duration", "60", "--think-time-s", "0",
                "--out", str(out), "--quiet"]
        # Its own process group and SIGINT's default action, as a terminal's shell gives a command it runs: a run in the
        # background of a non-interactive shell (a CI script's `cmd &`) has SIGINT ignored, which the child inherits.
        proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "laps.cli", *argv], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            deadline = time.monotonic() + 60
            while not any(len(body["messages"]) > 1 for body in server.bodies):  # a second turn: the first one finished
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
            os.killpg(proc.pid, signal.SIGINT)
            try:
                stdout, stderr = proc.communicate(timeout=45)
            except subprocess.TimeoutExpired:  # say where it was (faulthandler's dump)
                proc.send_signal(signal.SIGABRT)
                pytest.fail(f"laps loadgen did not end 45 s after a SIGINT; its threads then:\n{proc.communicate(timeout=30)[1]}")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert (proc.returncode, stdout) == (130, "")
    assert re.fullmatch(r"laps loadgen: interrupted after [1-9]\d* requests had finished \(0 failed\); no report written\n", stderr), stderr
    assert not out.exists() and not out.with_suffix(".png").exists()


def test_cli_reports_a_bad_replay_file_and_exits_2(tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    args = parse("--url", "http://127.0.0.1:9", "--dataset", f"replay:{missing}", "--out", str(tmp_path / "r.json"), "--quiet")
    assert cli.main(args) == 2
    assert capsys.readouterr().err == f"laps loadgen: {missing}: cannot read: No such file or directory\n"


def test_cli_leaves_out_trace_rows_past_the_servers_context_and_caps_requests(tmp_path):
    trace = tmp_path / "az.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.0000000,100,4\n"
                     "2023-11-16 18:15:46.0500000,900,200\n2023-11-16 18:15:46.1000000,40,3\n"
                     "2023-11-16 18:15:46.1500000,50,3\n")
    out = tmp_path / "r.json"
    with fake_in_thread() as (server, url):
        server.max_model_len = 1000
        assert cli.main(parse("--url", url, "--dataset", f"azure:{trace}", "--duration", "5", "--max-requests", "2",
                              "--out", str(out), "--quiet")) == 0
        report = orjson.loads(out.read_bytes())
        assert report["trace_rows"] == {"read": 4, "over_context": 1, "context_tokens": 1000}
        assert [b["max_tokens"] for b in server.bodies] == [4, 3] and report["requests"]["sent"] == 2
        server.bodies.clear()
        assert cli.main(parse("--url", url, "--dataset", f"azure:{trace}", "--duration", "5", "--max-context-tokens",
                              "1100", "--out", str(out), "--quiet")) == 0
        assert orjson.loads(out.read_bytes())["trace_rows"]["over_context"] == 0 and len(server.bodies) == 4


def test_cli_sends_the_api_key_given_or_from_openai_api_key(tmp_path, monkeypatch, capsys):
    out = tmp_path / "r.json"
    with fake_in_thread() as (server, url):
        server.api_key = "sk-loadgen-test-key"
        flags = ("--url", url, "--dataset", "mtbench", "--rate", "20", "--duration", "0.3", "--think-time-s", "0", "--out", str(out), "--quiet")
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        assert cli.main(parse(*flags)) == 1
        assert "GET " + url.rstrip("/") + "/v1/models answered HTTP 401: no valid key" in capsys.readouterr().err
        assert cli.main(parse(*flags, "--api-key", "sk-loadgen-test-key")) == 0
        sent = len(server.bodies)
        assert sent > 0 and orjson.loads(out.read_bytes())["requests"]["errors"] == 0
        monkeypatch.setenv("OPENAI_API_KEY", "sk-loadgen-test-key")
        assert cli.main(parse(*flags)) == 0 and len(server.bodies) > sent


def test_cli_refuses_a_directory_as_out_before_it_sends_anything(tmp_path, capsys):
    args = parse("--url", "http://127.0.0.1:9", "--dataset", "mtbench", "--rate", "1", "--out", str(tmp_path), "--quiet")
    assert cli.main(args) == 2  # port 9 would have failed the run (exit 1): the path is checked first
    assert capsys.readouterr().err == f"laps loadgen: --out {tmp_path}: a directory, not a file name\n"
