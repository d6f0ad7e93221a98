"""Engine processes: the command line of every engine kind, launch, wait until ready, restart with a role, stop.

:func:`engine_command` is the one place that builds command lines (real
SGLang or the simulated engine; ``external`` engines have none).
One :class:`EngineProcess` wraps one engine subprocess (start, wait_ready,
alive, stop); :class:`EngineManager` owns the fleet. Each
engine logs to its own file under ``config.log_dir``. Children get
``PR_SET_PDEATHSIG`` so that even a gateway killed with SIGKILL leaves no
orphan engines behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import random
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from engines.client import EngineClient
from engines.kv_events import KVEventsConfig, KVEventSource, loopback_publisher
from laps.config import Config, EngineConfig, FlagValue

if TYPE_CHECKING:
    from engines.sim.args import ResolvedSim

log = logging.getLogger("laps.engines")

_PR_SET_PDEATHSIG = 1
LOG_TAIL_MAX_BYTES = 1 << 16  # of an engine's log read for the tail of a failure message


def die_with_parent() -> None:
    """``preexec_fn`` for child processes: the kernel sends them SIGTERM when their parent dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: fall back to the manager's own shutdown
        pass


def leave_the_terminal() -> None:
    """``preexec_fn`` part for engine processes: put the child in a session of its own (if ``start_new_session`` has
    not yet), out of the terminal's foreground process group, which a Ctrl-C signals; and drop a SIGINT that reached
    it before it left. uvloop (libuv) forks with every signal blocked and unblocks them with default dispositions
    just before exec, after ``setsid()``: a Ctrl-C in between stays pending and kills the engine at its start
    (exit code -2). The gateway turns that Ctrl-C into an ordered stop of the engines instead."""
    if os.getsid(0) != os.getpid():
        os.setsid()
    signal.sigtimedwait((signal.SIGINT,), 0)  # a pending SIGINT is consumed; none: returns at once


def engine_preexec() -> None:
    """``preexec_fn`` of engine processes: :func:`leave_the_terminal`, then :func:`die_with_parent`."""
    leave_the_terminal()
    die_with_parent()


FREE_PORT_RANGE = (20000, 32767)  # below Linux's default ephemeral range (32768-60999)
_port_rng = random.Random()


