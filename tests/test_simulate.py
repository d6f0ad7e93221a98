"""The virtual-time simulator (loadgen/virtual.py) and ``laps simulate``."""

from __future__ import annotations

import os
import random
from pathlib import Path

import orjson
import pytest
import yaml
from rich.console import Console

import loadgen.cli
from engines.manager import server_args
from engines.sim.args import parse_server_args, resolve_args
from engines.sim.replies import ReplyPlanner
from laps.cli import main as laps_main
from laps.config import DEFAULT_CONFIG_PATH, load_config, parse_config
from laps.tokenizer import load_tokenizer
from loadgen.outputs import is_stdout, is_stream, open_output
from loadgen.report import build_report, print_run_summary, write_report
from loadgen.simulate import simulate, simulate_run
from loadgen.workloads import Conversation, Turn, Workload, build_workload

TOK = load_tokenizer()
ROLES = {"chat": {"pool": "short", "flags": {"chunked-prefill-size": 2048}},
         "docs": {"pool": "long", "flags": {"chunked-prefill-size": 8192}}}


def one_engine_config(policy: str = "pools") -> object:
    return parse_config({"roles": ROLES, "engines": [{"name": "e0", "role": "chat", "gpus": [0]}],
                         "scheduling": {"policy": policy}})


def scripted(*conversations: Conversation) -> Workload:
    return Workload("scripted", iter(conversations), timed=True)


def test_a_two_turn_conversation_runs_as_the_live_runner_would():
    config = one_engine_config()
    user1, user2 = "Tell me about the harbour.", "And the ferry?"
    conv = Conversation("c0", "test", (Turn(user1, 64), Turn(user2, 8)), start_s=0.25)
    records = simulate(config, scripted(conv), duration_s=10, seed=0, think_time_s=0.5, think_dist="fixed",
                       tokenizer=TOK)
    first, second = records
    engine = resolve_args(parse_server_args(server_args(config, config.engines[0], 0)))
    p1 = TOK.encode_chat([{"role": "user", "content": user1}])
    # Turn 0 arrives at 0.25 s on an idle engine: its TTFT is one prefill pass of the 35-token prompt.
    assert (first.start_s, first.prompt_tokens, first.cached_tokens, first.laps_class) == (0.25, 35, 0, "short")
    assert first.ttft_s == pytest.approx(engine.latency.predict([(35, 0)]))
    # The reply the engine planned for rid "c0/0": 7 text tokens and <|im_end|>.
    plan = ReplyPlanner(TOK).plan("c0/0", 64, ignore_eos=False).token_ids
    assert first.completion_tokens == len(plan) == 8
    assert len(first.itl_s) == 6  # gaps between the 7 text tokens; <|im_end|> carries no text
    assert first.tpot_s == pytest.approx((first.e2e_s - first.ttft_s) / 7)
    # Turn 1 goes a fixed 0.5 s after turn 0's answer, with that answer in its history.
    assert second.start_s == pytest.approx(first.end_s + 0.5)
    history = [{"role": "user", "content": user1}, {"role": "assistant", "content": TOK.decode(plan[:-1])},
               {"role": "user", "content": user2}]
    assert second.prompt_tokens == len(TOK.encode_chat(history))
    assert second.cached_tokens == len(p1) + 7  # prompt and reply, less <|im_end|>
    assert second.completion_tokens == 8 and all(r.ok for r in records)


def test_same_seed_same_report_and_another_seed_another():
    config = load_config(DEFAULT_CONFIG_PATH)

    def report(seed: int) -> dict:
        workload = build_workload("mixed", random.Random(f"workload/{seed}"), tokenizer=TOK)
        records = simulate(config, workload, duration_s=8, seed=seed, rate=2.0, tokenizer=TOK)
        return build_report(records, slo_ttft_s=0.4)

    first = report(1)
    assert first["requests"]["sent"] > 10 and first["requests"]["errors"] == 0
    assert orjson.dumps(first) == orjson.dumps(report(1))
    assert orjson.dumps(first) != orjson.dumps(report(2))


