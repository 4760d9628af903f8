"""Log set-up and lifecycle events: one line per event, as text or as JSON lines.

An operator (or a log pipeline) should be able to follow a daemon's life from its log
alone: ``start``, ``listening``, ``verified`` per model, ``serving``, ``reload``,
``drain`` and ``exit`` each produce exactly one line carrying ``event=<name>`` and
its fields. Text lines put the fields as ``key=value`` pairs after the event name;
with ``--log-json`` every line (events and ordinary messages alike) is one JSON
object, so nothing needs a regular expression to be read.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Mapping
from typing import Any, Final, TextIO

from ..base.redact import redact

log = logging.getLogger("weightd")

#: The lifecycle events; :func:`event` refuses any other name so dashboards and
#: log queries can rely on this list.
EVENTS: Final = frozenset(
    {"start", "listening", "verified", "serving", "reload", "verify_failed", "drain", "exit"}
    | {"file_changed", "restore"}  # the file watcher (filewatch.py)
    | {"download"}  # remote sources (sources/resolver.py)
    | {"adapter"}  # adapter load/replace/unload/evict/refuse (adapters/service.py)
    # rank packs (transports/): built, asked for while building, declared layouts ready
    | {"pack_built", "pack_pending", "layouts_built"}
    | {"publish"}  # a trainer's new version (registry/publish.py)
)

#: Characters of one log message (an error quoting a multi-MiB answer stays readable).
MAX_MESSAGE_CHARS: Final = 8192
_CONTROLS: Final = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F)} | {
    0x0A: "\\n",
    0x0D: "\\r",
    0x09: "\\t",
    0x2028: "\\u2028",
    0x2029: "\\u2029",
    0x85: "\\x85",
}

_EVENT_ATTR: Final = "weightd_event"
_FIELDS_ATTR: Final = "weightd_fields"
_OURS_ATTR: Final = "weightd_cli_handler"


def one_line(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` as one line of at most ``limit`` characters (pure): line breaks and
    control characters escaped, URL passwords and credential parameters masked
    (:func:`~weightd.server.base.redact.redact`), the rest cut with a note. The last
    line of defence: strings from outside are escaped where they enter
    (``base.errors.echo``); this makes sure no message, whatever it quotes, can forge a
    second log line or fill a disk."""
    out = redact(text.translate(_CONTROLS))
    if len(out) > limit:
        out = f"{out[:limit]}... ({len(out) - limit} more characters)"
    return out


def format_value(value: Any) -> str:
    """A field value for a text line: bare when it is one plain token, else JSON-quoted."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.3f}"
    text = str(value)
    if text and all(c.isalnum() or c in "-_./:@[]," for c in text):
        return text
    return json.dumps(text)


def format_event(name: str, fields: Mapping[str, Any]) -> str:
    """``name key=value ...`` (pure, table-tested)."""
    parts = [name, *(f"{k}={format_value(v)}" for k, v in fields.items())]
    return " ".join(parts)


def event(name: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log one lifecycle event as exactly one line."""
    if name not in EVENTS:
        raise ValueError(f"unknown lifecycle event {name!r}; add it to logs.EVENTS")
    log.log(
        level,
        "%s",
        format_event(name, fields),
        extra={_EVENT_ATTR: name, _FIELDS_ATTR: dict(fields)},
    )


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``ts``, ``level``, ``logger``, ``msg`` and event fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
        }
        name = getattr(record, _EVENT_ATTR, None)
        if name is not None:
            out["event"] = name
            fields: dict[str, Any] = getattr(record, _FIELDS_ATTR, {})
            for key, value in fields.items():
                out.setdefault(key, _capped(value))
        out["msg"] = one_line(record.getMessage())
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def _capped(value: Any) -> Any:
    if isinstance(value, str) and len(value) > MAX_MESSAGE_CHARS:
        return one_line(value)
    return value


class TextFormatter(logging.Formatter):
    """The text format, every message one line (:func:`one_line`); a traceback, when a
    record carries one (a bug, logged as such), follows on its own lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = one_line(record.message)
        return super().formatMessage(record)


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at the time of each record.

    A handler that captured the stream object at set-up would keep writing to a
    replaced (and maybe closed) one when ``cli.main`` runs more than once in a process.
    """

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass


def setup_logging(
    level: str = "INFO", *, json_lines: bool = False, stream: TextIO | None = None
) -> None:
    """Configure the root logger for the CLI (text, or JSON lines with ``--log-json``).

    Replaces only a handler this function installed before, so calling it again (the
    CLI run in-process, as tests do) neither duplicates lines nor removes handlers that
    others attached.
    """
    handler: logging.Handler = (
        logging.StreamHandler(stream) if stream is not None else _StderrHandler()
    )
    setattr(handler, _OURS_ATTR, True)
    if json_lines:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, _OURS_ATTR, False):
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
