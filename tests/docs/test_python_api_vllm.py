"""The Python API page lists ``weightd.vllm`` by feature, and every name it lists exists.

The page is generated (``docs/refgen/api.py``); a name that moved or was renamed would
otherwise be a silent hole in it (mkdocstrings renders what it finds).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from docs.refgen import api

NAMES = [name for names in api.VLLM.values() for name in names]


@pytest.mark.parametrize("dotted", NAMES)
def test_every_listed_vllm_name_exists_and_has_a_docstring(dotted: str) -> None:
    """Read as mkdocstrings reads it, from the source: some of these subclass vLLM's own
    classes, and the docs build does not install vLLM."""
    module, _, attr = dotted.rpartition(".")
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"no module {module}"
    tree = ast.parse(Path(spec.origin).read_text())
    kinds = (ast.ClassDef, ast.FunctionDef)
    found = [n for n in tree.body if isinstance(n, kinds) and n.name == attr]
    assert found, f"{module} defines no {attr}"
    assert (ast.get_docstring(found[0]) or "").strip(), f"{dotted} has no docstring"


def test_the_page_lists_them_under_weightd_vllm() -> None:
    page = api.render()
    assert "## `weightd.vllm`" in page
    for dotted in NAMES:
        assert f"::: {dotted}\n" in page
    for name in ("Wanted", "Delivery", "AdapterWeights", "AdapterStatus", "Transport"):
        assert f"::: weightd.client.{name}\n" in page
