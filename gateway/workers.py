"""Several gateway processes on one node (``gateway.workers`` > 1, ``laps serve --workers N``).

The ``laps serve`` process becomes a supervisor of:

- one **scheduler** process: the whole gateway of :func:`gateway.app.create_app`
  (engines, registry and health, dispatcher and its policy, prefix caches and KV
  events, controller), serving no HTTP but the workers' calls on a Unix socket
  (:class:`gateway.sched_service.SchedulerService`);
- N **workers**: :func:`gateway.app.create_worker_app` on the gateway's port,
  each with its own ``SO_REUSEPORT`` listening socket (the kernel spreads
  connections over them), doing HTTP, validation, tokenization and relaying, and
  asking the scheduler for every decision (:mod:`gateway.sched_worker`).

The supervisor binds the port first without listening (a taken port fails before
any engine starts; with ``port: 0`` it picks the one the workers bind) and holds
an exclusive lock on it (:func:`port_lock`: ``SO_REUSEPORT`` alone would let a
second multi-worker gateway share the port and split the traffic), starts
the scheduler, waits for it (its engines ready), then the workers, then prints
``laps: ready on URL``. A worker that dies is started again (at once after a
life of :data:`SHORT_LIFE_S` or more, else after :func:`restart_delay_s`: 1 s,
doubled for each short life in a row, at most 30 s); the scheduler releases the
dead worker's requests when its channel drops; the other workers' requests go
on. A scheduler that dies takes its engines with it (they stop when their parent
dies: :func:`engines.manager.die_with_parent`): it is started again the same
way, with its engines, while the workers answer 503 ``scheduler_unavailable``
and their ``/health`` 503 ``unavailable``; the workers' channels connect to it
again as soon as it listens (:meth:`gateway.sched_channel.ChannelClient.connect`'s
``reconnect``), and they serve again once it reports its engines ready. A
scheduler that does not start again (killed while its engines start, or an engine
that does not come up) is started again the same way, as one more short life: the
gateway stays up, answering 503 meanwhile; only the first start's failure ends it
(exit code 1: the config or the machine is wrong). The
supervisor watches every child all the time, so a death during another's
restart delay is seen at once (the scheduler's too, while its engines still
stop: :func:`_keep_inherited_fds`), and it starts no worker while the scheduler
is down; a worker started just before the scheduler died tries its socket
again for up to :data:`gateway.sched_worker.CONNECT_WITHIN_S`.

Shutdown, on SIGINT or SIGTERM to the supervisor (the children ignore SIGINT, so a
Ctrl-C to the terminal's process group reaches them only this way): SIGTERM to
every worker, which drain as one gateway does (``gateway.shutdown_grace_s``,
:func:`gateway.app.serve_until`); then SIGTERM to the scheduler, which stops the
engines. A second signal kills every child at once and exits (code 130). A signal
before the gateway is ready ends the start-up the same way (the scheduler cancels
its engines' start and stops them) and exits with 128 + its number (130 for SIGINT).

Metrics: the supervisor points ``PROMETHEUS_MULTIPROC_DIR`` at a fresh directory
for its children (:mod:`gateway.metrics`), so any worker's ``/metrics`` reports
every process's counters; a dead worker's live gauges are dropped.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import multiprocessing
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection, wait
from pathlib import Path

from laps.config import Config

log = logging.getLogger("laps.gateway")

RESTART_DELAY_S = 1.0  # the delay before starting a child again after one short life; doubled for each more in a row
RESTART_DELAY_MAX_S = 30.0
SHORT_LIFE_S = 5.0  # a child that lived less died young: it is started again after a delay
SCHEDULER_STOP_S = 60.0  # the scheduler's own shutdown: stopping the engines
KILL_WAIT_S = 5.0
READY, FAILED = "ready", "failed"

LogSetup = Callable[[str], None]
"""Sets up a child's logging; its argument labels the process's lines (``scheduler``, ``worker-0`` ...). Picklable."""


def restart_delay_s(short_lives: int) -> float:
    """Seconds to wait before starting a child again after ``short_lives`` lives in a row shorter than
    :data:`SHORT_LIFE_S` (0: its last life was longer, so at once): :data:`RESTART_DELAY_S`, doubled for each more,
    at most :data:`RESTART_DELAY_MAX_S`."""
    return 0.0 if short_lives <= 0 else min(RESTART_DELAY_MAX_S, RESTART_DELAY_S * 2.0 ** (short_lives - 1))


# ---------------------------------------------------------------- the children

def _child_start(setup_logging: LogSetup, label: str) -> None:
    """Ignore SIGINT (the supervisor turns a Ctrl-C into an ordered SIGTERM), then unblock it: the child started with
    it blocked (:class:`_Child`), and a Ctrl-C that came meanwhile, pending, is dropped here instead of raising
    KeyboardInterrupt in the middle of the child's imports; keep what it inherited to itself
    (:func:`_keep_inherited_fds`); set up logging."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # discards a pending SIGINT
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _keep_inherited_fds()
    setup_logging(label)


