"""One page states what is done (issue 48, point 1).

The README, the site's home page and three guides once each kept their own account of
what was finished, and they disagreed (a LoRA resolver "not yet" on two pages, done on
two others). Now the site's home page holds the only status table; every other page
that speaks of status links to it.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOME = ROOT / "docs" / "index.md"
_TABLE = re.compile(r"^\|\s*capability\s*\|\s*state\s*\|", re.MULTILINE | re.IGNORECASE)


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_the_status_table_is_on_the_home_page_only() -> None:
    having = [p.relative_to(ROOT).as_posix() for p in _pages() if _TABLE.search(p.read_text())]
    assert having == ["docs/index.md"]


def test_the_home_pages_table_has_a_row_for_each_capability_the_guides_describe() -> None:
    table = HOME.read_text().split("## Status", 1)[1].split("\n\n")[2]
    for capability in ("LoRAResolver", "weightd publish", "Model versions", "RL weight updates"):
        assert capability in table, capability
    for guide in ("vllm-lora.md", "rl-weight-updates.md", "vllm.md", "declared-layouts.md"):
        assert f"(guides/{guide})" in table, guide


def test_the_readme_and_the_guides_link_to_it() -> None:
    assert "](docs/index.md#status)" in (ROOT / "README.md").read_text()
    for guide in ("vllm.md", "adapters.md"):
        assert "](../index.md#status)" in (ROOT / "docs" / "guides" / guide).read_text(), guide


def test_no_page_says_the_lora_resolver_is_missing() -> None:
    """The contradiction that started this: the resolver is done (tests/vllm/test_vllm_lora.py)."""
    stale = re.compile(r"no (lora )?resolver|resolver yet|no `weightd` `LoRAResolver`", re.I)
    found = [p.name for p in _pages() if "notes" not in p.parts and stale.search(p.read_text())]
    assert found == []