def test_timeouts_withdraw_requests_and_engine_errors_end_the_conversation():
    config = one_engine_config()
    conversations = (
        Conversation("slow", "test", (Turn("Write a long story.", 5000), Turn("More.", 5)), start_s=0.0),
        Conversation("huge", "test", (Turn("word " * 40_000, 5), Turn("again", 5)), start_s=0.1),
    )
    records = simulate(config, scripted(*conversations), duration_s=10, seed=0, ignore_eos=True,
                       request_timeout_s=1.0, tokenizer=TOK)
    by_id = {r.conversation_id: r for r in records}
    assert len(records) == 2  # neither conversation reaches its second turn
    assert by_id["slow"].error == "timeout after 1 s" and by_id["slow"].end_s == pytest.approx(1.0)
    assert by_id["slow"].ttft_s is not None and by_id["slow"].status == 200
    assert by_id["huge"].status == 400 and "longer than the model's context length" in by_id["huge"].error


def test_laps_simulate_writes_the_loadgen_report_with_the_policy_override(tmp_path):
    out = tmp_path / "sim.json"
    code = laps_main(["simulate", "--config", str(DEFAULT_CONFIG_PATH), "--dataset", "mtbench", "--rate", "1",
                      "--duration", "5", "--policy", "round_robin", "--seed", "3", "--out", str(out), "--quiet"])
    assert code == 0
    report = orjson.loads(out.read_bytes())
    assert (report["mode"], report["policy"], report["dataset"], report["seed"]) == ("virtual", "round_robin", "mtbench", 3)
    assert [e["name"] for e in report["engines"]] == ["sp0", "lp0"]
    assert report["requests"]["sent"] >= 3 and set(report["by_class"]) >= {"short", "long"}
    assert out.with_suffix(".png").exists()
    assert laps_main(["simulate", "--dataset", "mtbench", "--duration", "5", "--out", str(out), "--quiet"]) == 2  # no rate


def test_laps_simulate_sends_bursty_arrivals_with_burstiness(tmp_path, capsys, monkeypatch):
    """The same seed and rate with --burstiness 0.25 plans other arrival times (gamma gaps); the report and its
    summary line say so."""
    monkeypatch.setenv("COLUMNS", "200")  # the summary on one line
    starts = {}
    for burstiness, said in (("1", "(20 conv/s, Poisson): "), ("0.25", "(20 conv/s, gamma gaps of burstiness 0.25): ")):
        out = tmp_path / f"sim{burstiness}.json"
        trace = tmp_path / f"sim{burstiness}.jsonl"
        assert laps_main(["simulate", "--config", str(DEFAULT_CONFIG_PATH), "--dataset", "chat-single", "--rate", "20",
                          "--burstiness", burstiness, "--duration", "2", "--out", str(out), "--trace-out", str(trace)]) == 0
        assert said in capsys.readouterr().out
        assert orjson.loads(out.read_bytes())["burstiness"] == float(burstiness)
        starts[burstiness] = sorted(orjson.loads(line)["start_s"] for line in trace.read_bytes().splitlines())
    assert starts["1"][0] == pytest.approx(random.Random("arrivals/0").expovariate(20.0))
    assert starts["0.25"][0] == pytest.approx(random.Random("arrivals/0").gammavariate(0.25, 1 / (20 * 0.25)))


def test_a_ctrl_c_during_a_simulation_says_how_many_requests_had_finished_and_writes_no_report(tmp_path, monkeypatch, capsys):
    """A Ctrl-C (a KeyboardInterrupt wherever the run is) once the third request has finished: exit status 130 and one
    line, as before no report (it was 130 and nothing at all)."""
    run = loadgen.cli.simulate_run

    def interrupted_after_3(*args, on_record, **kwargs):
        finished = []

        def record(rec):
            on_record(rec)
            finished.append(rec)
            if len(finished) == 3:
                raise KeyboardInterrupt

        return run(*args, on_record=record, **kwargs)

    monkeypatch.setattr(loadgen.cli, "simulate_run", interrupted_after_3)
    out = tmp_path / "sim.json"
    assert laps_main(["simulate", "--dataset", "mtbench", "--rate", "20", "--duration", "60", "--quiet", "--out", str(out)]) == 130
    assert capsys.readouterr().err == "laps simulate: interrupted after 3 requests had finished (0 failed); no report written\n"
    assert not out.exists() and not out.with_suffix(".png").exists()