def _ephemeral_ports() -> range:
    """The ports the OS hands out to outgoing connections (``ip_local_port_range``; Linux's default off Linux)."""
    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago, outside the OS's ephemeral range.

    An ephemeral port (what binding to port 0 gives) can be taken meanwhile as the local end of any
    outgoing connection, e.g. a readiness poll, while a slow engine (real SGLang takes a minute on
    CPU) has not bound it yet; a port outside that range can only be taken by another bind.

    Raises:
        OSError: no port of :data:`FREE_PORT_RANGE` outside the ephemeral range could be bound (200 tries).
    """
    ephemeral = _ephemeral_ports()
    candidates = [p for p in range(FREE_PORT_RANGE[0], FREE_PORT_RANGE[1] + 1) if p not in ephemeral]
    for port in _port_rng.sample(candidates, min(200, len(candidates))):
        if port_free(port, host):
            return port
    raise OSError(f"no free TCP port on {host} in {FREE_PORT_RANGE[0]}-{FREE_PORT_RANGE[1]} outside the ephemeral range")


def port_free(port: int, host: str = "127.0.0.1", as_server: bool = False) -> bool:
    """Whether a TCP socket could bind ``host``:``port`` just now; ``as_server``: bound as a server binds, with
    ``SO_REUSEADDR`` (the connections in TIME_WAIT of a server stopped there, which bound so too, do not count; a
    listening socket does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        if as_server:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def port_listeners(port: int) -> set[int] | None:
    """The process groups with a socket listening on TCP ``port`` (IPv4 or IPv6, any address), from ``/proc``;
    ``None`` where ``/proc`` does not tell (not Linux). Sockets of processes this user may not read are not seen.

    An engine runs in a session of its own (:meth:`EngineProcess.start`), so its process group id is its pid, that of
    every process it forks (SGLang's HTTP server is the engine's main process) included.
    """
    if not Path("/proc/net/tcp").exists():
        return None
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()  # sl local_address rem_address st ... inode: local "ADDR:PORT" in hex, st 0A = LISTEN
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    groups: set[int] = set()
    if not inodes:
        return groups
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if any(os.readlink(fd) in inodes for fd in fd_dir.iterdir()):
                groups.add(int((fd_dir.parent / "stat").read_text().rsplit(")", 1)[1].split()[2]))  # field 5: pgrp
    return groups


def configured_ports(config: Config) -> set[int]:
    """The TCP ports the configuration itself gives out on this machine: the gateway's, the engines' own, their KV bootstrap ports."""
    ports = {config.gateway.port}
    for engine in config.engines:
        if engine.kind == "external":
            continue
        if engine.port is not None:
            ports.add(engine.port)
        if config.pd is not None and (config.pool(engine) != "decode" or config.pd.role_switch):
            ports.add(config.bootstrap_port(engine))  # with role switch a decode engine binds its own too (engine_command)
    return ports


def free_ports(count: int, taken: set[int], host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct :func:`free_port` ports, none of them in ``taken`` (which they are added to).

    Raises:
        OSError: as :func:`free_port`, or no such ports after 100 tries.
    """
    ports: list[int] = []
    for _ in range(100):
        port = free_port(host)
        if port not in taken:
            taken.add(port)
            ports.append(port)
            if len(ports) == count:
                return ports
    raise OSError(f"no {count} free TCP ports on {host} clear of the configured ones")


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


def server_args(config: Config, engine: EngineConfig, port: int, role: str | None = None) -> list[str]:
    """The SGLang server arguments of ``engine`` with ``role``'s flags (default: its configured role).

    These are common to ``sglang`` and ``sim`` engines and spelled as SGLang
    0.5.23 spells them: model path and served name, host 127.0.0.1, ``port``,
    ``--tp-size`` (the number of the engine's GPUs, at least 1), metrics and
    cache reports on, the :func:`pd_args` of a PD deployment, then the role's flags.
    """
    model_path = str(config.model.path) if config.model.path else config.model.name
    return [
        "--model-path", model_path,
        "--served-model-name", config.model.name,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--tp-size", str(max(1, len(engine.gpus))),
        "--enable-metrics",
        "--enable-cache-report",
        *pd_args(config, engine, role),
        *flag_args(config.roles[role or engine.role].flags),
    ]


def pd_args(config: Config, engine: EngineConfig, role: str | None = None) -> list[str]:
    """SGLang's prefill-decode disaggregation flags of ``engine`` with ``role`` (default: its configured role).

    None without ``pd:``. A decode-pool role gives ``--disaggregation-mode
    decode``, any other ``prefill`` plus the engine's
    ``--disaggregation-bootstrap-port`` (:meth:`Config.bootstrap_port`: one
    port per prefill engine, so several can share a node); both sides get
    ``--disaggregation-transfer-backend`` from ``pd.transfer_backend``. With
    ``pd.role_switch`` every engine gets ``--enable-pd-role-switch`` and its
    bootstrap port, decode engines too (a flipped one serves KV from it).
    """
    if config.pd is None:
        return []
    mode = "decode" if config.roles[role or engine.role].pool == "decode" else "prefill"
    args = ["--disaggregation-mode", mode, "--disaggregation-transfer-backend", config.pd.transfer_backend]
    if mode == "prefill" or config.pd.role_switch:
        args += ["--disaggregation-bootstrap-port", str(config.bootstrap_port(engine))]
    if config.pd.role_switch:
        args.append("--enable-pd-role-switch")
    return args


def engine_command(config: Config, engine: EngineConfig, port: int, role: str | None = None,
                   kv_events: KVEventsConfig | None = None) -> list[str]:
    """The command line that starts ``engine`` on ``port`` with ``role``'s flags (default: its configured role).

    ``sglang``: ``python -m sglang.launch_server`` (``sglang.python``), the
    :func:`server_args`, ``--kv-events-config`` (JSON of ``kv_events``, when
    given), then ``sglang.extra_args``. ``sim``: ``python -m engines.sim`` with
    this interpreter, the :func:`server_args`, ``--kv-events-config``, then the
    :func:`sim_flags` (and, with ``pd:``, the KV link's bandwidth).

    Raises:
        ValueError: ``engine`` is ``external`` (laps starts no process for it).
    """
    args = server_args(config, engine, port, role)
    if kv_events is not None:
        args += ["--kv-events-config", kv_events.model_dump_json(exclude_defaults=True)]
    if engine.kind == "sglang":
        return [str(config.sglang.python or sys.executable), "-m", "sglang.launch_server", *args, *config.sglang.extra_args]
    if engine.kind == "sim":
        link = ["--sim-kv-link-gb-s", f"{config.pd.link_bytes_per_s / 1e9:g}"] if config.pd is not None else []
        return [sys.executable, "-m", "engines.sim", *args, *sim_flags(config, role or engine.role), *link]
    raise ValueError(f"engine {engine.name} is external (at {engine.url}): laps starts no process for it")


def sim_flags(config: Config, role: str) -> list[str]:
    """The simulated engine's flags from ``config.sim`` (model, GPU and, when set, the calibration file) and, where
    ``role`` has ``late_requests_last``, the objective the simulated plugin uses (:func:`late_last_objective`), and
    with ``deadline_order`` its threshold (:func:`deadline_order_above`), with ``short_pass`` too the short pass's
    budget, ``scheduling.short_threshold_tokens``, and with ``decode_turns`` their short requests' most new tokens
    (:func:`decode_turn_short_tokens`)."""
    flags = ["--sim-model", config.sim.model, "--sim-gpu", config.sim.gpu]
    if config.sim.calibration is not None:
        flags += ["--sim-calibration", str(config.sim.calibration)]
    objective = late_last_objective(config, role)
    if objective is not None:
        flags += ["--sim-late-last-ttft-s", f"{objective[0]:g}", "--sim-late-last-per-1k-s", f"{objective[1]:g}"]
    above = deadline_order_above(config, role)
    if above is not None:
        flags += ["--sim-late-last-deadline-order-above", str(above)]
    if above is not None and config.roles[role].short_pass:
        flags += ["--sim-short-pass-tokens", str(config.scheduling.short_threshold_tokens)]
    turns = decode_turn_short_tokens(config, role)
    if turns is not None:
        flags += ["--sim-decode-turn-short-tokens", str(turns)]
    return flags


# laps' SGLang plugin (engines/sglang_plugin/laps_sglang_plugin.py): SGLang finds it through the dist-info next to it
# on PYTHONPATH and reads its TTFT objective from these variables.
SGLANG_PLUGIN_DIR = Path(__file__).resolve().parent / "sglang_plugin"
PLUGIN_TTFT_ENV = "LAPS_TTFT_S"
PLUGIN_PER_1K_ENV = "LAPS_TTFT_PER_1K_NEW_TOKENS_S"
PLUGIN_DEADLINE_ORDER_ENV = "LAPS_DEADLINE_ORDER_ABOVE_TOKENS"
PLUGIN_PREFILL_RATE_ENV = "LAPS_PREFILL_S_PER_1K_TOKENS"
PLUGIN_SHORT_PASS_ENV = "LAPS_SHORT_PASS_TOKENS"
PLUGIN_DECODE_TURN_ENV = "LAPS_DECODE_TURN_SHORT_TOKENS"


def late_last_objective(config: Config, role: str) -> tuple[float, float] | None:
    """(TTFT objective in seconds, seconds more per 1,000 uncached prompt tokens) after which ``role``'s engines put a
    waiting request behind the others: ``slo.ttft_s`` and 0, the fixed objective (the deadline laps schedules to for
    every request that can meet it alone); None where the role does not set ``late_requests_last``.

    Not the length-aware objective where ``slo.ttft_per_1k_new_tokens_s`` is set: judged on it, a prompt of a few
    thousand tokens stays in time in the engine well past 0.4 s, and shorter ones then overtake it until it misses
    the fixed objective that it could have met (``bench/dominance.py``'s ``docs`` at 1.2× least_load's saturation
    load, seed 0: 8.98% violations of the fixed objective and 4.09% of the length-aware one, against 4.66% and
    3.42% with the fixed one here; README, Deadlines)."""
    if not config.roles[role].late_requests_last:
        return None
    return config.slo.ttft_s, 0.0


def _prefill_s_per_1k(config: Config, engine: EngineConfig, role: str | None) -> float | None:
    """The full-chunk prefill rate (seconds per 1,000 new tokens) of ``engine`` with ``role`` in the ``sim`` section's
    engine model, for the plugin's deadline order; None, with a warning, where that model cannot take the role's flags
    (a real engine then starts with late requests last but without the deadline order)."""
    try:
        return sim_model(config, engine, role).config.late_last_prefill_s_per_1k
    except ValueError as err:
        keys = "deadline_order (and short_pass)" if config.roles[role or engine.role].short_pass else "deadline_order"
        log.warning("engine %s: %s is off: its prefill rate comes from the sim section's engine model, which cannot "
                    "model this engine (%s)", engine.name, keys, err)
        return None


def deadline_order_above(config: Config, role: str) -> int | None:
    """New tokens above which the plugin puts ``role``'s requests in time in its deadline order (Moore's):
    ``scheduling.short_threshold_tokens`` − 1, so requests of fewer than the threshold keep their shortest-first place
    (the gateway's short class where no ``cost_model`` sets the boundary; the engine counts the tokens it must
    prefill, prompt and reply so far less its own cache, the gateway its estimate); None where the role does not set
    ``deadline_order``."""
    return _short_most_new_tokens(config) if config.roles[role].deadline_order else None


def decode_turn_short_tokens(config: Config, role: str) -> int | None:
    """The most new tokens of a request that keeps ``role``'s engines' owed decode passes (the plugin's decode turns):
    ``scheduling.short_threshold_tokens`` − 1, as for :func:`deadline_order_above`; None where the role does not set
    ``decode_turns``."""
    return _short_most_new_tokens(config) if config.roles[role].decode_turns else None


def _short_most_new_tokens(config: Config) -> int:
    """The most new tokens the plugin counts as short: one less than ``scheduling.short_threshold_tokens``, so requests
    of fewer than the threshold are short there, as in the gateway's class."""
    return config.scheduling.short_threshold_tokens - 1


def sim_model(config: Config, engine: EngineConfig, role: str | None = None) -> ResolvedSim:
    """The simulated engine model of ``engine`` started with ``role``'s flags (default: its configured role).

    Any kind is modelled on ``config.sim``'s model, GPU and calibration with the :func:`server_args`
    it would be started with (the virtual-time simulator models ``sglang`` and
    ``external`` engines this way too).

    Raises:
        ValueError: ``sim.calibration: <path>: <why>`` for a calibration file that cannot be used;
            ``roles.<role>.flags.<flag> (engine <name>): <why>`` naming the flag
            without which the command line would be accepted, else ``roles.<role>.flags (engine <name>): <why>``.
    """
    from engines.sim.args import parse_server_args, resolve_args
    from engines.sim.calibration_file import CalibrationError

    role = role or engine.role
    flags = config.roles[role].flags
    args = server_args(config, engine, 0, role)
    base, sim = args[:len(args) - len(flag_args(flags))], sim_flags(config, role)
    try:
        return resolve_args(parse_server_args([*base, *flag_args(flags), *sim]))
    except CalibrationError as err:
        if config.sim.calibration is not None:  # it wins over a role's own --sim-calibration
            raise ValueError(f"sim.calibration: {err}") from None
        error = err
    except ValueError as err:
        error = err
    for name in flags:  # the culprit: the one flag whose removal makes the rest acceptable
        try:
            resolve_args(parse_server_args([*base, *flag_args({k: v for k, v in flags.items() if k != name}), *sim]))
        except ValueError:
            continue
        raise ValueError(f"roles.{role}.flags.{name} (engine {engine.name}): {error}") from None
    raise ValueError(f"roles.{role}.flags (engine {engine.name}): {error}") from None


def sim_roles(config: Config, engine: EngineConfig) -> list[str]:
    """The roles ``engine`` may run with: its own, plus, with the controller on, the other prefill pool's role."""
    roles = [engine.role]
    pool = config.pool(engine)
    if config.controller.enabled and pool in ("short", "long") and engine.kind != "external":
        roles.append(config.controller.role_for("long" if pool == "short" else "short"))
    return roles


def check_sim_flags(config: Config, engine: EngineConfig) -> None:
    """Build a simulated engine's model for each of its :func:`sim_roles` here, so a bad role flag fails before any process starts.

    Raises:
        RuntimeError: as :func:`sim_model`'s ValueError (``roles.<role>.flags.<flag> ...``).
    """
    for role in sim_roles(config, engine):
        try:
            sim_model(config, engine, role)
        except ValueError as err:
            raise RuntimeError(str(err)) from None


def engine_env(config: Config, engine: EngineConfig, role: str | None = None) -> dict[str, str]:
    """Variables added to the gateway's environment for ``engine``'s process with ``role`` (default: its configured
    role).

    ``sglang.env`` for SGLang engines; where the role sets ``late_requests_last``, laps' SGLang plugin: its
    directory ahead of ``PYTHONPATH`` (``sglang.env``'s, else the gateway's) and its objective
    (:func:`late_last_objective`), and where it sets ``deadline_order`` too, that order's token threshold
    (:func:`deadline_order_above`) and the engine's full-chunk prefill rate in the ``sim`` section's engine model
    (none, with a warning, where that model cannot take the role's flags), and where it sets ``short_pass`` the short
    pass's budget (``scheduling.short_threshold_tokens``), and where it sets ``decode_turns`` their short requests'
    most new tokens (:func:`decode_turn_short_tokens`); then ``CUDA_VISIBLE_DEVICES`` from the
    engine's GPUs when it has any (it wins over ``sglang.env``).
    """
    env = dict(config.sglang.env) if engine.kind == "sglang" else {}
    objective = late_last_objective(config, role or engine.role) if engine.kind == "sglang" else None
    if objective is not None:
        path = env.get("PYTHONPATH", os.environ.get("PYTHONPATH"))
        env["PYTHONPATH"] = os.pathsep.join([str(SGLANG_PLUGIN_DIR), *([path] if path else [])])
        env[PLUGIN_TTFT_ENV], env[PLUGIN_PER_1K_ENV] = f"{objective[0]:g}", f"{objective[1]:g}"
        above = deadline_order_above(config, role or engine.role)
        rate = _prefill_s_per_1k(config, engine, role) if above is not None else None
        if rate is not None:
            env[PLUGIN_DEADLINE_ORDER_ENV], env[PLUGIN_PREFILL_RATE_ENV] = str(above), repr(rate)
            if config.roles[role or engine.role].short_pass:
                env[PLUGIN_SHORT_PASS_ENV] = str(config.scheduling.short_threshold_tokens)
        turns = decode_turn_short_tokens(config, role or engine.role)
        if turns is not None:
            env[PLUGIN_DECODE_TURN_ENV] = str(turns)
    if engine.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in engine.gpus)
    return env


@dataclass
class EngineProcess:
    """One engine subprocess, where it serves and the role it runs.

    The process leads its own process group, so stopping it also stops the
    helper processes it spawned (SGLang runs a scheduler and a detokenizer).
    """

    config: EngineConfig
    role: str
    command: list[str]
    env: dict[str, str]
    port: int
    log_path: Path
    kv_events: KVEventsConfig | None = None  # where it publishes its KV cache events (None: it does not)
    process: asyncio.subprocess.Process | None = field(default=None, repr=False)
    restarting: bool = False  # stopped on purpose by :meth:`EngineManager.restart`: not a crash
    log_offset: int = field(default=0, repr=False)  # where this start's section of :attr:`log_path` begins (bytes)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        """Spawn the process with :attr:`env` added, stdout and stderr appended to :attr:`log_path` after a
        ``=== <date> <time> starting as <role>: <command>`` line (where :attr:`log_offset` points), in a session of
        its own (:func:`engine_preexec`: a Ctrl-C at the gateway's terminal does not reach it). A real SGLang engine
        first waits for a previous run's process on its GPUs (:func:`await_predecessor`) and leaves a pid file while
        it runs."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        real = self.config.kind == "sglang"
        if real:
            await await_predecessor(self.config.name, self.log_path)
        with open(self.log_path, "ab") as logf:
            self.log_offset = logf.tell()
            logf.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting as {self.role}: {' '.join(self.command)}\n".encode())
            logf.flush()
            self.process = await asyncio.create_subprocess_exec(
                *self.command, stdout=logf, stderr=asyncio.subprocess.STDOUT, env={**os.environ, **self.env},
                start_new_session=True, preexec_fn=engine_preexec,
            )
        if real and (started := _start_time(self.process.pid)) is not None:
            _pid_file(self.log_path).write_text(f"{self.process.pid} {started}\n")
        log.info("engine %s: started pid %d on port %d as %s, log %s", self.config.name, self.process.pid, self.port, self.role, self.log_path)

    def alive(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def wait_ready(self, client: EngineClient, timeout_s: float) -> None:
        """Poll ``GET /ready`` until it answers 200 from the engine's own process: a process of its process group
        listens on its port (:func:`port_listeners`; a stale engine of an earlier run that took the port would
        answer too).

        Raises:
            RuntimeError: the process exited first, or ``timeout_s`` passed;
                the message carries the tail of the engine's log.
        """
        deadline = time.monotonic() + timeout_s
        stranger = False
        while time.monotonic() < deadline:
            if not self.alive():
                code = self.process.returncode if self.process is not None else "(stopped)"
                raise RuntimeError(f"engine {self.config.name} exited with code {code} before it was ready:\n{self.log_tail()}")
            if await client.ready(self.url) == "ready":
                owners = await asyncio.to_thread(port_listeners, self.port)  # reads /proc: off the event loop
                if owners is None or self.process.pid in owners:
                    return
                stranger = True
            await asyncio.sleep(0.1)
        another = f" (another process answers on port {self.port})" if stranger else ""
        raise RuntimeError(f"engine {self.config.name} not ready after {timeout_s:.0f} s{another}:\n{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the log of the process's latest start (from its ``=== ... starting`` line; the
        file keeps earlier runs' too); ``(no log)`` when the file cannot be read."""
        try:
            with open(self.log_path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                start = self.log_offset if size >= self.log_offset else 0  # smaller: cut or replaced since, all this run's
                f.seek(max(start, size - LOG_TAIL_MAX_BYTES))
                text = f.read().decode(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.strip("\n").splitlines()[-lines:])

    async def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM to the process group, wait up to ``timeout_s``, then SIGKILL; always reaps the process.

        Whatever is left of the group once the engine has exited is killed
        too. A second call does nothing.
        """
        process, self.process = self.process, None
        if process is None:
            return
        if process.returncode is None:
            _signal_group(process.pid, signal.SIGTERM)
            try:
                async with asyncio.timeout(timeout_s):
                    await process.wait()
            except TimeoutError:
                log.warning("engine %s: no exit %.0f s after SIGTERM, killing", self.config.name, timeout_s)
                _signal_group(process.pid, signal.SIGKILL)
                await process.wait()
            log.info("engine %s: stopped (exit code %s)", self.config.name, process.returncode)
        _signal_group(process.pid, signal.SIGKILL)
        _pid_file(self.log_path).unlink(missing_ok=True)


PREDECESSOR_WAIT_S = 75.0  # a real engine's drain after its gateway died (SGLang's and the sim's: up to ~60 s)


def _start_time(pid: int) -> str | None:
    """The kernel's start time of process ``pid`` (``/proc/PID/stat`` field 22, clock ticks since boot), which tells a
    process from a later one given the same pid; ``None`` when no such process runs: none by that pid, one that has
    exited and waits to be reaped (a zombie: its parent may never reap it), or not on Linux."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": field 3 (the state) is index 0
    return None if fields[0] in ("Z", "X") else fields[19]


def _pid_file(log_path: Path) -> Path:
    """Where an engine's process writes ``PID START_TIME`` while it runs: beside its log."""
    return log_path.with_suffix(".pid")


async def await_predecessor(name: str, log_path: Path, within_s: float = PREDECESSOR_WAIT_S) -> None:
    """Wait until the engine process of an earlier gateway run with the same log (its pid file, :func:`_pid_file`) has
    exited, at most ``within_s``, then kill its process group. A gateway (or a scheduler process) that died leaves its
    engines draining after the parent-death SIGTERM; on real GPUs an engine started on the same GPUs meanwhile finds
    their memory taken and fails. A pid file whose process is gone (or whose pid now names another process) is
    ignored."""
    try:
        pid_text, started = _pid_file(log_path).read_text().split()
        pid = int(pid_text)
    except (OSError, ValueError):
        return
    if _start_time(pid) != started:
        return
    log.warning("engine %s: its previous process (pid %d) still runs (draining after its gateway ended); waiting up to "
                "%.0f s for it to leave its GPUs", name, pid, within_s)
    deadline = time.monotonic() + within_s
    while _start_time(pid) == started and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    if _start_time(pid) == started:
        log.warning("engine %s: its previous process (pid %d) still runs after %.0f s; killing it", name, pid, within_s)
        _signal_group(pid, signal.SIGKILL)
        while _start_time(pid) == started:  # the kill is immediate; its reaping by init is not
            await asyncio.sleep(0.05)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # an empty group: nothing left to signal
        os.killpg(pgid, sig)


class EngineManager:
    """Owns the engine processes of a :class:`Config`: start them all, restart one with a role, stop them all.

    ``external`` engines get no process: they are only listed with their URL.
    """

    def __init__(self, config: Config, ready_timeout_s: float = 300.0) -> None:
        self.config = config
        self.ready_timeout_s = ready_timeout_s
        self.engines: dict[str, EngineProcess] = {}

    async def start(self, client: EngineClient) -> dict[str, str]:
        """Launch all local engines concurrently; once all are ready, return every engine's base URL by name.

        Raises:
            RuntimeError: an engine failed to become ready (all engines are stopped first),
                or a simulated engine's role has a flag the engine model does not take.
        """
        taken = configured_ports(self.config)
        for engine in self.config.engines:
            if engine.kind == "external":
                continue
            if engine.port is not None and not port_free(engine.port, as_server=True):
                raise RuntimeError(f"engine {engine.name}: port {engine.port} is already in use by another process (an "
                                   "engine left from an earlier run?); stop it or give this engine another port")
            if engine.kind == "sim":
                check_sim_flags(self.config, engine)
            port = engine.port or free_ports(1, taken)[0]
            kv_events = loopback_publisher(*free_ports(2, taken)) if self.config.publishes_kv_events(engine) else None
            self.engines[engine.name] = EngineProcess(
                engine, engine.role, engine_command(self.config, engine, port, kv_events=kv_events), engine_env(self.config, engine), port,
                self.config.log_dir / f"engine-{engine.name}.log", kv_events,
            )
        try:
            for e in self.engines.values():
                await e.start()
            await asyncio.gather(*(e.wait_ready(client, self.ready_timeout_s) for e in self.engines.values()))
        except BaseException:
            await self.stop()
            raise
        return {e.name: self.engines[e.name].url if e.name in self.engines else e.url for e in self.config.engines}

    async def restart(self, name: str, role: str, client: EngineClient) -> None:
        """Stop engine ``name``, start it again on the same port with ``role``'s flags, wait until it is ready.

        The caller stops routing to the engine first: requests still running
        on it when it stops fail.

        Raises:
            KeyError: ``name`` is not an engine laps runs (unknown or external).
            ValueError: ``role`` is not defined under ``roles``.
            RuntimeError: the restarted engine did not become ready.
        """
        if role not in self.config.roles:
            raise ValueError(f"role {role!r} is not defined under roles; allowed: {', '.join(sorted(self.config.roles))}")
        e = self.engines[name]
        e.restarting = True
        try:
            # the new command line first: a role it cannot be built for must not leave the engine stopped
            command = engine_command(self.config, e.config, e.port, role, e.kv_events)
            env = engine_env(self.config, e.config, role)
            await e.stop()
            e.role, e.command, e.env = role, command, env
            await e.start()
            await e.wait_ready(client, self.ready_timeout_s)
        finally:
            e.restarting = False

    async def stop(self) -> None:
        """Stop all engines concurrently (SIGTERM, then SIGKILL after a timeout)."""
        await asyncio.gather(*(e.stop() for e in self.engines.values()))


def kv_event_sources(config: Config, processes: dict[str, EngineProcess]) -> dict[str, KVEventSource]:
    """Where each engine the gateway follows (:meth:`laps.config.Config.publishes_kv_events`) publishes its KV cache
    events: ``processes``' own (those laps started), an ``external`` engine's configured endpoints; an engine laps
    was given the URL of is not followed."""
    sources = {}
    for engine in config.engines:
        if not config.publishes_kv_events(engine):
            continue
        if engine.kind == "external":
            assert engine.kv_events_endpoint is not None
            sources[engine.name] = KVEventSource(engine.kv_events_endpoint, engine.kv_events_replay_endpoint,
                                                 page_tokens=config.page_tokens(engine))
        elif engine.name in processes and processes[engine.name].kv_events is not None:
            published = processes[engine.name].kv_events
            sources[engine.name] = KVEventSource(published.endpoint, published.replay_endpoint, published.topic,
                                                 config.page_tokens(engine))
    return sources
