"""Counts in messages, said as English says them ("1 shard", "2 shards"). Pure."""

from __future__ import annotations


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1 (``plural`` where ``noun + "s"`` is wrong)."""
    return f"{n} {noun if n == 1 else (plural or noun + 's')}"