def test_laps_simulate_prints_the_arguments_its_dataset_ignores(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert laps_main(["simulate", "--config", str(DEFAULT_CONFIG_PATH), "--dataset", "mtbench", "--rate", "1",
                      "--time-scale", "2", "--duration", "2", "--out", str(out)]) == 0
    note = "--time-scale 2 ignored: mtbench arrives at --rate, not at a trace's times"
    assert orjson.loads(out.read_bytes())["notes"] == [note]
    assert f"note: {note}" in capsys.readouterr().err
    assert laps_main(["simulate", "--config", str(DEFAULT_CONFIG_PATH), "--dataset", "code-burst", "--rate", "7",
                      "--burstiness", "0.5", "--time-scale", "0.05", "--duration", "1", "--out", str(out), "--quiet"]) == 0
    report = orjson.loads(out.read_bytes())
    assert report["notes"] == ["--rate 7 ignored: code-burst replays its own arrival times",
                               "--burstiness 0.5 ignored: code-burst replays its own arrival times"]
    assert report["burstiness"] is None


@pytest.mark.parametrize("argument", [("--rate", "0"), ("--rate", "-1"), ("--rate", "inf"), ("--rate", "nan"),
                                      ("--time-scale", "inf"), ("--burstiness", "0"), ("--burstiness", "inf"), ("--burstiness", "1e-300"),
                                      ("--burstiness", "1e300"), ("--duration", "nan"), ("--request-timeout-s", "0"),
                                      ("--serving-latency-ms", "-5")])
def test_laps_simulate_refuses_numbers_out_of_range(argument, capsys):
    """Rates, time scales, durations and timeouts must be finite and positive; the serving latency finite and >= 0."""
    with pytest.raises(SystemExit) as exit_:
        laps_main(["simulate", "--dataset", "mtbench", "--duration", "1", "--rate", "1", *argument])
    assert exit_.value.code == 2
    assert f"argument {argument[0]}: " in capsys.readouterr().err


def test_laps_simulate_reports_controller_moves_and_kv_transfers(tmp_path, capsys):
    data = yaml.safe_load((DEFAULT_CONFIG_PATH.parent / "examples" / "sim-pd.yaml").read_text())
    data["controller"] = {"enabled": True, "interval_s": 0.5, "short_role": "prefill-short", "long_role": "prefill-long"}
    config_path, out = tmp_path / "pd.yaml", tmp_path / "pd.json"
    config_path.write_text(yaml.safe_dump(data))
    assert laps_main(["simulate", "--config", str(config_path), "--dataset", "mixed", "--rate", "4", "--duration", "3",
                      "--seed", "1", "--out", str(out)]) == 0
    report = orjson.loads(out.read_bytes())
    assert {"requests", "ttft_s", "by_class", "slo"} <= set(report)  # the loadgen report's keys stay
    kv, control = report["kv_transfer"], report["controller"]
    assert kv["count"] == report["requests"]["ok"] > 0 and kv["bytes"] > 0 and kv["inflation"]["mean"] >= 1.0
    assert control["moves"] == [] and control["decisions"] >= 6  # one every 0.5 s over the run
    printed = capsys.readouterr().out
    assert report["scheduler"]["name"] == "laps" and report["scheduler"]["short_batches_total"] > 0
    assert f"scheduler laps: short batches {report['scheduler']['short_batches_total']:,}, " in printed
    assert f"controller: 0 moves in {control['decisions']} decisions" in printed
    assert f"KV transfers: {kv['count']}, {kv['bytes'] / 1e9:.3f} GB" in printed
    # --policy is validated against the deployment: aligned places prefill engines by decode band, refused with pd:.
    assert laps_main(["simulate", "--config", str(config_path), "--dataset", "mixed", "--rate", "4", "--duration", "3",
                      "--policy", "aligned", "--out", str(out)]) == 2
    assert "scheduling.policy: 'aligned' places requests by decode context-length band" in capsys.readouterr().err


def test_the_run_summary_prints_the_scheduler_counters_and_each_move():
    move = {"engine": "sp1", "from_pool": "short", "to_pool": "long", "role": "long-prefill", "kind": "restart", "ok": True,
            "start_s": 12.0, "drain_s": 1.25, "restart_s": 40.0, "end_s": 53.25, "drain_failed": 2}
    flip = {**move, "engine": "sp0", "to_pool": "decode", "role": "decode", "kind": "flip", "start_s": 60.0, "drain_s": 0.5,
            "restart_s": 0.0, "end_s": 60.5, "drain_failed": 0}
    moves = [move, flip, {**flip, "start_s": 70.0, "ok": False, "drain_s": 60.0}, {**move, "kind": "instant", "start_s": 80.0}]
    console = Console(record=True, width=200)
    print_run_summary({"scheduler": {"name": "laps", "short_batches_total": 1234, "short_batches_by_idle_total": 0,
                                     "long_prefills_to_short_pool_total": 5},
                       "controller": {"decisions": 30, "moves": moves, "drain_engine_s": 61.75, "restart_engine_s": 40.0},
                       "kv_transfer": {"count": 0, "bytes": 0, "time_s": {}, "inflation": {}}}, console)
    assert console.export_text().splitlines() == [
        "scheduler laps: short batches 1,234, long prefills to short pool 5",
        "controller: 4 moves in 30 decisions; 61.8 engine-s draining, 40.0 engine-s restarting",
        "  12.0 s: sp1 short -> long as long-prefill (drain 1.2 s, restart 40.0 s, back at 53.2 s, 2 requests failed by the drain timeout)",
        "  60.0 s: sp0 short -> decode as decode (drain 0.5 s, flipped in place, back at 60.5 s)",
        "  70.0 s: sp0 short -> decode as decode (drain 60.0 s, then the flip was given up: still busy; it serves as before)",
        "  80.0 s: sp1 short -> long as long-prefill (instant)",
        "KV transfers: 0, 0.000 GB",
    ]


def test_laps_simulate_refuses_an_output_path_it_cannot_write_before_the_run(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    (tmp_path / "p.png").mkdir()  # where the plot of --out p.json would go
    for flag, path, says, err_path in (("--out", tmp_path, "a directory, not a file name", tmp_path),
                                       ("--trace-out", tmp_path, "a directory, not a file name", tmp_path),
                                       ("--out", blocker / "r.json", "cannot make its folder", blocker / "r.json"),
                                       ("--out", Path("/proc/laps-test.json"), "cannot be written", Path("/proc/laps-test.json")),
                                       ("--out", tmp_path / "p.json", "a directory, not a file name", tmp_path / "p.png"),
                                       ("--out", tmp_path / "r.png", "the same file as --out", tmp_path / "r.png"),
                                       ("--trace-out", tmp_path / "r.json", "the same file as --out", tmp_path / "r.json")):
        argv = ["simulate", "--dataset", "mtbench", "--rate", "1", "--duration", "1", "--quiet", "--out", str(tmp_path / "r.json"), flag, str(path)]
        assert laps_main(argv) == 2
        said = "--out's plot" if err_path.suffix == ".png" and flag == "--out" else flag
        assert capsys.readouterr().err.startswith(f"laps simulate: {said} {err_path}: {says}")
    assert not (tmp_path / "r.json").exists() and not (tmp_path / "p.json").exists()  # refused before anything ran or was written


def test_the_output_check_of_a_refused_run_leaves_a_dangling_link_and_existing_files_as_they_were(tmp_path, capsys):
    link, kept = tmp_path / "link.json", tmp_path / "kept.jsonl"
    link.symlink_to(tmp_path / "later" / "target.json")
    kept.write_text("earlier trace\n")
    argv = ["simulate", "--config", str(tmp_path / "missing.yaml"), "--dataset", "mtbench", "--rate", "1", "--duration", "1",
            "--quiet", "--out", str(link), "--trace-out", str(kept)]
    assert laps_main(argv) == 2  # refused for the missing configuration, after the outputs were checked
    assert "missing.yaml" in capsys.readouterr().err
    assert link.is_symlink() and not (tmp_path / "later" / "target.json").exists() and kept.read_text() == "earlier trace\n"
    (tmp_path / "loop-a").symlink_to(tmp_path / "loop-b")
    (tmp_path / "loop-b").symlink_to(tmp_path / "loop-a")
    assert laps_main([*argv[:-4], "--out", str(tmp_path / "loop-a")]) == 2
    assert capsys.readouterr().err.startswith(f"laps simulate: --out {tmp_path / 'loop-a'}: cannot be written (Symlink loop")


def test_a_refused_run_makes_no_folder_and_a_folder_that_cannot_be_made_is_refused_before_the_run(tmp_path, capsys):
    new = tmp_path / "new"
    argv = ["simulate", "--config", str(tmp_path / "missing.yaml"), "--dataset", "mtbench", "--rate", "1", "--duration", "1",
            "--quiet", "--out", str(new / "deeper" / "r.json"), "--trace-out", str(new / "trace.jsonl")]
    assert laps_main(argv) == 2  # refused for the missing configuration, after the outputs were checked
    assert "missing.yaml" in capsys.readouterr().err and not new.exists()
    (tmp_path / "a-file").write_text("")
    longest = os.pathconf(tmp_path, "PC_NAME_MAX")
    for out, says in ((Path("/proc/laps-test/r.json"), "cannot make its folder in /proc ("),
                      (tmp_path / "a-file" / "x" / "r.json", f"cannot make its folder ({tmp_path / 'a-file'} is not a folder)"),
                      (tmp_path / "new" / ("n" * (longest + 1)) / "r.json", f"cannot be written (a name longer than {longest} bytes: nnnn"),
                      (tmp_path / "new" / ("n" * longest + ".json"), f"cannot be written (a name longer than {longest} bytes: nnnn")):
        assert laps_main(["simulate", *argv[3:-4], "--out", str(out)]) == 2
        assert capsys.readouterr().err.startswith(f"laps simulate: --out {out}: {says}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # the check's own folder was removed again


def test_outputs_through_links_are_written_at_their_targets_and_one_file_under_two_names_is_refused(tmp_path, capsys):
    (tmp_path / "out-link.json").symlink_to(tmp_path / "later" / "r.json")  # dangling: its folder is made by the run
    (tmp_path / "folder-link").symlink_to(tmp_path / "elsewhere")  # a dangling link on the way to the trace
    argv = ["simulate", "--dataset", "mtbench", "--rate", "1", "--duration", "1", "--quiet"]
    assert laps_main([*argv, "--out", str(tmp_path / "out-link.json"), "--trace-out", str(tmp_path / "folder-link" / "t.jsonl")]) == 0
    assert (tmp_path / "later" / "r.json").is_file() and (tmp_path / "out-link.png").is_file()
    assert (tmp_path / "elsewhere" / "t.jsonl").is_file()
    (tmp_path / "hard.jsonl").hardlink_to(tmp_path / "later" / "r.json")
    assert laps_main([*argv, "--out", str(tmp_path / "later" / "r.json"), "--trace-out", str(tmp_path / "hard.jsonl")]) == 2
    assert capsys.readouterr().err.startswith(f"laps simulate: --trace-out {tmp_path / 'hard.jsonl'}: the same file as --out")


@pytest.mark.parametrize("name", ["", ".", "..", "runs/", "/", "runs/.", "runs/.."])
def test_an_output_name_that_can_only_be_a_folder_is_a_usage_error(name, capsys):
    for flag in ("--out", "--trace-out"):
        with pytest.raises(SystemExit) as info:
            laps_main(["simulate", "--dataset", "mtbench", "--rate", "1", "--duration", "1", flag, name])
        assert info.value.code == 2 and f"argument {flag}: {name!r} names a folder, not a file" in capsys.readouterr().err


def test_outputs_that_cannot_be_written_after_the_run_are_one_error_line_and_a_device_gets_no_plot(tmp_path, capsys):
    argv = ["simulate", "--dataset", "mtbench", "--rate", "1", "--duration", "2", "--seed", "2", "--quiet"]
    assert laps_main([*argv, "--out", "/dev/full"]) == 1  # accepted (a device that can be written), then full
    assert capsys.readouterr().err == "laps simulate: cannot write --out /dev/full: No space left on device\n"
    assert laps_main([*argv, "--out", str(tmp_path / "ok.json"), "--trace-out", "/dev/full"]) == 1  # the trace's the failure
    assert capsys.readouterr().err == (f"laps simulate: cannot write --trace-out /dev/full: No space left on device "
                                       f"(written: {tmp_path / 'ok.png'}, {tmp_path / 'ok.json'})\n")
    assert laps_main([*argv, "--out", "/dev/null", "--trace-out", "/dev/null"]) == 0  # a stream takes both
    assert not Path("/dev/null.png").exists()


def test_an_output_another_needs_as_its_folder_a_link_to_a_folder_and_a_name_too_long_are_refused_before_the_run(tmp_path, capsys):
    argv = ["simulate", "--dataset", "mtbench", "--rate", "1", "--duration", "1", "--quiet"]
    a, b = tmp_path / "a", tmp_path / "b"
    (tmp_path / "folder-link.json").symlink_to(f"{tmp_path / 'later'}/")
    (tmp_path / "dot-link.json").symlink_to(f"{tmp_path / 'later'}/.")
    (tmp_path / "chained.json").symlink_to(tmp_path / "dot-link.json")  # a link to a link to a folder
    almost = tmp_path / ("n" * (os.pathconf(tmp_path, "PC_NAME_MAX") - 4))  # fits; with .partial it does not
    with open(tmp_path / "closed.txt", "w") as f:
        closed = f.fileno()
    (tmp_path / "busy.json.partial").mkdir()  # in the way of the file a report is written as first
    too_long = tmp_path / ("n" * (os.pathconf(tmp_path, "PC_NAME_MAX") + 1) + ".json")
    for outputs, says in ((["--out", str(a / "x.json"), "--trace-out", str(a)], f"--trace-out {a}: --out {a / 'x.json'} needs it as a folder"),
                          (["--out", str(b), "--trace-out", str(b / "t.jsonl")], f"--trace-out {b / 't.jsonl'}: needs --out {b} as a folder"),
                          (["--out", str(tmp_path / "folder-link.json")], f"--out {tmp_path / 'folder-link.json'}: a link to a folder"),
                          (["--out", str(tmp_path / "dot-link.json")], f"--out {tmp_path / 'dot-link.json'}: a link to a folder"),
                          (["--out", str(tmp_path / "busy.json")], f"--out {tmp_path / 'busy.json'}: cannot be written "
                                                                    "(busy.json.partial, which it is written as first, is a folder)"),
                          (["--out", str(tmp_path / "chained.json")], f"--out {tmp_path / 'chained.json'}: a link to a folder"),
                          (["--out", str(almost)], f"--out {almost}: cannot be written (nnnn"),
                          (["--out", f"/dev/fd/{closed}"], f"--out /dev/fd/{closed}: names a file descriptor that is not open"),
                          (["--out", str(too_long)], f"--out {too_long}: cannot be written (File name too long)")):
        assert laps_main([*argv, *outputs]) == 2
        assert capsys.readouterr().err.startswith(f"laps simulate: {says}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy.json.partial", "chained.json", "closed.txt", "dot-link.json", "folder-link.json"]
    read_end, write_end = os.pipe()  # one pipe takes one output: a JSON and a trace mixed there would be neither
    try:
        assert laps_main([*argv, "--out", f"/dev/fd/{write_end}", "--trace-out", f"/dev/fd/{write_end}"]) == 2
        assert capsys.readouterr().err.startswith(f"laps simulate: --trace-out /dev/fd/{write_end}: the same file as --out")
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_stream_is_appended_to_with_no_plot_beside_it(tmp_path):
    log = tmp_path / "log.txt"
    log.write_text("earlier line\n")
    report = build_report([], slo_ttft_s=0.4)
    with open(log, "a") as f:  # as a shell's >> leaves stdout; /dev/fd/N names it
        written = []
        write_report(report, [], Path(f"/dev/fd/{f.fileno()}"), written)
        assert written == [Path(f"/dev/fd/{f.fileno()}")]  # no plot beside a stream
    assert log.read_text().startswith("earlier line\n{") and sorted(p.name for p in tmp_path.iterdir()) == ["log.txt"]
    assert is_stream(Path("/dev/stdout")) and is_stream(Path("/dev/null")) and not is_stream(log)
    assert not is_stream(Path("/dev/shm/laps-report.json"))  # a file of its own, under /dev


def test_a_file_is_written_beside_itself_and_renamed_over_so_a_failed_write_leaves_the_earlier_one_whole(tmp_path):
    out = tmp_path / "r.json"
    out.write_text("earlier\n")
    with pytest.raises(OSError, match="No space left"):
        with open_output(out) as f:
            f.write(b"half a rep")
            raise OSError(28, "No space left on device")  # as a full disk fails a write
    assert out.read_text() == "earlier\n" and [p.name for p in tmp_path.iterdir()] == ["r.json"]
    with open_output(out) as f:
        f.write(b"whole\n")
    assert out.read_text() == "whole\n" and [p.name for p in tmp_path.iterdir()] == ["r.json"]
    (tmp_path / "x.json.partial").mkdir()
    with pytest.raises(FileExistsError) as info, open_output(tmp_path / "x.json") as f:
        f.write(b"never: the file beside it cannot be opened")
    assert info.value.filename == str(tmp_path / "x.json.partial")  # what is in the way
    precious = tmp_path / "precious.txt"
    precious.write_text("mine\n")
    (tmp_path / "r.json.partial").symlink_to(precious)  # a link left where the file beside --out is written
    out.chmod(0o600)
    with open_output(out) as f:
        f.write(b"again\n")
    assert precious.read_text() == "mine\n" and not (tmp_path / "r.json.partial").exists()  # not written through
    assert out.read_text() == "again\n" and out.stat().st_mode & 0o777 == 0o600  # the earlier file's permissions
    (tmp_path / "other-name.json").hardlink_to(out)
    with open_output(out) as f:
        f.write(b"both\n")
    assert (tmp_path / "other-name.json").read_text() == "both\n"  # a file of two names written in place: still one


def test_a_failed_write_takes_back_the_folders_it_made_and_a_name_up_from_a_missing_folder_is_refused(tmp_path, monkeypatch, capsys):
    with pytest.raises(OSError, match="No space left"), open_output(tmp_path / "new" / "sub" / "r.json"):
        raise OSError(28, "No space left on device")
    assert list(tmp_path.iterdir()) == []
    real_mkdir = Path.mkdir

    def mkdir_full_at_sub(self, *args, **kwargs):
        if self.name == "sub":
            raise OSError(28, "No space left on device")
        return real_mkdir(self, *args, **kwargs)

    with monkeypatch.context() as patched, pytest.raises(OSError, match="No space left"):
        patched.setattr(Path, "mkdir", mkdir_full_at_sub)
        with open_output(tmp_path / "new" / "sub" / "r.json") as f:
            f.write(b"never: its folder cannot be made")
    assert list(tmp_path.iterdir()) == []  # "new" made, then "sub" not: "new" taken back
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.json").mkdir()  # what "missing/../r.json" would name, were "missing" there
    (tmp_path / "link.json").symlink_to("gone/../y.json")
    (tmp_path / "D").symlink_to("gone/../r.json")  # a link on the way, not at its end
    argv = ["simulate", "--dataset", "mtbench", "--rate", "1", "--duration", "1", "--quiet"]
    for out, missing in (("missing/../r.json", "missing"), ("link.json", "gone"), ("D/x.json", "gone")):
        assert laps_main([*argv, "--out", out]) == 2
        assert capsys.readouterr().err == (f"laps simulate: --out {out}: cannot be written (the way to it goes up (..) from "
                                           f"{tmp_path / missing}, which is no folder)\n")
    assert laps_main([*argv, "--out", "r.json/../ok.json"]) == 0  # up from a folder that is there: as the system goes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["D", "link.json", "ok.json", "ok.png", "r.json"]


def test_a_socket_is_refused_before_the_run_and_a_device_is_not_standard_output(tmp_path, capsys):
    import socket

    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(tmp_path / "sock"))
        assert laps_main(["simulate", "--dataset", "mtbench", "--rate", "1", "--duration", "1", "--out", str(tmp_path / "sock")]) == 2
    assert capsys.readouterr().err.startswith(f"laps simulate: --out {tmp_path / 'sock'}: a socket, not a file")
    assert not is_stdout(Path("/dev/null"))  # even where standard output is /dev/null: a table printed there is gone anyway


def test_only_links_that_name_a_descriptor_make_a_stream(tmp_path):
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    link = Path("/dev/shm") / f"laps-test-{os.getpid()}.json"
    link.symlink_to(tmp_path / "r.json")
    try:
        assert not is_stream(link)  # a link of the user's under /dev to a file of its own
    finally:
        link.unlink()
    (tmp_path / "to-stdout").symlink_to("/dev/stdout")
    assert is_stream(tmp_path / "to-stdout") and is_stream(Path("/dev/fd/1")) and is_stream(Path("/proc/self/fd/1"))


def test_a_report_to_standard_output_is_the_only_thing_there(capfd):
    assert laps_main(["simulate", "--dataset", "mtbench", "--rate", "4", "--duration", "2", "--out", "/dev/stdout"]) == 0
    out, err = capfd.readouterr()
    assert orjson.loads(out)["requests"]["sent"] > 0  # one JSON document: the table went to standard error
    assert "TTFT" in err and "wrote /dev/stdout" in err


def test_a_stream_redirected_to_a_file_named_as_the_other_output_is_that_file(tmp_path, capsys):
    log = tmp_path / "log.txt"
    log.write_text("earlier line\n")
    argv = ["simulate", "--dataset", "mtbench", "--rate", "1", "--duration", "1", "--quiet"]
    with open(log, "a") as f:  # --out /dev/stdout --trace-out log.txt >> log.txt
        stdout = Path(f"/dev/fd/{f.fileno()}")
        (tmp_path / "my-stdout").symlink_to(stdout)  # a link of the user's to it is a stream too
        assert is_stream(tmp_path / "my-stdout")
        assert laps_main([*argv, "--out", str(stdout), "--trace-out", str(log)]) == 2
    assert capsys.readouterr().err.startswith(f"laps simulate: --trace-out {log}: the same file as --out")
    assert log.read_text() == "earlier line\n"


def test_laps_simulate_reports_a_bad_replay_file_and_refuses_bad_numbers(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"bad": 1}\n')
    out = str(tmp_path / "r.json")
    assert laps_main(["simulate", "--dataset", f"replay:{bad}", "--duration", "5", "--out", out, "--quiet"]) == 2
    assert capsys.readouterr().err == (f"laps simulate: {bad} line 1: not a --trace-out record: "
                                       "missing conversation_id, source, turn, user, max_tokens, start_s\n")
    for flag, value in (("--duration", "0"), ("--duration", "-5"), ("--think-time-s", "-1"), ("--max-tokens", "0")):
        with pytest.raises(SystemExit) as info:
            laps_main(["simulate", "--dataset", "mtbench", "--rate", "1", flag, value, "--out", out, "--quiet"])
        assert info.value.code == 2 and f"argument {flag}: must be" in capsys.readouterr().err


def test_a_question_about_a_document_being_prefilled_goes_where_it_is_prefilled_and_finds_all_but_its_last_chunk():
    roles = {name: {"pool": pool, "flags": {"chunked-prefill-size": 2048, "schedule-policy": "shortest-prefill-first"}}
             for name, pool in (("chat", "short"), ("docs", "long"))}
    config = parse_config({"roles": roles, "engines": [{"name": "e0", "role": "chat", "gpus": [0]}, {"name": "e1", "role": "docs", "gpus": [1]}],
                           "scheduling": {"policy": "laps"}})
    doc = " ".join(f"line {i} of the shared report." for i in range(1500))
    other = " ".join(f"row {i} of another table." for i in range(500))
    conversations = (Conversation("a", "test", (Turn(doc + "\nSummarise it.", 8),), start_s=0.0),
                     Conversation("c", "test", (Turn(other + "\nSummarise it.", 8),), start_s=0.005),
                     Conversation("b", "test", (Turn(doc + "\nWho wrote it, when, and for which of its readers?", 8),), start_s=0.01))
    run = simulate_run(config, scripted(*conversations), duration_s=10, seed=0, tokenizer=TOK)
    by_id = {r.conversation_id: r for r in run.records}
    a, b, c = by_id["a"], by_id["b"], by_id["c"]
    assert len(run.prefix_index.in_flight) == 0  # every prefill in flight ended
    assert (a.prompt_tokens, a.cached_tokens, b.prompt_tokens, c.prompt_tokens) == (15424, 0, 15432, 4424)
    # The document goes to e1, the other long prompt to the idle e0. At 0.01 s nothing of the document is cached
    # anywhere (its first chunk is still running), but its prefill is in flight on e1: the question goes there,
    # waits, and is admitted with the document's last chunk, finding its 7 earlier chunks cached (14,336 tokens not
    # computed twice); its first token comes with the document's. Without that credit it went to e0, behind the
    # other prompt, and prefilled all 15,432 tokens there (TTFT 0.52 s against 0.44 s).
    assert (b.laps_class, b.cached_tokens_est, b.cached_tokens) == ("long", 0, 7 * 2048)
    assert b.start_s + b.ttft_s == pytest.approx(a.ttft_s, abs=0.01)
    # The run's summary counts it (laps_scheduler_requests_to_in_flight_prefix_total on a live gateway): one request
    # sent where a prefill in flight counted, no short batch, the other long prompt borrowing the short pool's e0.
    scheduler = run.summary()["scheduler"]
    assert (scheduler["name"], scheduler["requests_to_in_flight_prefix_total"], scheduler["short_batches_total"],
            scheduler["long_prefills_to_short_pool_total"]) == ("laps", 1, 0, 1)
