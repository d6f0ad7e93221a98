"""A cached Python environment with real SGLang, for the tests that run it on CPU.

:func:`sglang_python` returns the interpreter of a virtual environment holding
``sglang==0.5.23`` (and the CUDA build of torch it pins, which runs on CPU
too), building it on first use with ``uv`` (a test dependency): about 35 s
and 10 GB on a machine with a fast link to PyPI, where ``pip`` takes 4–8
minutes. The environment lives under ``$XDG_CACHE_HOME/laps`` (default
``~/.cache/laps``) in a directory named by the pinned SGLang version and the
Python version, so all clones on a machine share it. A lock file keeps
concurrent test runs from building it twice, and a marker written last tells
a complete environment from an interrupted build, which is built again. Its
modules are then compiled to bytecode once (:func:`_compile`, ~5 minutes of CPU),
another marker saying so.
``LAPS_SGLANG_PYTHON=/path/to/bin/python`` uses an existing interpreter instead.

``python -m tests.sglang_env`` builds it and prints its interpreter (``make
test`` runs this first, so that the build's progress shows).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SGLANG_VERSION = "0.5.23"
OVERRIDE_ENV = "LAPS_SGLANG_PYTHON"
# Real SGLang on a machine without a GPU: random weights, a small KV pool (else it takes most of
# RAM), a fixed memory fraction (derived from a large chunked-prefill size it turns negative on
# CPU), no prefill CUDA graphs (a role may ask for them); after the role's flags, so these win.
CPU_SERVER_ARGS = [
    "--device", "cpu", "--load-format", "dummy", "--max-total-tokens", "65536", "--mem-fraction-static", "0.5",
    "--cuda-graph-backend-prefill", "disabled",
]
# On PYTHONPATH of SGLang on CPU: the one vLLM kernel it imports there (see engines/cpu_shims/README.md).
CPU_SHIMS_DIR = Path(__file__).resolve().parent.parent / "engines" / "cpu_shims"
_PARSE_SCRIPT = Path(__file__).resolve().parent / "sglang_parse_args.py"
_COMPLETE_MARKER = ".laps-complete"
_BYTECODE_MARKER = ".laps-bytecode"


def env_dir() -> Path:
    """Where the environment for this SGLang version and this Python version lives."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "laps" / f"sglang-{SGLANG_VERSION}-py{sys.version_info.major}.{sys.version_info.minor}"


def sglang_python() -> Path:
    """The interpreter of the SGLang environment, built first if there is none yet.

    Raises:
        RuntimeError: the build or the bytecode compilation failed; the message has the tail of its output.
    """
    override = os.environ.get(OVERRIDE_ENV)
    if override:
        return Path(override)
    directory = env_dir()
    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(directory.with_name(directory.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (directory / _COMPLETE_MARKER).exists():
            _build(directory)
        if not (directory / _BYTECODE_MARKER).exists():
            _compile(directory)
    return directory / "bin" / "python"


def _build(directory: Path) -> None:
    from uv import find_uv_bin

    uv = find_uv_bin()
    log_path = directory.with_name(directory.name + ".log")
    python = directory / "bin" / "python"
    steps = [
        [uv, "venv", "--quiet", "--python", sys.executable, str(directory)],
        [uv, "pip", "install", "--python", str(python), f"sglang=={SGLANG_VERSION}"],
        [str(python), "-c", "import sglang.srt.server_args"],  # the install is usable
    ]
    print(f"building the SGLang {SGLANG_VERSION} test environment in {directory} (log: {log_path})", file=sys.stderr, flush=True)
    shutil.rmtree(directory, ignore_errors=True)
    with open(log_path, "w") as log:
        for step in steps:
            print(f"  $ {' '.join(step)}", file=sys.stderr, flush=True)
            log.write(f"$ {' '.join(step)}\n")
            log.flush()
            done = subprocess.run(step, stdout=log, stderr=subprocess.STDOUT, preexec_fn=lambda: os.nice(10))
            if done.returncode != 0:
                tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
                raise RuntimeError(f"building the SGLang environment failed (exit {done.returncode}) at: {' '.join(step)}\n{tail}")
    (directory / _COMPLETE_MARKER).write_text(f"sglang=={SGLANG_VERSION}\n")


def _compile(directory: Path) -> None:
    """Compile every module of the environment to bytecode, once.

    ``uv pip install`` writes no ``.pyc`` files, and Python writes none when it imports under
    ``PYTHONDONTWRITEBYTECODE`` (set on CI machines): every SGLang process then compiled the sources it imports
    (SGLang's and torch's) afresh, about a minute per process on 2 cores and three processes per server start.
    A few files written for other Python versions do not compile; nothing imports them.
    """
    python = directory / "bin" / "python"
    where = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           capture_output=True, text=True)
    if where.returncode != 0:
        raise RuntimeError(f"the SGLang environment's interpreter failed (exit {where.returncode}): {where.stderr[-2000:]}")
    purelib = where.stdout.strip()
    print(f"compiling the SGLang test environment's modules to bytecode (once): {purelib}", file=sys.stderr, flush=True)
    done = subprocess.run([str(python), "-m", "compileall", "-q", "-j", "0", purelib], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, preexec_fn=lambda: os.nice(10))
    if done.returncode not in (0, 1):  # 1: some file did not compile (those above); else it did not run through
        raise RuntimeError(f"compiling the SGLang environment failed (exit {done.returncode}): {done.stderr[-2000:]}")
    (directory / _BYTECODE_MARKER).write_text("")


class SGLangParser:
    """One process of ``python`` (the SGLang environment's) running ``tests/sglang_parse_args.py``: it imports SGLang
    once (~20 s) and parses every list of command lines it is given. Call :meth:`close` when done."""

    def __init__(self, python: Path) -> None:
        self._stderr = tempfile.TemporaryFile()  # a file, not a pipe: SGLang's warnings must never fill it and block it
        self._process = subprocess.Popen([str(python), str(_PARSE_SCRIPT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=self._stderr, text=True)

    def errors(self, argvs: list[list[str]]) -> list[str | None]:
        """Parse each argument list with SGLang's own ``prepare_server_args``: per list, ``None`` when SGLang accepts it,
        else SGLang's error message (an unknown flag or a bad value).

        Raises:
            RuntimeError: the parsing process itself failed.
        """
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "errors.json"
            try:
                self._process.stdin.write(json.dumps({"argvs": argvs, "out": str(out)}) + "\n")
                self._process.stdin.flush()
            except BrokenPipeError:
                pass  # it died: said below
            for line in self._process.stdout:  # SGLang may print too: up to the script's line
                if line.rstrip("\n") == "laps-parse-done":  # sglang_parse_args.DONE (that module imports SGLang)
                    return json.loads(out.read_text())
            self._process.wait()
            self._stderr.seek(0)
            stderr = self._stderr.read().decode(errors="replace")
            raise RuntimeError(f"{_PARSE_SCRIPT.name} failed (exit {self._process.returncode}):\n{stderr[-3000:]}")

    def close(self) -> None:
        """End the process (the end of its stdin)."""
        self._process.stdin.close()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._stderr.close()


if __name__ == "__main__":
    print(sglang_python())
