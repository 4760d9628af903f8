"""Fixtures for the shared-memory tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.shm.bigmodel import write_big_model


@pytest.fixture(scope="session")
def big_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_big_model(tmp_path_factory.mktemp("big") / "big-llama")


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from weightd.server.cli.demo import ensure_demo_checkpoint

    return Path(ensure_demo_checkpoint(str(tmp_path_factory.mktemp("demo"))))
