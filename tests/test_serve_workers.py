"""`laps serve --workers 2` on simulated engines: both workers serve chats (streamed and not) and OpenAI 4xx errors,
the admin API's role switch, one /metrics counts them all, a killed worker is started again while the other's request goes on, Ctrl-C stops all;
a prefill-decode deployment served by two workers; a killed scheduler is started again with its engines, and the workers reconnect to it."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson
import pytest

import yaml

from tests.pd_stack import free_bootstrap_base, pd_data
from tests.test_cli_startup import write_config
from tests.test_http_limits import listen_backlogs

MODEL = "Qwen2.5-7B-Instruct"
START_TIMEOUT_S = 120.0
ADMIN_KEY = "admin-key-for-tests"


def _chat(max_tokens: int = 4, stream: bool = False, text: str = "hello there") -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "stream": stream}


def _worker_pids(log: Path) -> dict[int, int]:
    """``{worker index: pid}`` of the workers the supervisor started last (its log lines)."""
    return {int(i): int(pid) for i, pid in re.findall(r"worker (\d+) started \(pid (\d+)\)", log.read_text())}


def _holder_of_the_connection(port: int, pids) -> int:
    """The pid among ``pids`` that holds the one established connection to ``port`` (the kernel's socket tables)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":  # local port, ESTABLISHED
                inodes.add(fields[9])
    holders = {pid for pid in pids for fd in Path(f"/proc/{pid}/fd").iterdir()
               if os.readlink(fd).startswith("socket:[") and os.readlink(fd)[8:-1] in inodes}
    assert len(holders) == 1, (inodes, holders)
    return holders.pop()


def _served_by(log: Path, *rids: str) -> dict[str, str]:
    """``{request id: worker}`` of the chats answered ``ok`` (the workers' request log lines), once ``rids`` are all
    logged (a request's line follows the end of its answer)."""
    deadline = time.monotonic() + 30
    while True:
        found = re.findall(r"\[(worker-\d)\] laps\.gateway: (\S+) /v1/chat/completions .* outcome=ok", log.read_text())
        by_rid = {rid: worker for worker, rid in found}
        if all(rid in by_rid for rid in rids) or time.monotonic() > deadline:
            return by_rid
        time.sleep(0.05)


def _start(config_path: Path, stderr_path: Path) -> tuple[str, subprocess.Popen]:
    """``laps serve --workers 2`` of ``config_path`` in its own process group (as a shell starts it), once ready:
    (base URL, process)."""
    with stderr_path.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "laps.cli", "serve", "--config", str(config_path), "--workers", "2"],
                                stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True)
    line = proc.stdout.readline()  # blocks until ready (or exit: then the match fails)
    match = re.fullmatch(r"laps: ready on (http://127\.0\.0\.1:\d+)\n", line)
    if not match:
        _stop(proc)
    assert match, line
    return match.group(1), proc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """``laps serve --workers 2`` on the default config's two sim engines, port 0, in its own process group (as a shell
    starts it), shared by this module's tests (the last one stops it); (base URL, gateway log, process, its stderr)."""
    tmp = tmp_path_factory.mktemp("workers")
    config_path, log_dir = write_config(tmp, gateway={"port": 0, "shutdown_grace_s": 5, "admin_key": ADMIN_KEY, "listen_backlog": 777})
    url, proc = _start(config_path, tmp / "stderr")
    try:
        yield url, log_dir / "gateway.log", proc, tmp / "stderr"
    finally:
        _stop(proc)


def test_a_killed_worker_is_started_again_and_the_other_workers_request_completes(gateway):
    url, log, _, _ = gateway
    port = int(url.rsplit(":", 1)[1])
    pids = _worker_pids(log)
    assert sorted(pids) == [0, 1]
    with httpx.Client(base_url=url, timeout=60) as client:
        with client.stream("POST", "/v1/chat/completions", json=_chat(max_tokens=1500, stream=True, text="tell me a long story")) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")  # under way
            holder = _holder_of_the_connection(port, pids.values())
            victim = next(i for i, pid in pids.items() if pid != holder)
            os.kill(pids[victim], signal.SIGKILL)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert not any('"error"' in line for line in rest)
        chunks = [orjson.loads(line.removeprefix("data: ")) for line in rest[:-1]]
        assert any(c["choices"] and c["choices"][0]["finish_reason"] for c in chunks)  # the whole answer
    deadline = time.monotonic() + START_TIMEOUT_S
    while f"worker-{victim} is ready" not in log.read_text():
        assert time.monotonic() < deadline, "the killed worker was not started again"
        time.sleep(0.2)
    assert _worker_pids(log)[victim] != pids[victim]
    assert f"worker {victim} (pid {pids[victim]}) exited with code -9" in log.read_text()
    for _ in range(6):  # both workers serve again
        with httpx.Client(base_url=url, timeout=30) as client:
            assert client.post("/v1/chat/completions", json=_chat()).status_code == 200


