"""Fixtures for the tests that run real SGLang (its cached environment and a tiny model for it), and one that puts
the root logger back after every test."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from engines.tiny_model import write_tiny_qwen2_model
from tests import sglang_env


@pytest.fixture(scope="session")
def sglang_python() -> Path:
    """The interpreter of the cached SGLang 0.5.23 environment (built on first use; see ``tests/sglang_env.py``)."""
    return sglang_env.sglang_python()


@pytest.fixture(scope="session")
def sglang_parser(sglang_python: Path) -> Iterator[sglang_env.SGLangParser]:
    """SGLang's own command-line parser, in one process for the whole session (importing SGLang takes ~20 s)."""
    parser = sglang_env.SGLangParser(sglang_python)
    yield parser
    parser.close()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 model directory with the Qwen2.5 vocabulary and ChatML template (no weights)."""
    return write_tiny_qwen2_model(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(autouse=True)
def _root_logging_put_back() -> Iterator[None]:
    """A command run in-process (``laps simulate``, ``laps loadgen``: ``laps.cli._setup_logging``) logs to the stderr
    that pytest captures for that one test, and to a file; later tests' log lines would go to that closed stream
    ("--- Logging error ---", "ValueError: I/O operation on closed file"). Remove those handlers (plain stream and
    file handlers: pytest's own are subclasses) and restore the root level."""
    root = logging.getLogger()
    level = root.level
    yield
    for handler in [h for h in root.handlers if type(h) in (logging.StreamHandler, logging.FileHandler)]:
        root.removeHandler(handler)
        handler.close()
    root.setLevel(level)
