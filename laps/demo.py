"""``laps demo``: the default deployment under the mixed real-chat workload, end to end.

Starts ``laps serve`` as a child process on a free port (:func:`serving`),
waits until the gateway reports a healthy engine, runs ``laps loadgen``
against it, and stops the gateway (which stops its engines) whatever happens.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from engines.manager import die_with_parent, free_port
from laps.config import load_config
from loadgen.cli import check_output_paths

log = logging.getLogger("laps.demo")

READY_TIMEOUT_S = 120.0
STDERR_TAIL_LINES = 10


def _tail(stream, lines: int) -> str:
    """The last ``lines`` lines of the binary file ``stream``, decoded."""
    stream.seek(0)
    return "\n".join(stream.read().decode(errors="replace").splitlines()[-lines:])


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the gateway exited with code {proc.returncode} during start-up")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the gateway was not healthy after {timeout_s:.0f} s")


@contextlib.contextmanager
def serving(config_path: Path) -> Iterator[str]:
    """``laps serve --config config_path`` in a child process on a free port; yields its URL once healthy.

    The gateway (and so its engines) is stopped on exit, whatever happens.

    Raises:
        RuntimeError: the gateway exited or was not healthy within ``READY_TIMEOUT_S``; the message names its log
            file and ends with the last ``STDERR_TAIL_LINES`` lines of its stderr (where a start-up error goes).
    """
    config = load_config(config_path)
    port = free_port(config.gateway.host)
    url = f"http://{config.gateway.host}:{port}"
    log.info("starting the gateway and %d engines on %s (logs in %s)", len(config.engines), url, config.log_dir)
    stderr = tempfile.TemporaryFile()
    proc = subprocess.Popen(
        [sys.executable, "-m", "laps.cli", "serve", "--config", str(config_path), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        preexec_fn=die_with_parent,
    )
    try:
        try:
            _wait_healthy(url, proc, READY_TIMEOUT_S)
        except RuntimeError as err:
            tail = _tail(stderr, STDERR_TAIL_LINES)
            raise RuntimeError(f"{err}; see {config.log_dir / 'gateway.log'}; its stderr ends with:\n{tail}") from None
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        stderr.close()
        log.info("gateway and engines stopped")


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo described in the module docstring; returns the load generator's exit code, 1 when the gateway did
    not start, 2 for an ``--out`` that cannot be written (refused as laps loadgen refuses it, before anything starts)."""
    from laps.cli import build_parser

    try:
        check_output_paths(args.out)
    except ValueError as err:
        print(f"laps demo: {err}", file=sys.stderr)
        return 2
    config = load_config(args.config)
    try:
        with serving(args.config) as url:
            log.info("gateway ready; sending the mixed real-chat workload at %.1f conversations/s for %.0f s", args.rate, args.duration)
            loadgen_args = build_parser().parse_args([
                "--log-level", args.log_level, "loadgen",
                "--url", url, "--dataset", "mixed", "--rate", str(args.rate), "--duration", str(args.duration),
                "--slo-ttft-s", str(config.slo.ttft_s), "--seed", str(args.seed), "--out", str(args.out),
            ])
            return loadgen_args.func(loadgen_args)
    except RuntimeError as err:
        log.error("%s", err)
        return 1