def _keep_inherited_fds() -> None:
    """Make the file descriptors this child inherited (all but stdin, stdout and stderr) non-inheritable.

    multiprocessing passes them inheritable: the write end of the pipe whose closing tells the supervisor that this
    process ended (its ``sentinel``), the ready pipe, the resource tracker's. uvloop's ``create_subprocess_exec``,
    unlike :mod:`subprocess`, closes none in the new process, so every engine the scheduler starts held them: the
    supervisor saw the scheduler's death only once its last engine had exited. (Without ``/dev/fd``, not Linux or
    macOS: left as they are.)
    """
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir("/dev/fd"):
            if int(name) > 2:
                with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
                    os.set_inheritable(int(name), False)


def scheduler_main(ready: Connection, setup_logging: LogSetup, config: Config, channel_path: str) -> None:
    """The scheduler process (module doc): start the gateway and its engines, answer the workers until SIGTERM."""
    import uvloop

    _child_start(setup_logging, "scheduler")
    sys.exit(uvloop.run(_scheduler(config, channel_path, ready)))


async def _scheduler(config: Config, channel_path: str, ready: Connection) -> int:
    from gateway.admin import SWITCHES
    from gateway.app import StartInterrupted, app_runner, start_or_interrupt, stop_on_signals
    from gateway.sched_service import SchedulerService
    from gateway.state import GATEWAY

    stop = stop_on_signals((signal.SIGTERM,))
    runner = app_runner(config)
    try:
        await start_or_interrupt(runner, stop)
    except StartInterrupted:  # the supervisor stops the gateway while the engines start: they are stopped
        return 0
    except Exception as err:  # an engine that does not start: the supervisor reports it
        log.exception("scheduler: start-up failed")
        ready.send((FAILED, str(err)))
        await runner.cleanup()
        return 1
    service = SchedulerService(runner.app[GATEWAY], runner.app[SWITCHES])
    try:
        await service.start(channel_path)
        ready.send((READY, os.getpid()))
        await stop.wait()
        log.info("scheduler: shutting down")
    finally:
        await service.close()
        await runner.cleanup()
    return 0


def worker_main(ready: Connection, setup_logging: LogSetup, config: Config, channel_path: str, index: int) -> None:
    """Worker ``index`` (module doc): serve the gateway's port until SIGTERM, then drain."""
    import uvloop

    _child_start(setup_logging, f"worker-{index}")
    sys.exit(uvloop.run(_worker(config, channel_path, ready)))


async def _worker(config: Config, channel_path: str, ready: Connection) -> int:
    from gateway.app import StartInterrupted, app_runner, create_worker_app, listen_socket, serve_until, stop_on_signals

    stop = stop_on_signals((signal.SIGTERM,))
    sock = listen_socket(config.gateway.host, config.gateway.port, reuse_port=True, backlog=config.gateway.listen_backlog)
    with contextlib.suppress(StartInterrupted):  # stopped before it served: nothing to drain
        await serve_until(config, app_runner(config, create_worker_app(config, channel_path)), sock, stop,
                          lambda url: ready.send((READY, os.getpid())))
    return 0


# ---------------------------------------------------------------- the supervisor

