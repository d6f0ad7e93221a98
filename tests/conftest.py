"""Fixtures for the tests that run real SGLang: its cached environment and a tiny model for it."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.tiny_model import write_tiny_qwen2_model
from tests import sglang_env


@pytest.fixture(scope="session")
def sglang_python() -> Path:
    """The interpreter of the cached SGLang 0.5.23 environment (built on first use; see ``tests/sglang_env.py``)."""
    return sglang_env.sglang_python()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 model directory with the Qwen2.5 vocabulary and ChatML template (no weights)."""
    return write_tiny_qwen2_model(tmp_path_factory.mktemp("tiny-qwen2"))
