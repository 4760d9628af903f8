"""The layouts workers asked for, remembered across restarts in the cache directory.

Why: an operator may not declare every layout (``--layout``) a host serves; what the
workers asked for before a restart is the best forecast of what they will ask for
after it, so those packs are built at the next load, before SERVING, like declared
ones. One small JSON file per model under ``<cache-dir>/layouts/``, named by a hash
of the model's name (names are operator text, never a path).

The file is hostile input: another process may have written it, or a disk filled up
half-way. It is read with a byte bound, parsed strictly (no duplicate keys, no NaN),
every group validated (:meth:`LayoutGroup.from_json`), at most :data:`MAX_REMEMBERED`
kept; anything wrong is logged (escaped) and ignored, never fatal. Written atomically.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from typing import Any, Final

from ..base.atomicio import write_atomic
from ..base.errors import OutputWriteError, echo
from ..base.readfile import ReadRefused, read_bounded
from ..weights.layouts import LayoutGroup

log = logging.getLogger("weightd.layouts")

#: Layout groups remembered per model, most recently asked for first.
MAX_REMEMBERED: Final = 8
MAX_FILE_BYTES: Final = 64 << 10
VERSION: Final = 1


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r} appears twice")
        out[k] = v
    return out


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a number here")


def parse_memory(data: bytes, model: str) -> list[LayoutGroup]:
    """The groups a layouts file holds for ``model`` (pure); ValueError when malformed."""
    doc = json.loads(
        data.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_no_constants
    )
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        raise ValueError(f"not a version-{VERSION} layouts file")
    if doc.get("model") != model:
        raise ValueError(f"it is for model {echo(str(doc.get('model')))[:80]}")
    groups = doc.get("layouts")
    if not isinstance(groups, list):
        raise ValueError("'layouts' is not a list")
    out: list[LayoutGroup] = []
    for g in groups[:MAX_REMEMBERED]:
        group = LayoutGroup.from_json(g)
        if group not in out:
            out.append(group)
    return out


def render_memory(model: str, groups: list[LayoutGroup]) -> bytes:
    return json.dumps(
        {"version": VERSION, "model": model, "layouts": [g.to_json() for g in groups]}, indent=1
    ).encode()


class LayoutMemory:
    """Read and update the remembered layouts of each model under ``directory``."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._known: dict[str, list[LayoutGroup]] = {}

    def path(self, model: str) -> str:
        digest = hashlib.sha256(model.encode("utf-8", "surrogatepass")).hexdigest()[:32]
        return os.path.join(self.directory, f"{digest}.json")

    def read(self, model: str) -> list[LayoutGroup]:
        """What was remembered for ``model``; [] when nothing (or nothing valid) is."""
        path = self.path(model)
        try:
            data = read_bounded(path, MAX_FILE_BYTES, follow=False)
        except ReadRefused as exc:
            if os.path.lexists(path):
                log.warning("remembered layouts %s ignored: %s", path, exc.reason)
            return []
        try:
            groups = parse_memory(data, model)
        except (ValueError, UnicodeDecodeError) as exc:
            log.warning("remembered layouts %s ignored: %s", path, echo(str(exc))[:200])
            return []
        with self._lock:
            self._known[model] = list(groups)
        return groups

    def remember(self, model: str, group: LayoutGroup) -> None:
        """Put ``group`` first in ``model``'s file (written only when that changes it)."""
        with self._lock:
            known = self._known.get(model)
            if known is None:
                known = self._known[model] = []
            if known[:1] == [group]:
                return
            if group in known:
                known.remove(group)
            known.insert(0, group)
            del known[MAX_REMEMBERED:]
            data = render_memory(model, known)
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            write_atomic(self.path(model), data, mode=0o600)
        except (OSError, OutputWriteError) as exc:
            log.warning("could not remember layout %s of model %s: %s", group, echo(model), exc)