class _Child:
    """One started child process, ``target(ready pipe, setup_logging, *args)``, and the read end of its ready pipe
    (``ready``, ``None`` once read; ``up`` once it said it is ready). The child starts with SIGINT blocked (the mask
    outlives exec) until its :func:`_child_start` ignores it: a Ctrl-C at the terminal while it starts reaches only
    the supervisor."""

    def __init__(self, ctx, label: str, target: Callable, setup_logging: LogSetup, args: tuple) -> None:
        reader, writer = ctx.Pipe(duplex=False)
        self.label = label
        self.process = ctx.Process(target=target, args=(writer, setup_logging, *args), name=f"laps-{label}", daemon=False)
        resource_tracker.ensure_running()  # starting its process unblocks SIGINT: before the block, not during start()
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self.process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)  # a Ctrl-C meanwhile reaches the supervisor now
        writer.close()
        self.ready: Connection | None = reader
        self.up = False
        self.started_s = time.monotonic()

    def read_ready(self) -> tuple[str, object] | None:
        """The child's ready message, ``None`` when it closed the pipe without one (it died)."""
        try:
            message = self.ready.recv()
        except EOFError:
            message = None
        self.ready.close()
        self.ready = None
        self.up = message is not None and message[0] == READY
        return message


class Supervisor:
    """Runs the scheduler and ``config.gateway.workers`` workers (module doc); :meth:`run` until a signal."""

    def __init__(self, config: Config, channel_path: str, setup_logging: LogSetup) -> None:
        self.config = config
        self.channel_path = channel_path
        self.setup_logging = setup_logging
        self._ctx = multiprocessing.get_context("spawn")
        self._signals = 0
        self._signum: int | None = None  # the first signal's
        self._wake_r, self._wake_w = socket.socketpair()  # the signal wake-up pipe (signal.set_wakeup_fd)
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.scheduler: _Child | None = None
        self.workers: list[_Child | None] = [None] * config.gateway.workers
        self._short_lives: dict[str, int] = {}  # by child label: lives in a row shorter than SHORT_LIFE_S

    def run(self) -> int:
        """Start everything, supervise, shut down on a signal; the exit code (0; 128 + the signal's number, 130 for
        SIGINT, when a signal came before the gateway was ready: the engines started are stopped).

        Raises:
            RuntimeError: the scheduler or a worker failed to start (the error is the message).
        """
        self._catch_signals()
        try:
            self.scheduler = self._start_scheduler()
            if not self._await_ready(self.scheduler):
                return self._interrupted()  # a signal while the engines started
            for i in range(len(self.workers)):
                self.workers[i] = self._start_worker(i)
            for worker in self.workers:
                if not self._await_ready(worker):
                    return self._interrupted()
            url = f"http://{self.config.gateway.host}:{self.config.gateway.port}"
            log.info("laps gateway listening on %s with %d workers (Ctrl-C to stop; twice to stop at once)", url, len(self.workers))
            print(f"laps: ready on {url}", flush=True)
            return self._supervise()
        finally:
            self._stop_all()

    def _catch_signals(self) -> None:
        signal.set_wakeup_fd(self._wake_w.fileno())

        def on_signal(signum, frame) -> None:
            self._signals += 1
            self._signum = self._signum or signum
            if self._signals > 1:
                log.warning("second signal: killing the gateway's processes now")
                for child in self._children():
                    child.process.kill()
                logging.shutdown()
                os._exit(130)

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)

    def _interrupted(self) -> int:
        """Log a signal during the start-up; the exit code it gives (128 + its number)."""
        log.info("interrupted during start-up (%s): stopping the engines started so far", signal.Signals(self._signum).name)
        return 128 + self._signum

    def _children(self) -> list[_Child]:
        return [c for c in (*self.workers, self.scheduler) if c is not None]

    def _start_scheduler(self) -> _Child:
        child = _Child(self._ctx, "scheduler", scheduler_main, self.setup_logging, (self.config, self.channel_path))
        log.info("scheduler process started (pid %d); starting the engines", child.process.pid)
        return child

    def _start_worker(self, index: int) -> _Child:
        child = _Child(self._ctx, f"worker-{index}", worker_main, self.setup_logging, (self.config, self.channel_path, index))
        log.info("worker %d started (pid %d)", index, child.process.pid)
        return child

    def _await_ready(self, child: _Child) -> bool:
        """Wait for ``child``'s ready message; ``False`` when a signal came first.

        Raises:
            RuntimeError: the child failed or died before it was ready.
        """
        while True:
            ready = wait([child.ready, self._wake_r])
            if self._signals:
                return False
            if child.ready in ready:
                _ready_pid(child)
                return True
            self._drain_wakeups()

    def _drain_wakeups(self) -> None:
        """Read the wake-up socket empty (non-blocking: it raises once nothing is left)."""
        with contextlib.suppress(BlockingIOError):
            while self._wake_r.recv(64):
                continue

    def _supervise(self) -> int:
        """Keep the children running until a signal (then 0). A child that exits is started again when it is due
        (:meth:`_exited`), a worker only while the scheduler is up (ready; the workers connected reconnect to a new
        one by themselves). Meanwhile every child's exit and ready message and the signal are watched: a death during
        another child's restart delay, or while the scheduler starts again, is seen at once.
        """
        due: dict[int | None, float] = {}  # when (time.monotonic()) each child to start again is due, by worker index (None: the scheduler)
        while not self._signals:
            up = self._scheduler_up()
            now = time.monotonic()
            for index in [i for i, at in due.items() if at <= now and (i is None or up)]:
                del due[index]
                if index is None:
                    self.scheduler = self._start_scheduler()
                else:
                    self.workers[index] = self._start_worker(index)
            waits = [at for i, at in due.items() if i is None or up]
            exits = {w.process.sentinel: i for i, w in enumerate(self.workers) if w is not None}
            if self.scheduler is not None:
                exits[self.scheduler.process.sentinel] = None
            pipes = {c.ready: c for c in self._children() if c.ready is not None}
            ready = wait([*pipes, *exits, self._wake_r], max(0.0, min(waits) - time.monotonic()) if waits else None)
            self._drain_wakeups()
            if self._signals:
                break
            for pipe in ready:  # before the exits: a child that said it is ready and died is one that started
                if pipe in pipes:
                    self._took_ready(pipes[pipe])
            for sentinel in ready:
                if sentinel in exits:
                    index = exits[sentinel]
                    due[index] = self._scheduler_exited() if index is None else self._worker_exited(index)
        return 0

    def _scheduler_up(self) -> bool:
        """Whether the scheduler runs and has said it is ready."""
        return self.scheduler is not None and self.scheduler.up

    def _took_ready(self, child: _Child) -> None:
        """Read the ready pipe of a child started again (it is readable) and log what it says (a failure: its exit,
        seen next, starts it again)."""
        message = child.read_ready()
        if child.up:
            log.info("the scheduler is back (pid %d); the workers reconnect to it" if child is self.scheduler else
                     f"{child.label} is ready (pid %d)", message[1])
        elif message is not None:
            log.error("the %s (pid %d) did not start again: %s", child.label, child.process.pid, message[1])

    def _worker_exited(self, index: int) -> float:
        """Worker ``index`` exited: reap it, log it; when it is due to start again (:meth:`_exited`)."""
        worker, self.workers[index] = self.workers[index], None
        return self._exited(worker, "worker %d (pid %d) exited with code %s after %.1f s%s; starting it again%s", index, worker.process.pid,
                            after="" if self._scheduler_up() else " once the scheduler is up")

    def _scheduler_exited(self) -> float:
        """The scheduler exited (its engines with it): reap it, log it; when it is due to start again (:meth:`_exited`;
        one that never said it was ready counts as a short life)."""
        dead = self.scheduler
        if dead.ready is not None:  # its exit came before its ready pipe's end: what the pipe says
            self._took_ready(dead)
        self.scheduler = None
        return self._exited(dead, "the scheduler process (pid %d) exited with code %s after %.1f s%s, its engines with it; starting "
                                  "it again%s (until it is ready the workers answer 503 scheduler_unavailable)", dead.process.pid,
                            level=logging.ERROR)

    def _exited(self, child: _Child, message: str, *args, level: int = logging.WARNING, after: str = "") -> float:
        """Reap the exited ``child`` and log ``message`` (its ``args``, then the exit code, the life's length, whether it
        had started and when it starts again: after :func:`restart_delay_s` of its short lives in a row, lives shorter
        than :data:`SHORT_LIFE_S` or that never started, then ``after``); when it is due to start again
        (``time.monotonic()``)."""
        lived_s = _bury(child)
        short = lived_s < SHORT_LIFE_S or not child.up
        lives = self._short_lives[child.label] = self._short_lives.get(child.label, 0) + 1 if short else 0
        delay_s = restart_delay_s(lives)
        log.log(level, message, *args, child.process.exitcode, lived_s, "" if child.up else " before it was ready",
                (f" in {delay_s:.0f} s" if delay_s else "") + after)
        return time.monotonic() + delay_s

    def _stop_all(self) -> None:
        """SIGTERM the workers and wait for them to drain, then the scheduler; kill what outlives its time."""
        grace_s = self.config.gateway.shutdown_grace_s + 10.0  # their drain, the end of the requests left, the clean-up
        workers = [w for w in self.workers if w is not None]
        if workers:
            log.info("shutting down: %d workers drain (up to %.0f s)", len(workers), self.config.gateway.shutdown_grace_s)
        _terminate(workers, grace_s)
        if self.scheduler is not None:
            _terminate([self.scheduler], SCHEDULER_STOP_S)
        signal.set_wakeup_fd(-1)
        self._wake_r.close()
        self._wake_w.close()


