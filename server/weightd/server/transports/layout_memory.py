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

Any worker's ask is remembered, so what is remembered is bounded three ways: the
file keeps :data:`MAX_REMEMBERED` groups, a load builds at most
``local.max_remembered_layouts`` of them (:mod:`.prebuild`), and a group no worker
asked for within ``local.forget_layouts_after`` seconds is forgotten (each group's
last ask is kept beside it, refreshed at most every :data:`REFRESH_SECONDS`): a
mistaken ``weightd fetch --world-size 4`` is not rebuilt at every start forever.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Final

from ..base.atomicio import write_atomic
from ..base.errors import OutputWriteError, echo
from ..base.readfile import ReadRefused, read_bounded
from ..plan.declared import LayoutGroup

log = logging.getLogger("weightd.layouts")

#: Layout groups remembered per model, most recently asked for first.
MAX_REMEMBERED: Final = 8
MAX_FILE_BYTES: Final = 64 << 10
VERSION: Final = 1
#: A group's last ask is written again once it is this old (not at every ask).
REFRESH_SECONDS: Final = 3600.0


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
    return [group for group, _ in parse_asked(data, model)]


def parse_asked(data: bytes, model: str) -> list[tuple[LayoutGroup, float | None]]:
    """Each group with when it was last asked for (None: the file does not say; a file
    from before the field), most recent first (pure); ValueError when malformed."""
    try:
        doc = json.loads(
            data.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_no_constants
        )
    except RecursionError:  # the parser recurses once per nested list or object
        raise ValueError("lists or objects nested too deep") from None
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        raise ValueError(f"not a version-{VERSION} layouts file")
    if doc.get("model") != model:
        raise ValueError(f"it is for model {echo(str(doc.get('model')))[:80]}")
    groups = doc.get("layouts")
    if not isinstance(groups, list):
        raise ValueError("'layouts' is not a list")
    asked = doc.get("asked", [None] * len(groups))
    if not isinstance(asked, list) or len(asked) != len(groups):
        raise ValueError("'asked' is not a list as long as 'layouts'")
    out: list[tuple[LayoutGroup, float | None]] = []
    for g, when in zip(groups[:MAX_REMEMBERED], asked[:MAX_REMEMBERED], strict=True):
        if when is not None and (isinstance(when, bool) or not isinstance(when, int | float)):
            raise ValueError(f"'asked' holds {str(when)[:40]!r}, not a time")
        group = LayoutGroup.from_json(g)
        if all(group != have for have, _ in out):
            out.append((group, None if when is None else float(when)))
    return out


def render_memory(
    model: str, groups: list[LayoutGroup], asked: list[float | None] | None = None
) -> bytes:
    doc: dict[str, Any] = {
        "version": VERSION,
        "model": model,
        "layouts": [g.to_json() for g in groups],
    }
    if asked is not None:
        doc["asked"] = asked
    return json.dumps(doc, indent=1).encode()


class LayoutMemory:
    """Read and update the remembered layouts of each model under ``directory``."""

    def __init__(
        self,
        directory: str,
        forget_after: float = 0.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.directory = directory
        #: Seconds after its last ask a group is forgotten (0: never).
        self.forget_after = forget_after
        self._clock = clock
        self._lock = threading.Lock()
        self._known: dict[str, list[tuple[LayoutGroup, float | None]]] = {}

    def path(self, model: str) -> str:
        digest = hashlib.sha256(model.encode("utf-8", "surrogatepass")).hexdigest()[:32]
        return os.path.join(self.directory, f"{digest}.json")

    def read(self, model: str) -> list[LayoutGroup]:
        """What is remembered for ``model`` and was asked for recently enough; [] when
        nothing (or nothing valid) is."""
        path = self.path(model)
        try:
            data = read_bounded(path, MAX_FILE_BYTES, private=True)
        except ReadRefused as exc:
            if os.path.lexists(path):
                log.warning("remembered layouts %s ignored: %s", path, exc.reason)
            return []
        try:
            entries = parse_asked(data, model)
        except (ValueError, UnicodeDecodeError) as exc:
            log.warning("remembered layouts %s ignored: %s", path, echo(str(exc))[:200])
            return []
        now = self._clock()
        fresh = [(g, now if when is None else when) for g, when in entries]
        if self.forget_after > 0:
            for group, when in fresh:
                if now - when > self.forget_after:
                    log.info(
                        "remembered layout %s of model %s forgotten: no worker asked for it "
                        "in %.0f s",
                        group,
                        echo(model),
                        now - when,
                    )
            fresh = [(g, when) for g, when in fresh if now - when <= self.forget_after]
        with self._lock:
            self._known[model] = list(fresh)
        return [g for g, _ in fresh]

    def remember(self, model: str, group: LayoutGroup) -> None:
        """Put ``group`` first in ``model``'s file, asked now (written only when that
        changes the order, or its last ask written is :data:`REFRESH_SECONDS` old)."""
        now = self._clock()
        with self._lock:
            known = self._known.setdefault(model, [])
            if known[:1] and known[0][0] == group:
                when = known[0][1]
                if when is not None and now - when < REFRESH_SECONDS:
                    return
            known[:] = [(g, w) for g, w in known if g != group]
            known.insert(0, (group, now))
            del known[MAX_REMEMBERED:]
            data = render_memory(model, [g for g, _ in known], [w for _, w in known])
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            write_atomic(self.path(model), data, mode=0o600)
        except (OSError, OutputWriteError) as exc:
            log.warning("could not remember layout %s of model %s: %s", group, echo(model), exc)