def test_two_workers_serve_chats_errors_and_one_metrics_and_stop_on_ctrl_c(gateway):
    url, log, proc, stderr = gateway
    assert listen_backlogs(int(url.rsplit(":", 1)[1])) == [777, 777]  # each worker's SO_REUSEPORT socket: gateway.listen_backlog
    before = len(re.findall(r"outcome=ok", log.read_text()))
    workers: set[str] = set()
    sent = 0
    while workers != {"worker-0", "worker-1"}:  # a fresh connection each: the kernel spreads them over the workers
        assert sent < 40, workers
        with httpx.Client(base_url=url, timeout=30) as client:
            answer = client.post("/v1/chat/completions", json=_chat())
            assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]
            with client.stream("POST", "/v1/chat/completions", json=_chat(stream=True)) as stream:
                lines = [line for line in stream.iter_lines() if line]
            assert stream.status_code == 200 and lines[-1] == "data: [DONE]"
        sent += 2
        by_rid = _served_by(log, answer.headers["x-request-id"], stream.headers["x-request-id"])
        # one connection, one worker: its JSON answer and its stream
        assert by_rid[answer.headers["x-request-id"]] == by_rid[stream.headers["x-request-id"]]
        workers.add(by_rid[answer.headers["x-request-id"]])
    for _ in range(2):
        with httpx.Client(base_url=url, timeout=30) as client:
            bad = client.post("/v1/chat/completions", json={"model": MODEL})
            assert bad.status_code == 400
            assert bad.json() == {"error": {"message": "messages: Field required", "type": "invalid_request_error", "param": "messages", "code": None}}
            unknown = client.post("/v1/chat/completions", json=_chat() | {"model": "nope"})
            assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
            refused = client.post("/v1/chat/completions", json=_chat() | {"n": 3})  # the simulated engine's 400, relayed
            assert refused.status_code == 400 and refused.json()["error"]["type"] == "invalid_request_error"
            assert "n must be 1 on the simulated engine (it answers one choice), got 3" in refused.json()["error"]["message"]
    sent += _switch_through_a_worker(url)
    text = log.read_text()
    ok = len(re.findall(r"outcome=ok", text))
    assert ok == before + sent
    metrics = httpx.get(f"{url}/metrics", timeout=10).text  # any worker's: every process's counters, the dead one's too
    assert f'laps_requests_total{{cls="short",outcome="ok"}} {ok}.0' in metrics
    assert "laps_scheduler_short_batches_total" in metrics
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C at the terminal: the whole process group
    assert proc.wait(timeout=60) == 0
    text = log.read_text()
    assert "shutting down: 2 workers drain" in text and "engine sp0: stopped" in text and "engine lp0: stopped" in text
    # Quiet, the killed worker's too: it had made no tokenizer pool, whose semaphores the resource tracker would report
    for noise in ("Traceback", "KeyboardInterrupt", "leaked semaphore"):
        assert noise not in stderr.read_text()


def _switch_through_a_worker(url: str) -> int:
    """The admin API through whichever worker takes the connection: the scheduler process checks and starts the switch
    (sp0 to ``mixed``: other flags, so a restart of the simulated engine), and every worker's listing shows it; the
    number of chats sent after it."""
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    wrong = httpx.post(f"{url}/admin/engines/sp0/role", json={"role": "nope"}, headers=admin, timeout=10)
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "role"
    switch = httpx.post(f"{url}/admin/engines/sp0/role", json={"role": "mixed", "drain_timeout_s": 5}, headers=admin, timeout=10)
    assert switch.status_code == 202 and switch.json() == {"engine": "sp0", "role": "mixed", "status": "switching"}
    again = httpx.post(f"{url}/admin/engines/sp0/role", json={"role": "mixed"}, headers=admin, timeout=10)
    assert again.status_code == 409 and again.json()["error"]["type"] == "conflict_error"  # the scheduler's registry of switches
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        rows = {r["id"]: r for r in httpx.get(f"{url}/admin/engines", headers=admin, timeout=10).json()["engines"]}
        if rows["sp0"]["state"] == "healthy" and rows["sp0"]["role"] == "mixed":
            break
        assert time.monotonic() < deadline, rows
        time.sleep(0.2)
    assert rows["sp0"]["pool"] == "short" and rows["lp0"]["role"] == "long-prefill"
    unchanged = httpx.post(f"{url}/admin/engines/sp0/role", json={"role": "mixed"}, headers=admin, timeout=10)
    assert unchanged.status_code == 200 and unchanged.json()["status"] == "unchanged"
    for _ in range(4):  # fresh connections: both workers route to the switched engine's new URL
        with httpx.Client(base_url=url, timeout=30) as client:
            assert client.post("/v1/chat/completions", json=_chat()).status_code == 200
    return 4


