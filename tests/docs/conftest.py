"""Fixtures for the documentation tests: the demo checkpoint, the generated pages."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def demo_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in demo checkpoint (a Llama with GQA, three shards), created once."""
    from weightd.server.cli.demo import ensure_demo_checkpoint

    return Path(ensure_demo_checkpoint(str(tmp_path_factory.mktemp("demo-cache"))))


@pytest.fixture(scope="session")
def generated_pages() -> dict[str, str]:
    """Every reference page docs/hooks.py adds to the site, rendered once."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from docs.refgen import pages

    return pages()
