"""Engine processes: launch each configured engine, wait until ready, stop them all.

One :class:`EngineProcess` wraps one engine subprocess (start, wait_ready,
alive, terminate, kill, wait); :class:`EngineManager` owns the fleet. Each
engine logs to its own file under ``config.log_dir``. Children get
``PR_SET_PDEATHSIG`` so that even a gateway killed with SIGKILL leaves no
orphan engines behind.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from laps.config import Config, EngineConfig, FlagValue

log = logging.getLogger("laps.engines")

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: fall back to the manager's own shutdown
        pass


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def flag_args(flags: dict[str, FlagValue]) -> list[str]:
    """SGLang-style command-line arguments for ``flags`` (names without ``--``).

    ``True`` gives a bare switch, ``False`` and ``None`` omit the flag, a list
    gives space-separated values: ``{"cuda-graph-bs-prefill": [16, 32]}`` ->
    ``["--cuda-graph-bs-prefill", "16", "32"]``.
    """
    args: list[str] = []
    for name, value in flags.items():
        if value is False or value is None:
            continue
        args.append(f"--{name}")
        if value is True:
            continue
        if isinstance(value, list):
            args.extend(str(v) for v in value)
        else:
            args.append(str(value))
    return args


def engine_command(config: Config, engine: EngineConfig, port: int) -> list[str]:
    """The command line that starts ``engine`` on ``port`` with its role's flags."""
    model_path = str(config.model.path) if config.model.path else config.model.name
    base = [
        sys.executable, "-m", "engines.sim",
        "--model-path", model_path,
        "--served-model-name", config.model.name,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--sim-model", config.sim.model,
        "--sim-gpu", config.sim.gpu,
        "--enable-metrics",
        "--enable-cache-report",
    ]
    return base + flag_args(config.roles[engine.role].flags)


@dataclass
class EngineProcess:
    """One engine subprocess and where it serves."""

    config: EngineConfig
    command: list[str]
    port: int
    log_path: Path
    process: asyncio.subprocess.Process | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        """Spawn the process, stdout and stderr appended to :attr:`log_path`."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as logf:
            logf.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(self.command)}\n".encode())
            logf.flush()
            self.process = await asyncio.create_subprocess_exec(
                *self.command, stdout=logf, stderr=asyncio.subprocess.STDOUT, preexec_fn=_die_with_parent
            )
        log.info("engine %s: started pid %d on port %d, log %s", self.config.name, self.process.pid, self.port, self.log_path)

    def alive(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def wait_ready(self, session: aiohttp.ClientSession, timeout_s: float) -> None:
        """Poll ``GET /ready`` until it answers 200.

        Raises:
            RuntimeError: the process exited first, or ``timeout_s`` passed;
                the message carries the tail of the engine's log.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"engine {self.config.name} exited with code {self.process.returncode} before it was ready:\n{self.log_tail()}")
            try:
                async with session.get(f"{self.url}/ready", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    if resp.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.1)
        raise RuntimeError(f"engine {self.config.name} not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    async def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL; always reaps the process."""
        if self.process is None or self.process.returncode is not None:
            return
        self.process.terminate()
        try:
            await asyncio.wait_for(self.process.wait(), timeout_s)
        except asyncio.TimeoutError:
            log.warning("engine %s: no exit %.0f s after SIGTERM, killing", self.config.name, timeout_s)
            self.process.kill()
            await self.process.wait()
        log.info("engine %s: stopped (exit code %s)", self.config.name, self.process.returncode)


class EngineManager:
    """Starts every engine of a :class:`Config`, waits for all to be ready, stops them all."""

    def __init__(self, config: Config, ready_timeout_s: float = 120.0) -> None:
        self.config = config
        self.ready_timeout_s = ready_timeout_s
        self.engines: list[EngineProcess] = []

    async def start(self, session: aiohttp.ClientSession) -> dict[str, str]:
        """Launch all engines concurrently; returns ``{engine name: base URL}`` once all are ready.

        Raises:
            RuntimeError: an engine failed to become ready (all engines are stopped first).
        """
        for engine in self.config.engines:
            port = engine.port or free_port()
            self.engines.append(
                EngineProcess(engine, engine_command(self.config, engine, port), port, self.config.log_dir / f"engine-{engine.name}.log")
            )
        try:
            for e in self.engines:
                await e.start()
            await asyncio.gather(*(e.wait_ready(session, self.ready_timeout_s) for e in self.engines))
        except BaseException:
            await self.stop()
            raise
        return {e.config.name: e.url for e in self.engines}

    async def stop(self) -> None:
        """Stop all engines concurrently (SIGTERM, then SIGKILL after a timeout)."""
        await asyncio.gather(*(e.stop() for e in self.engines))