def _ready_pid(child: _Child) -> object:
    """Read ``child``'s ready message (its pipe is readable); the pid it sent.

    Raises:
        RuntimeError: the child failed or died before it was ready.
    """
    message = child.read_ready()
    if message is None or message[0] != READY:
        child.process.join()
        why = message[1] if message is not None else f"it exited with code {child.process.exitcode}"
        raise RuntimeError(f"the gateway's {child.label} did not start: {why}")
    return message[1]


def _bury(child: _Child) -> float:
    """Reap a child that exited (its ready pipe closed, its metrics' live gauges dropped); how long it lived (s)."""
    from prometheus_client import multiprocess

    child.process.join()
    if child.ready is not None:
        child.ready.close()
        child.ready = None
    multiprocess.mark_process_dead(child.process.pid)
    return time.monotonic() - child.started_s


def _terminate(children: list[_Child], within_s: float) -> None:
    for child in children:
        if child.process.is_alive():
            child.process.terminate()
    deadline = time.monotonic() + within_s
    for child in children:
        child.process.join(max(0.0, deadline - time.monotonic()))
        if child.process.is_alive():
            log.warning("%s (pid %d) did not stop within %.0f s; killing it", child.label, child.process.pid, within_s)
            child.process.kill()
            child.process.join(KILL_WAIT_S)