def test_two_workers_serve_a_prefill_decode_deployment(tmp_path):
    """Each request is prefilled and decoded on the pair the scheduler picked; the prefix index learns through the
    workers (a follow-up turn is routed with its cached history); every engine's load is back to none afterwards."""
    data = pd_data(log_dir=str(tmp_path / "logs"), controller={"enabled": False})
    data["gateway"].update(port=0, shutdown_grace_s=5, admin_key=ADMIN_KEY)
    data["pd"]["bootstrap_port"] = free_bootstrap_base(2)
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(data))
    url, proc = _start(config_path, tmp_path / "stderr")
    try:
        decode_engines, workers = set(), set()
        for i in range(24):  # fresh connections, at least 6, until both workers have served (the kernel spreads them)
            history = [{"role": "user", "content": f"Conversation {i}: tell me about rivers and the towns along them. " * 8}]
            with httpx.Client(base_url=url, timeout=30) as client:
                first = client.post("/v1/chat/completions", json={"model": MODEL, "messages": history, "max_tokens": 8})
                assert first.status_code == 200, first.text
                history += [first.json()["choices"][0]["message"], {"role": "user", "content": "And the longest one?"}]
                with client.stream("POST", "/v1/chat/completions",
                                   json={"model": MODEL, "messages": history, "max_tokens": 8, "stream": True}) as follow_up:
                    lines = [line for line in follow_up.iter_lines() if line]
            assert follow_up.status_code == 200 and lines[-1] == "data: [DONE]"
            for answer in (first, follow_up):
                assert answer.headers["x-laps-engine"] in {"ps0", "pl0"}
                decode_engines.add(answer.headers["x-laps-decode-engine"])
            assert int(follow_up.headers["x-laps-cached-tokens-est"]) >= int(first.headers["x-laps-prompt-tokens"]) // 16 * 16 - 16
            workers.update(_served_by(tmp_path / "logs" / "gateway.log", first.headers["x-request-id"]).values())
            if i >= 5 and len(workers) == 2:
                break
        assert decode_engines <= {"d0", "d1"} and workers == {"worker-0", "worker-1"}  # least_load: one at a time, d0
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        deadline = time.monotonic() + 10
        while True:  # a request's done note follows its answer
            rows = httpx.get(f"{url}/admin/engines", headers=admin, timeout=10).json()["engines"]
            if all(r["in_flight"] == 0 for r in rows) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert {r["id"]: (r["pool"], r["in_flight"]) for r in rows} == {"ps0": ("short", 0), "pl0": ("long", 0), "d0": ("decode", 0),
                                                                         "d1": ("decode", 0)}
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert "Traceback" not in (tmp_path / "stderr").read_text()
    finally:
        _stop(proc)


def test_a_killed_scheduler_is_started_again_with_its_engines_and_the_workers_reconnect(tmp_path):
    config_path, log_dir = write_config(tmp_path, gateway={"port": 0, "shutdown_grace_s": 2})
    log = log_dir / "gateway.log"
    url, proc = _start(config_path, tmp_path / "stderr")
    try:
        scheduler = int(re.search(r"scheduler process started \(pid (\d+)\)", log.read_text()).group(1))
        workers = _worker_pids(log)
        os.kill(scheduler, signal.SIGKILL)
        deadline = time.monotonic() + START_TIMEOUT_S
        answers = set()
        while "the scheduler is back" not in log.read_text():  # meanwhile every answer is explicit: a 503 naming why
            assert time.monotonic() < deadline, "the scheduler was not started again"
            with httpx.Client(base_url=url, timeout=30) as client:
                answer = client.post("/v1/chat/completions", json=_chat())
                if answer.status_code != 200:
                    answers.add((answer.status_code, answer.json()["error"]["code"]))
                health = client.get("/health")
                if health.status_code != 200:
                    answers.add((health.status_code, health.json()["status"]))
            time.sleep(0.05)
        # the workers answer 503 and say so on /health (their engines stopped with the scheduler)
        assert {(503, "scheduler_unavailable"), (503, "unavailable")} <= answers, answers
        assert answers <= {(503, "scheduler_unavailable"), (503, "unavailable"), (503, "engine_unavailable")}, answers
        text = log.read_text()
        assert f"the scheduler process (pid {scheduler}) exited with code -9" in text
        assert len(re.findall(r"scheduler process started", text)) == 2
        # the workers' channels come back by themselves, within moments of the new scheduler listening, and each worker
        # takes the new engines at once; wait for both (a /health answer is one worker's, whichever took the connection)
        while log.read_text().count("the new scheduler's engines are in this worker's registry") < 2:
            assert time.monotonic() < deadline, "the workers did not serve again"
            time.sleep(0.05)
        with httpx.Client(base_url=url, timeout=30) as client:
            assert client.get("/health").status_code == 200
        for _ in range(6):  # fresh connections, spread over both workers: they serve through the new scheduler's engines
            with httpx.Client(base_url=url, timeout=30) as client:
                assert client.post("/v1/chat/completions", json=_chat()).status_code == 200
        assert _worker_pids(log) == workers  # the same workers: none was started again
        assert log.read_text().count("the scheduler channel is back") == 2
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert "Traceback" not in (tmp_path / "stderr").read_text()
    finally:
        _stop(proc)


