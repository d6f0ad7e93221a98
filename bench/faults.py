"""The fault suite: a laps gateway in front of simulated engines, each fault under a bounded load.

    python bench/faults.py --out runs/faults.json                  # every fault, ~3 minutes
    python bench/faults.py --quick --out runs/faults_quick.json    # smaller loads
    python bench/faults.py --faults kill9 sigstop --out runs/f.json

Each fault runs against a fresh ``laps serve`` (a subprocess, loopback) with
two simulated engines, sp0 and lp0, under ``scheduling.policy: least_load``
(so both engines carry load), while --requests chats (every fourth one not
streamed) run --concurrency at a time:

- ``kill9``: sp0 gets SIGKILL mid-load (laps restarts it);
- ``sigstop``: sp0 gets SIGSTOP for --stop-s seconds, then SIGCONT;
- ``error-mid-stream``, ``malformed``, ``truncated``, ``hang``, ``slow``:
  sp0 runs with ``--sim-fault`` (:mod:`engines.sim.faults`): an in-stream
  error event (HTTP 500 when not streamed), a non-JSON event, a dropped
  connection, a stream that stops (a stuck scheduler), passes 10x as long;
- ``drain``: sp0 is switched to another role through the admin API with a
  drain timeout (--drain-timeout-s) shorter than its streams;
- ``sigterm``: the gateway gets SIGTERM while long streams run
  (``gateway.shutdown_grace_s`` = --grace-s): they must end explicitly;
- ``conn1500``: --connections requests at once, each on its own connection.

Per fault it prints requests sent, ok, explicit errors (an OpenAI error body,
or an in-stream error event followed by ``[DONE]``), hung (no end
--hang-s seconds after the fault ended), silent (a stream cut with no error
and no ``[DONE]``, or a connection dropped), duplicated (a stream with two
first deltas, two finishes or two ``[DONE]``, or a JSON answer with two
choices), and whether the gateway still serves a request afterwards; --out
gets the same as JSON. The suite passes when hung, silent and duplicated are 0
everywhere and the gateway serves afterwards (exit code 1 otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import orjson
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engines.manager import free_port  # noqa: E402
from laps.config import DEFAULT_CONFIG_PATH, parse_config  # noqa: E402
from laps.doc_help import doc_parser  # noqa: E402

MODEL = "Qwen2.5-7B-Instruct"
ADMIN_KEY = "faults-admin-key"
FLAG_FAULTS = {"error-mid-stream": "error-mid-stream:3", "malformed": "malformed:3", "truncated": "truncated:3", "hang": "hang:3", "slow": "slow:10"}
FAULTS = ("kill9", "sigstop", *FLAG_FAULTS, "drain", "sigterm", "conn1500")
_PID_LINE = re.compile(r"engine (\S+): started pid (\d+) on port")


@dataclass
class Tally:
    """What the requests of one fault got (see the module docstring)."""

    sent: int = 0
    ok: int = 0
    errors: int = 0
    hung: int = 0
    silent: int = 0
    duplicated: int = 0
    error_codes: Counter = field(default_factory=Counter)

    def add(self, outcome: str, code: str | None = None) -> None:
        setattr(self, outcome, getattr(self, outcome) + 1)
        if outcome == "errors":
            self.error_codes[str(code)] += 1


def classify_stream(status: int, body: bytes) -> tuple[str, str | None]:
    """The outcome of a streamed request that got HTTP ``status`` and ``body``: (outcome, error code)."""
    if status != 200:
        return classify_json(status, body)
    events = [e for e in body.split(b"\n\n") if e.strip()]
    done = sum(e == b"data: [DONE]" for e in events)
    objs = []
    for e in events:
        if e.startswith(b"data: {"):
            with contextlib.suppress(orjson.JSONDecodeError):
                objs.append(orjson.loads(e[6:]))
    errors = [o["error"] for o in objs if isinstance(o.get("error"), dict)]
    firsts = sum(1 for o in objs for c in o.get("choices") or () if (c.get("delta") or {}).get("role"))
    finishes = sum(1 for o in objs for c in o.get("choices") or () if c.get("finish_reason"))
    if done > 1 or firsts > 1 or finishes > 1:
        return "duplicated", None
    if done == 0 or events[-1] != b"data: [DONE]":
        return "silent", None
    if errors:
        return "errors", errors[-1].get("code")
    return ("ok", None) if finishes == 1 else ("silent", None)


def classify_json(status: int, body: bytes) -> tuple[str, str | None]:
    """The outcome of a non-streamed request (or a refused stream) that got HTTP ``status`` and ``body``."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return "silent", None
    if status == 200:
        choices = obj.get("choices") or []
        return ("ok", None) if len(choices) == 1 else ("duplicated", None) if len(choices) > 1 else ("silent", None)
    error = obj.get("error") if isinstance(obj, dict) else None
    return ("errors", error.get("code") or f"http_{status}") if isinstance(error, dict) else ("silent", None)


