"""Fixtures of the reliability suite; the adapter fixtures are the adapter suite's own."""

from __future__ import annotations

from tests.adapters.conftest import lora

__all__ = ["lora"]
