"""Fixtures for the tests that run real SGLang: its cached environment and a tiny model for it."""

from __future__ import annotations

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