async def one_request(session: aiohttp.ClientSession, url: str, i: int, stream: bool, max_tokens: int, timeout_s: float,
                      headers: dict | None = None) -> tuple[str, str | None]:
    """Send chat ``i`` and classify its answer; ``hung`` when it has not ended within ``timeout_s``."""
    payload = {"model": MODEL, "messages": [{"role": "user", "content": f"Question {i}: tell me about harbours."}],
               "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url + "/v1/chat/completions", json=payload, headers=headers) as resp:
                body = await resp.read()
                return (classify_stream if stream else classify_json)(resp.status, body)
    except TimeoutError:
        return "hung", None
    except (aiohttp.ClientError, ConnectionError):
        return "silent", None


def deployment(tmp: Path, port: int, fault: str, args: argparse.Namespace) -> Path:
    """The config file of one fault's gateway: the shipped roles, sp0 (faulty where a flag makes it) and lp0."""
    data = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    roles = data["roles"]
    roles["sp0-role"] = {"pool": "short", "flags": {**roles["short-prefill"]["flags"]}}
    roles["sp0-moved"] = {"pool": "short", "flags": {**roles["short-prefill"]["flags"], "max-running-requests": 200}}
    if fault in FLAG_FAULTS:
        roles["sp0-role"]["flags"]["sim-fault"] = FLAG_FAULTS[fault]
    data["gateway"] = {"host": "127.0.0.1", "port": port, "admin_key": ADMIN_KEY, "stall_timeout_s": args.stall_timeout_s,
                       "first_byte_timeout_s": args.first_byte_timeout_s, "shutdown_grace_s": args.grace_s}
    data["scheduling"] = {"policy": "least_load"}
    data["controller"] = {"enabled": False}
    data["engines"] = [{"name": "sp0", "kind": "sim", "role": "sp0-role", "gpus": [0]},
                       {"name": "lp0", "kind": "sim", "role": "long-prefill", "gpus": [1]}]
    data["log_dir"] = str(tmp / "logs")
    parse_config(data)  # fails here, not in the gateway, if the bench builds a bad file
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


class Gateway:
    """``laps serve`` of a config file in a subprocess (its stdout to a log file)."""

    def __init__(self, config_path: Path, port: int) -> None:
        self.config_path, self.url = config_path, f"http://127.0.0.1:{port}"
        self.log_dir = config_path.parent / "logs"
        self.process: asyncio.subprocess.Process | None = None

    async def start(self, timeout_s: float = 120.0) -> None:
        out = open(self.config_path.parent / "serve.out", "wb")
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "laps.cli", "serve", "--config", str(self.config_path), stdout=out, stderr=asyncio.subprocess.STDOUT,
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")})
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.returncode is not None:
                raise RuntimeError(f"laps serve exited with {self.process.returncode}: {(self.config_path.parent / 'serve.out').read_text()[-2000:]}")
            if b"laps: ready on" in (self.config_path.parent / "serve.out").read_bytes():
                return
            await asyncio.sleep(0.2)
        raise RuntimeError("laps serve did not get ready in time")

    def engine_pid(self, name: str) -> int:
        """The pid of engine ``name``'s latest start (from the gateway's log)."""
        pids = [int(m.group(2)) for m in _PID_LINE.finditer((self.log_dir / "gateway.log").read_text()) if m.group(1) == name]
        return pids[-1]

    async def stop(self, timeout_s: float = 60.0) -> int | None:
        if self.process is None or self.process.returncode is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return await asyncio.wait_for(self.process.wait(), timeout_s)
        except asyncio.TimeoutError:
            self.process.kill()
            return await self.process.wait()


async def serves(url: str) -> bool:
    """Whether the gateway answers a short chat with 200: of 4 at once (so that they spread over both engines, one
    of which may be faulty for good), a few tries (an engine may still be coming back)."""
    async with aiohttp.ClientSession() as session:
        for _ in range(20):
            outcomes = await asyncio.gather(*(one_request(session, url, -1 - k, stream=False, max_tokens=4, timeout_s=10) for k in range(4)))
            if any(outcome == "ok" for outcome, _ in outcomes):
                return True
            await asyncio.sleep(0.5)
    return False


async def run_fault(fault: str, args: argparse.Namespace) -> dict:
    """Run one fault (see the module docstring); its tally, timings and whether the gateway serves afterwards."""
    with contextlib.ExitStack() as stack:
        if args.logs is not None:
            tmp = args.logs / fault
            tmp.mkdir(parents=True, exist_ok=True)
        else:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"laps-fault-{fault}-"))
        port = free_port()
        gateway = Gateway(deployment(Path(tmp), port, fault, args), port)
        await gateway.start()
        tally = Tally()
        long_streams = fault in ("drain", "sigterm")
        requests = args.connections if fault == "conn1500" else args.requests
        concurrency = requests if fault in ("conn1500", "sigterm", "drain") else args.concurrency
        max_tokens = args.long_tokens if long_streams else args.max_tokens
        fault_end: list[float] = [time.monotonic() + 3600]
        gate = asyncio.Semaphore(concurrency)
        connector = aiohttp.TCPConnector(limit=0, force_close=fault == "conn1500")
        started = time.monotonic()
        async with aiohttp.ClientSession(connector=connector) as session:

            async def client(i: int) -> None:
                async with gate:
                    stream = fault == "sigterm" or fault == "drain" or i % 4 != 3
                    tally.sent += 1
                    # hung: no end --hang-s after the fault ended (the request's own run time is allowed on top)
                    budget_s = max(0.0, fault_end[0] - time.monotonic()) + args.hang_s + (60.0 if long_streams else 10.0)
                    outcome, code = await one_request(session, gateway.url, i, stream, max_tokens, budget_s)
                    tally.add(outcome, code)

            tasks = [asyncio.ensure_future(client(i)) for i in range(requests)]
            while tally.sent < min(requests, concurrency + requests // 3) and not all(t.done() for t in tasks):
                await asyncio.sleep(0.05)  # the fault strikes with requests in flight and more to come
            await asyncio.sleep(args.fault_at_s)
            fault_start = time.monotonic()
            await inject(fault, gateway, args)
            fault_end[0] = time.monotonic()
            await asyncio.gather(*tasks)
        took_s = time.monotonic() - started
        served_after = None if fault == "sigterm" else await serves(gateway.url)
        exit_code = await gateway.stop()
    result = {"fault": fault, **asdict(tally), "error_codes": dict(tally.error_codes), "served_after": served_after,
              "fault_s": round(fault_end[0] - fault_start, 2), "took_s": round(took_s, 1)}
    if fault == "sigterm":
        result["gateway_exit_code"] = exit_code
    return result


async def inject(fault: str, gateway: Gateway, args: argparse.Namespace) -> None:
    """Do ``fault`` to the running gateway or its engine sp0 (flag faults are already in sp0's flags)."""
    if fault == "kill9":
        os.kill(gateway.engine_pid("sp0"), signal.SIGKILL)
    elif fault == "sigstop":
        pid = gateway.engine_pid("sp0")
        os.kill(pid, signal.SIGSTOP)
        await asyncio.sleep(args.stop_s)
        os.kill(pid, signal.SIGCONT)
    elif fault == "drain":
        async with aiohttp.ClientSession() as session:
            body = {"role": "sp0-moved", "drain_timeout_s": args.drain_timeout_s}
            async with session.post(f"{gateway.url}/admin/engines/sp0/role", json=body, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as resp:
                assert resp.status == 202, await resp.text()
            for _ in range(600):  # until the switch is done
                async with session.get(f"{gateway.url}/admin/engines", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as resp:
                    if next(e for e in (await resp.json())["engines"] if e["id"] == "sp0")["state"] == "healthy":
                        break
                await asyncio.sleep(0.2)
    elif fault == "sigterm":
        gateway.process.send_signal(signal.SIGTERM)
        await gateway.process.wait()


def passed(result: dict) -> bool:
    """Nothing hung, went silent or came twice, and the gateway still serves (sigterm: it exited cleanly)."""
    still = result["gateway_exit_code"] == 0 if result["fault"] == "sigterm" else result["served_after"]
    return result["hung"] == 0 and result["silent"] == 0 and result["duplicated"] == 0 and bool(still)


def table(results: list[dict]) -> str:
    head = f"{'fault':<17}{'sent':>6}{'ok':>6}{'errors':>8}{'hung':>6}{'silent':>8}{'dup':>5}  {'after':<7}{'took s':>7}  error codes"
    lines = [head, "-" * len(head)]
    for r in results:
        after = ("exit 0" if r.get("gateway_exit_code") == 0 else f"exit {r.get('gateway_exit_code')}") if r["fault"] == "sigterm" else ("serves" if r["served_after"] else "DOWN")
        codes = ", ".join(f"{k} {v}" for k, v in sorted(r["error_codes"].items()))
        lines.append(f"{r['fault']:<17}{r['sent']:>6}{r['ok']:>6}{r['errors']:>8}{r['hung']:>6}{r['silent']:>8}{r['duplicated']:>5}  {after:<7}{r['took_s']:>7}  {codes}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = doc_parser(__doc__, prog="bench/faults.py")
    p.add_argument("--out", type=Path, required=True, help="where the JSON results go")
    p.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS), help="faults to run (default: all)")
    p.add_argument("--quick", action="store_true", help="smaller loads: 60 requests, 300 connections, 3 s SIGSTOP")
    p.add_argument("--requests", type=int, default=300, help="chats per fault (default 300)")
    p.add_argument("--concurrency", type=int, default=100, help="chats at once (default 100)")
    p.add_argument("--connections", type=int, default=1500, help="chats at once, one connection each, for conn1500 (default 1500)")
    p.add_argument("--max-tokens", type=int, default=256, help="reply tokens per chat (default 256)")
    p.add_argument("--long-tokens", type=int, default=4000, help="reply tokens of the long streams of drain and sigterm (default 4000)")
    p.add_argument("--fault-at-s", type=float, default=0.3,
                   help="the fault strikes this long after a third of the requests beyond the first --concurrency are sent (default 0.3)")
    p.add_argument("--stop-s", type=float, default=10.0, help="how long sigstop keeps sp0 stopped (default 10)")
    p.add_argument("--drain-timeout-s", type=float, default=0.5, help="drain timeout of the drain fault's role switch (default 0.5)")
    p.add_argument("--grace-s", type=float, default=1.0, help="gateway.shutdown_grace_s (default 1)")
    p.add_argument("--stall-timeout-s", type=float, default=5.0, help="gateway.stall_timeout_s (default 5)")
    p.add_argument("--first-byte-timeout-s", type=float, default=60.0, help="gateway.first_byte_timeout_s (default 60, the gateway's)")
    p.add_argument("--logs", type=Path, help="keep each fault's config, gateway and engine logs under DIR/FAULT (default: removed)")
    p.add_argument("--hang-s", type=float, default=60.0, help="a request with no end this long after its fault ended is hung (default 60)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.requests, args.concurrency, args.connections, args.stop_s = 60, 30, 300, 3.0
    results = []
    for fault in args.faults:
        result = asyncio.run(run_fault(fault, args))
        results.append(result)
        print(table([result]).splitlines()[-1], flush=True)
    print()
    print(f"laps fault suite on {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; stall_timeout_s={args.stall_timeout_s:g} "
          f"first_byte_timeout_s={args.first_byte_timeout_s:g} shutdown_grace_s={args.grace_s:g}")
    print(table(results))
    ok = all(passed(r) for r in results)
    print("PASS: nothing hung, went silent or came twice" if ok else "FAIL: see hung / silent / dup / after")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"setup": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "results": results,
                                    "passed": ok}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
