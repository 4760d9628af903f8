"""The resume journal: which objects a download pinned and which byte ranges of each
are already on disk (fsynced). Planning is pure; saving goes through ``write_atomic``.

A range is recorded only after its bytes were written and the file fdatasynced, and
the journal itself is replaced atomically, so after a crash (or a ``kill -9``) every
range the journal lists is really on disk, and at worst a few finished ranges are
fetched again. A journal that is unreadable, or pins other object versions than the
store has now, is discarded whole: nothing from another version is ever kept.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from ..base.atomicio import write_atomic
from ..base.readfile import ReadRefused, read_bounded
from .s3 import RemoteObject

FORMAT: Final = "weightd-download-journal"
VERSION: Final = 1
#: A journal larger than this is not one of ours (a model has tens of files).
MAX_JOURNAL_BYTES: Final = 64 << 20

Range = tuple[int, int]  # [start, end)


def plan_ranges(size: int, part_bytes: int) -> list[Range]:
    """``[0, size)`` cut into ranges of ``part_bytes`` (the last one shorter). Pure."""
    if part_bytes <= 0:
        raise ValueError("part_bytes must be positive")
    return [(start, min(start + part_bytes, size)) for start in range(0, size, part_bytes)]


def pin_of(obj: RemoteObject) -> dict[str, Any]:
    return {"key": obj.key, "size": obj.size, "etag": obj.etag, "version_id": obj.version_id}


@dataclass
class Journal:
    """Pins and finished ranges of one download (one version of one source)."""

    pins: dict[str, dict[str, Any]]
    part_bytes: int
    done: dict[str, set[Range]] = field(default_factory=dict)
    complete: set[str] = field(default_factory=set)

    @classmethod
    def start(cls, objects: Sequence[RemoteObject], part_bytes: int) -> Journal:
        return cls({o.name: pin_of(o) for o in objects}, part_bytes)

    def matches(self, objects: Sequence[RemoteObject]) -> bool:
        """True when this journal pinned exactly these object versions. (Its own range
        size goes on being used for them, whatever ``--s3-part-bytes`` says now.)"""
        return self.pins == {o.name: pin_of(o) for o in objects}

    def missing(self, obj: RemoteObject) -> list[Range]:
        """The ranges of ``obj`` still to fetch. Pure."""
        if obj.name in self.complete:
            return []
        have = self.done.get(obj.name, set())
        return [r for r in plan_ranges(obj.size, self.part_bytes) if r not in have]

    def done_bytes(self) -> int:
        total = 0
        for name, pin in self.pins.items():
            if name in self.complete:
                total += int(pin["size"])
            else:
                total += sum(b - a for a, b in self.done.get(name, set()))
        return total

    def to_json(self) -> bytes:
        body = {
            "format": FORMAT,
            "version": VERSION,
            "part_bytes": self.part_bytes,
            "pins": self.pins,
            "done": {n: sorted([a, b] for a, b in rs) for n, rs in sorted(self.done.items())},
            "complete": sorted(self.complete),
        }
        return json.dumps(body, sort_keys=True).encode()

    def save(self, path: str) -> None:
        write_atomic(path, self.to_json(), mode=0o600)


def parse_journal(raw: bytes) -> Journal | None:
    """A journal from its bytes; None for anything that is not a well-formed one (pure)."""
    try:
        body = json.loads(raw)
        if not isinstance(body, Mapping) or body.get("format") != FORMAT:
            return None
        if body.get("version") != VERSION:
            return None
        part = body["part_bytes"]
        pins = body["pins"]
        if not isinstance(part, int) or part <= 0 or not isinstance(pins, dict):
            return None
        done: dict[str, set[Range]] = {}
        for name, ranges in dict(body["done"]).items():
            if name not in pins:
                return None
            done[name] = {(int(a), int(b)) for a, b in ranges}
        complete = {str(n) for n in body["complete"]}
        if not complete <= pins.keys():
            return None
        return Journal(pins, part, done, complete)
    except (ValueError, KeyError, TypeError, RecursionError):  # nested too deep: not one
        return None


def load_journal(path: str) -> Journal | None:
    """The journal at ``path``, or None when there is none or it is not usable."""
    try:
        raw = read_bounded(path, MAX_JOURNAL_BYTES, private=True)
    except ReadRefused:
        return None
    return parse_journal(raw)
