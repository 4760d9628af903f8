"""Strings from outside never forge a log line nor write a huge one (issue 37, case 7).

``base.errors.echo`` escapes and cuts each string where it enters (a store's error
code, a key, a client's field); the log formatters make sure of it for every record.
"""

from __future__ import annotations

import io
import json
import logging

import pytest

from weightd.server.base.errors import ECHO_CHARS, echo
from weightd.server.telemetry.logs import MAX_MESSAGE_CHARS, one_line, setup_logging

FORGED = "Evil\n2026-12-07 05:00:00,000 INFO weightd: serving models=forged\r\x1b[2K\u2028x"


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("NoSuchKey", "'NoSuchKey'"),
        ("a\nb", "'a\\nb'"),
        ("\u202egnp.exe", "'\\u202egnp.exe'"),
        ("x" * (ECHO_CHARS + 5), f"'{'x' * ECHO_CHARS}'... ({ECHO_CHARS + 5} bytes)"),
    ],
)
def test_echo_escapes_and_cuts(value: str, shown: str) -> None:
    assert echo(value) == shown


def test_echo_bare_shows_plain_tokens_unquoted_only() -> None:
    assert echo("SlowDown", bare=True) == "SlowDown"
    assert echo("Slow Down", bare=True) == "'Slow Down'"
    assert echo(FORGED, bare=True).count("\n") == 0


def test_one_line_escapes_line_breaks_and_controls_and_caps() -> None:
    out = one_line(FORGED)
    assert "\n" not in out and "\r" not in out and "\x1b" not in out and "\u2028" not in out
    assert out.startswith("Evil\\n2026-12-07")
    long = one_line("y" * (MAX_MESSAGE_CHARS + 10))
    assert long.endswith("... (10 more characters)") and len(long) < MAX_MESSAGE_CHARS + 40


@pytest.mark.parametrize("json_lines", [False, True])
def test_every_record_is_one_bounded_line(json_lines: bool) -> None:
    stream = io.StringIO()
    setup_logging("INFO", json_lines=json_lines, stream=stream)
    try:
        logging.getLogger("weightd.test").warning("store said %s", FORGED + "m" * (4 << 20))
    finally:
        setup_logging("INFO")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1, lines[:3]
    assert len(lines[0]) < MAX_MESSAGE_CHARS + 200
    if json_lines:
        assert json.loads(lines[0])["msg"].startswith("store said Evil\\n")