def test_a_child_that_dies_young_again_and_again_is_started_again_ever_later():
    from gateway.workers import restart_delay_s

    assert [restart_delay_s(n) for n in range(8)] == [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


def test_a_port_held_by_a_multi_worker_gateway_is_refused_to_another():
    from gateway.workers import port_lock

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with port_lock(port):
        with pytest.raises(OSError, match=f"port {port} is already served by another laps gateway with workers"):
            with port_lock(port):
                pass
    lock_file = Path(tempfile.gettempdir(), f"laps-gateway-port-{port}.lock")
    assert not lock_file.exists()  # removed by its last holder
    with port_lock(port):  # released with its holder
        assert lock_file.exists()
    assert not lock_file.exists()


def _no_logging(label: str) -> None:
    """The child's logging set-up, left out: the test reads the child's stderr for tracebacks alone (a top-level
    function, so that the spawned child can import it)."""


def _ctrl_c_while_starting(ready, setup_logging) -> None:
    """A child whose start-up (its imports, before :func:`gateway.workers._child_start`) gets a Ctrl-C."""
    from gateway.workers import READY, _child_start

    signal.raise_signal(signal.SIGINT)  # as the terminal's SIGINT to the process group would reach it
    _child_start(setup_logging, "test")
    ready.send((READY, os.getpid()))


def test_a_ctrl_c_while_a_child_starts_reaches_only_the_supervisor():
    """The supervisor starts its children with SIGINT blocked; the child drops a Ctrl-C pending when it starts
    ignoring SIGINT (without the block, the child died of KeyboardInterrupt in the middle of its imports)."""
    import multiprocessing

    from gateway.workers import READY, _Child

    child = _Child(multiprocessing.get_context("spawn"), "test", _ctrl_c_while_starting, _no_logging, ())
    message = child.read_ready()
    child.process.join(30)
    assert (message, child.process.exitcode) == ((READY, child.process.pid), 0)
    assert not signal.pthread_sigmask(signal.SIG_BLOCK, [])  # the supervisor's mask is as it was


def _supervised_stubs(folder: Path) -> subprocess.Popen:
    """The supervisor over stub children (:mod:`tests.supervised_stubs`) steered by ``folder``, in its own process
    group, once it is ready."""
    with (folder / "stderr").open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "tests.supervised_stubs", str(folder)], cwd=Path(__file__).parent.parent,
                                stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True)
    line = proc.stdout.readline()  # blocks until ready (or exit)
    if line != "laps: ready on http://127.0.0.1:0\n":
        os.killpg(proc.pid, signal.SIGKILL)
    assert line == "laps: ready on http://127.0.0.1:0\n", (folder / "stderr").read_text()
    return proc


def _end_stubs(proc: subprocess.Popen, folder: Path) -> None:
    """SIGTERM to the supervisor of stubs: it ends at once, with exit code 0, quietly."""
    proc.terminate()
    assert proc.wait(timeout=60) == 0
    assert "Traceback" not in (folder / "stderr").read_text()


def _logged(log: Path, pattern: str, count: int = 1) -> list[str]:
    """The first group of each line of ``log`` that matches ``pattern``, once there are ``count`` such lines."""
    deadline = time.monotonic() + 30
    while len(found := re.findall(pattern, log.read_text(), re.MULTILINE)) < count:
        assert time.monotonic() < deadline, f"{pattern!r} logged {len(found)} times, not {count}:\n{log.read_text()}"
        time.sleep(0.02)
    return found


