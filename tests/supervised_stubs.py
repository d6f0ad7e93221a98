"""Stand-ins for the gateway's scheduler and worker processes, so that the supervisor
(:class:`gateway.workers.Supervisor`) is tested in seconds, not with engines.

``python -m tests.supervised_stubs FOLDER`` runs the real supervisor over a stub scheduler and one stub worker as
``laps serve --workers 1`` would (``laps: ready on URL`` on stdout; its log in ``FOLDER/supervisor.log``), with every
life counted short and a child started again at once after its first short life in a row, 30 s after more
(:func:`_delay_s`). The stubs say they are ready and then sleep until a signal ends them; files in FOLDER steer them:

- ``hold``: while it exists, a stub scheduler that starts does not say it is ready;
- ``fail``: while it exists, a stub scheduler that starts says it failed (:data:`FAILURE`) and exits with code 1;
- ``linger``: a stub scheduler that starts, started as the real one (:func:`gateway.workers._child_start`), starts a
  process the way it starts its engines (uvloop, a session of its own, :func:`engines.manager.engine_preexec`) that
  ignores SIGTERM and sleeps :data:`LINGER_S`, and writes its pid to ``lingerer.pid``.

This module imports nothing heavy at its top: the spawned stubs import it (``gateway.workers`` takes a second).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

LINGER_S = 60
FAILURE = "an engine did not come up (stub)"


def _delay_s(short_lives: int) -> float:
    """The restart delay the supervisor waits here (:func:`gateway.workers.restart_delay_s`'s stand-in)."""
    return 0.0 if short_lives < 2 else 30.0


def _no_logging(label: str) -> None:
    """The children log nothing."""


def scheduler(ready, setup_logging, config, channel_path: str) -> None:
    """:func:`gateway.workers.scheduler_main`'s stand-in (module doc)."""
    import uvloop

    folder = Path(channel_path).parent
    if (folder / "linger").exists():
        from gateway.workers import _child_start

        _child_start(setup_logging, "scheduler")
    uvloop.run(_schedule(folder, ready))


async def _schedule(folder: Path, ready) -> None:
    if (folder / "linger").exists():
        from engines.manager import engine_preexec

        lingerer = await asyncio.create_subprocess_exec("sh", "-c", f"trap '' TERM; exec sleep {LINGER_S}", start_new_session=True,
                                                        preexec_fn=engine_preexec)
        (folder / "lingerer.pid").write_text(str(lingerer.pid))
    while (folder / "hold").exists():
        await asyncio.sleep(0.02)
    if (folder / "fail").exists():
        ready.send(("failed", FAILURE))  # gateway.workers.FAILED
        sys.exit(1)
    ready.send(("ready", os.getpid()))  # gateway.workers.READY
    await asyncio.Event().wait()


def worker(ready, setup_logging, config, channel_path: str, index: int) -> None:
    """:func:`gateway.workers.worker_main`'s stand-in (module doc)."""
    ready.send(("ready", os.getpid()))
    while True:
        time.sleep(3600)


def main(folder: Path) -> int:
    from gateway import workers

    logging.basicConfig(filename=folder / "supervisor.log", level=logging.INFO, format="%(message)s")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(folder)  # where the supervisor drops a dead child's gauges
    workers.scheduler_main, workers.worker_main = scheduler, worker
    workers.SHORT_LIFE_S, workers.restart_delay_s = math.inf, _delay_s
    config = SimpleNamespace(gateway=SimpleNamespace(workers=1, host="127.0.0.1", port=0, shutdown_grace_s=1.0))
    return workers.Supervisor(config, str(folder / "scheduler.sock"), _no_logging).run()


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