@contextlib.contextmanager
def port_lock(port: int) -> Iterator[None]:
    """Hold an exclusive lock on TCP ``port`` for this process (a file in the temp directory, ``flock``: the lock goes
    with the process, however it ends); the file is removed when the holder lets go.

    A contender that opened the file just before the holder removed it locks a file no longer on disk; it sees that
    (the path names another file, or none) and tries again on the path's new file.

    Raises:
        OSError: (EADDRINUSE) another multi-worker laps gateway holds it.
    """
    path = Path(tempfile.gettempdir(), f"laps-gateway-port-{port}.lock")
    while True:
        f = open(path, "a")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise OSError(errno.EADDRINUSE, f"port {port} is already served by another laps gateway with workers") from None
        try:
            held_on_disk = os.path.samestat(os.fstat(f.fileno()), os.stat(path))
        except FileNotFoundError:
            held_on_disk = False
        if held_on_disk:
            break
        f.close()
    try:
        yield
    finally:
        path.unlink(missing_ok=True)  # before the lock goes, so that no one locks the file being removed
        f.close()


def serve_workers(config: Config, setup_logging: LogSetup) -> int:
    """Run the gateway as a scheduler and ``config.gateway.workers`` workers (module doc) until SIGINT/SIGTERM;
    the exit code.

    Raises:
        OSError: the gateway's port is taken.
        RuntimeError: the scheduler (its engines) or a worker failed to start.
    """
    from gateway.app import listen_socket

    with tempfile.TemporaryDirectory(prefix="laps-gateway-") as tmp, \
            listen_socket(config.gateway.host, config.gateway.port, reuse_port=True, listen=False) as reserved, \
            port_lock(reserved.getsockname()[1]):
        port = reserved.getsockname()[1]
        config = config.model_copy(update={"gateway": config.gateway.model_copy(update={"port": port})})
        metrics_dir = Path(tmp, "metrics")
        metrics_dir.mkdir()
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)  # inherited by the children (spawned after this)
        try:
            return Supervisor(config, str(Path(tmp, "scheduler.sock")), setup_logging).run()
        finally:
            del os.environ["PROMETHEUS_MULTIPROC_DIR"]
