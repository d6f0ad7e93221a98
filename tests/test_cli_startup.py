"""`laps serve` and `laps demo` start-up failures: one clear line, before any engine starts; the bound port shown; a Ctrl-C
ends the gateway quietly."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

import laps.cli
from laps.config import DEFAULT_CONFIG_PATH
from laps.demo import serving
from tests.test_http_limits import listen_backlogs


def write_config(tmp_path, **changes) -> tuple:
    """The default config with ``changes`` merged into its top-level sections; returns (config path, log dir)."""
    data = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    for section, values in changes.items():
        data[section] = {**data.get(section, {}), **values}
    data["log_dir"] = str(tmp_path / "logs")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, tmp_path / "logs"


def laps_serve(config_path, *extra: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "laps.cli", "serve", "--config", str(config_path), *extra], capture_output=True, text=True, timeout=timeout_s)


@pytest.mark.parametrize(
    "make_path, reason",
    [
        (lambda tmp: tmp / "nonexistent", "no such directory"),
        (lambda tmp: (tmp / "file.txt", (tmp / "file.txt").write_text("x"))[0], "not a directory"),
        (lambda tmp: (tmp / "empty", (tmp / "empty").mkdir())[0], "no tokenizer.json or tokenizer_config.json in the directory"),
    ],
)
def test_a_bad_model_path_is_one_line_and_exit_2_before_any_engine_starts(tmp_path, make_path, reason):
    model_path = make_path(tmp_path)
    config_path, log_dir = write_config(tmp_path, model={"path": str(model_path)})
    result = laps_serve(config_path)
    assert (result.returncode, result.stderr) == (2, f"laps: model.path {model_path}: {reason}\n")
    assert sorted(p.name for p in log_dir.iterdir()) == ["gateway.log"]  # no engine-*.log: none started


def test_a_taken_port_fails_before_any_engine_starts(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        config_path, log_dir = write_config(tmp_path)
        result = laps_serve(config_path, "--port", str(port))
    assert result.returncode == 1
    assert result.stderr.rstrip().endswith(f"ERROR laps: cannot listen on 127.0.0.1:{port}: Address already in use")
    assert sorted(p.name for p in log_dir.iterdir()) == ["gateway.log"]


def test_a_log_dir_that_cannot_be_made_is_one_line_and_exit_2(tmp_path):
    config_path, _ = write_config(tmp_path)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    data = yaml.safe_load(config_path.read_text())
    data["log_dir"] = str(blocker / "logs")  # under a file: no folder can be made there
    config_path.write_text(yaml.safe_dump(data))
    result = laps_serve(config_path)
    assert (result.returncode, result.stderr) == (2, f"laps: log_dir {blocker / 'logs'}: cannot write the gateway's log there (Not a directory)\n")


def test_a_bad_override_names_only_the_flag_given(tmp_path):
    config_path, _ = write_config(tmp_path)
    result = laps_serve(config_path, "--workers", "0")
    assert result.returncode == 2
    assert f"{config_path} with --workers: invalid configuration" in result.stderr
    assert "greater than or equal to 1" in result.stderr


def _tokenizer_workers(pid: int) -> list[int]:
    """The pids of ``pid``'s children that multiprocessing spawned (the gateway's tokenizer workers)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid and b"multiprocessing.spawn" in (stat.parent / "cmdline").read_bytes():
                found.append(int(stat.parent.name))
    return found