def test_the_supervisor_sees_deaths_during_a_restart_delay_and_starts_no_worker_while_the_scheduler_is_down(tmp_path):
    """Every child's exit is watched all the time: a worker's while the scheduler starts again, the scheduler's during
    a worker's restart delay (it used to be seen only once that delay was over, and the worker started meanwhile
    found no scheduler). A worker due while the scheduler is down starts once the scheduler is back."""
    log = tmp_path / "supervisor.log"
    proc = _supervised_stubs(tmp_path)
    try:
        [first] = _logged(log, r"scheduler process started \(pid (\d+)\)")
        [worker] = _logged(log, r"worker 0 started \(pid (\d+)\)")
        (tmp_path / "hold").touch()  # the scheduler started again waits for the hold to go before it is ready
        os.kill(int(first), signal.SIGKILL)
        second = _logged(log, r"scheduler process started \(pid (\d+)\)", count=2)[1]
        os.kill(int(worker), signal.SIGKILL)
        _logged(log, rf"^worker 0 \(pid {worker}\) exited with code -9 after [\d.]+ s; starting it again once the scheduler is up$")
        (tmp_path / "hold").unlink()
        [again] = _logged(log, r"worker-0 is ready \(pid (\d+)\)")
        text = log.read_text()
        assert text.index(f"the scheduler is back (pid {second})") < text.index(f"worker 0 started (pid {again})")
        os.kill(int(again), signal.SIGKILL)  # its second short life in a row: started again in 30 s
        _logged(log, rf"^worker 0 \(pid {again}\) exited with code -9 after [\d.]+ s; starting it again in 30 s$")
        os.kill(int(second), signal.SIGKILL)  # meanwhile
        _logged(log, rf"^the scheduler process \(pid {second}\) exited with code -9 after [\d.]+ s, its engines with it; starting it again in 30 s ")
        assert _logged(log, r"worker 0 started \(pid (\d+)\)") == [worker, again]
        _end_stubs(proc, tmp_path)  # a signal ends the delays
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("how", ["killed while it starts", "failed"])
def test_a_scheduler_that_does_not_start_again_is_started_again_later_and_the_gateway_stays_up(tmp_path, how):
    """Only the first start's failure ends the gateway: a scheduler killed again while its engines start (it used to
    end the gateway with exit code 1), or one whose engines do not come up, counts as one more short life."""
    from tests.supervised_stubs import FAILURE

    log = tmp_path / "supervisor.log"
    proc = _supervised_stubs(tmp_path)
    try:
        [first] = _logged(log, r"scheduler process started \(pid (\d+)\)")
        (tmp_path / ("hold" if how == "killed while it starts" else "fail")).touch()
        os.kill(int(first), signal.SIGKILL)  # its first short life: started again at once
        second = _logged(log, r"scheduler process started \(pid (\d+)\)", count=2)[1]
        if how == "killed while it starts":
            os.kill(int(second), signal.SIGKILL)
            code = -9
        else:
            _logged(log, rf"^the scheduler \(pid {second}\) did not start again: {re.escape(FAILURE)}$")
            code = 1
        _logged(log, rf"^the scheduler process \(pid {second}\) exited with code {code} after [\d.]+ s before it was ready, its "
                     "engines with it; starting it again in 30 s ")
        assert proc.poll() is None
        _end_stubs(proc, tmp_path)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_the_supervisor_sees_the_scheduler_die_while_a_process_it_started_lives_on(tmp_path):
    """The scheduler's engines inherit nothing that tells the supervisor the scheduler lives (uvloop closes no
    descriptor in the processes it starts): its death is seen at once, not once its last engine has exited."""
    from tests.supervised_stubs import LINGER_S

    log = tmp_path / "supervisor.log"
    (tmp_path / "linger").touch()
    proc = _supervised_stubs(tmp_path)
    lingerer = int((tmp_path / "lingerer.pid").read_text())
    try:
        (tmp_path / "linger").unlink()  # the scheduler started again leaves none
        [scheduler] = _logged(log, r"scheduler process started \(pid (\d+)\)")
        os.kill(int(scheduler), signal.SIGKILL)
        _logged(log, rf"^the scheduler process \(pid {scheduler}\) exited with code -9 ")
        assert Path(f"/proc/{lingerer}/stat").read_text().split()[2] == "S"  # still asleep, for LINGER_S
        assert LINGER_S > 30
        _end_stubs(proc, tmp_path)
    finally:
        os.kill(lingerer, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