def test_port_0_prints_the_port_it_bound_and_a_ctrl_c_stops_it_quietly(tmp_path):
    """The ready line names the bound port; a Ctrl-C at the terminal (SIGINT to the whole process group, the tokenizer
    worker that a long prompt started included) ends it with code 0 and nothing but log lines on stderr."""
    config_path, _ = write_config(tmp_path, gateway={"port": 0, "listen_backlog": 777})
    with (tmp_path / "stderr").open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "laps.cli", "serve", "--config", str(config_path)], stdout=subprocess.PIPE, stderr=stderr,
                                text=True, start_new_session=True)  # its own process group, as a shell gives a command
    try:
        line = proc.stdout.readline()  # blocks until the gateway is ready (or exits: then the match below fails)
        match = re.fullmatch(r"laps: ready on http://127\.0\.0\.1:(\d+)\n", line)
        assert match, line
        port = int(match.group(1))
        assert port != 0
        assert listen_backlogs(port) == [777]  # gateway.listen_backlog, not aiohttp's 128
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()["data"][0]["id"] == "Qwen2.5-7B-Instruct"
        chat = {"model": "Qwen2.5-7B-Instruct", "messages": [{"role": "user", "content": "word " * 8000}], "max_tokens": 2}
        assert httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat, timeout=60).status_code == 200
        assert len(_tokenizer_workers(proc.pid)) == 1  # 40,000 characters: over gateway.tokenizer_process_min_chars
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    stderr = (tmp_path / "stderr").read_text()
    assert "laps.gateway: shutting down: no new connections" in stderr  # the log lines are there
    for noise in ("Traceback", "KeyboardInterrupt", "leaked semaphore"):
        assert noise not in stderr


# A stand-in for SGLang (through sglang.python) that says it is up, then never becomes ready.
NEVER_READY_ENGINE = '#!/bin/sh\necho "stand-in engine $$ up"\nexec sleep 600\n'


@pytest.mark.parametrize("workers", [1, 2])
def test_a_ctrl_c_during_start_up_stops_the_engines_started_and_exits_130(tmp_path, workers):
    """sp0 (simulated) starts, lp0 never becomes ready; a Ctrl-C at the terminal (SIGINT to the gateway's process
    group) meanwhile cancels the start-up at once: both engines are stopped, nothing is reported as an engine failure,
    the exit code is 130."""
    stand_in = tmp_path / "sglang-stand-in"
    stand_in.write_text(NEVER_READY_ENGINE)
    stand_in.chmod(0o755)
    config_path, log_dir = write_config(tmp_path, gateway={"port": 0, "workers": workers}, sglang={"python": str(stand_in)})
    data = yaml.safe_load(config_path.read_text())
    data["engines"][1]["kind"] = "sglang"
    config_path.write_text(yaml.safe_dump(data))
    with (tmp_path / "stderr").open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "laps.cli", "serve", "--config", str(config_path)], stdout=subprocess.PIPE,
                                stderr=stderr, text=True, start_new_session=True)  # its own process group, as a shell gives a command
    try:
        engine_log = log_dir / "engine-lp0.log"
        deadline = time.monotonic() + 60
        while not (engine_log.exists() and (up := re.search(r"stand-in engine (\d+) up", engine_log.read_text()))):
            assert proc.poll() is None and time.monotonic() < deadline, "lp0 was not started"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=30) == 130  # not once lp0's 300 s ready timeout is over
        assert proc.stdout.read() == ""  # never ready
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with pytest.raises(ProcessLookupError):  # stopped (and reaped)
        os.kill(int(up.group(1)), 0)
    log = (log_dir / "gateway.log").read_text()
    assert "interrupted during start-up (SIGINT): stopping the engines started so far" in log
    assert "engine lp0: stopped" in log and "engine sp0: stopped" in log
    stderr = (tmp_path / "stderr").read_text()
    for noise in ("exited with code", "before it was ready", "did not start", "ERROR", "Traceback", "KeyboardInterrupt"):
        assert noise not in stderr


def test_the_demo_shows_why_the_gateway_did_not_start(tmp_path):
    config_path, log_dir = write_config(tmp_path, model={"path": str(tmp_path / "nonexistent")})
    with pytest.raises(RuntimeError) as info:
        with serving(config_path):
            pass
    assert str(info.value) == (
        f"the gateway exited with code 2 during start-up; see {log_dir / 'gateway.log'}; its stderr ends with:\n"
        f"laps: model.path {tmp_path / 'nonexistent'}: no such directory"
    )


def test_ctrl_c_while_the_subcommands_import_ends_quietly(monkeypatch):
    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(laps.cli, "build_parser", interrupted)
    try:
        code = laps.cli.main(["serve"])
    except KeyboardInterrupt:  # escaping, it would end the whole test run
        pytest.fail("a Ctrl-C while building the parser escaped main()")
    assert code == 130
