"""Every error detail and field is escaped and redacted where it is made (pure).

The daemon's messages quote strings from outside (a Publish source, a side-channel
``gpu_uuid``, a store's message); whatever a message forgot to escape, the detail that
leaves the daemon, on gRPC and on the side socket, carries no raw control character and
no URL password.
"""

from __future__ import annotations

import pytest

from weightd.server.base.errors import CudaFailure, InvalidRequest, ModelNotFound, error_status
from weightd.server.base.redact import redact
from weightd.server.transports.local_service import local_error

HOSTILE = "GPU-\x1b[2J\x1b]0;t\x07\r\nFAKE\u202e\x00"


@pytest.mark.parametrize(
    "error",
    [
        CudaFailure(f"GPU {HOSTILE} is not visible to the daemon"),
        InvalidRequest(f"source {HOSTILE}: not a directory"),
        ModelNotFound(f"no model {HOSTILE}"),
    ],
)
def test_details_carry_no_raw_control_character(error: Exception) -> None:
    status = error_status(error)
    side = local_error(error, "acquire")
    for detail in (status.detail, side.detail, *status.metadata.values()):
        assert all(c.isprintable() for c in detail), repr(detail)
    assert "\\x1b[2J" in status.detail and "\\r\\n" in status.detail  # shown, escaped


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("https://AK:secret@host:9000/b", "https://***@host:9000/b"),
        ("http://token@host/x", "http://***@host/x"),
        ("s3://b/p?X-Amz-Signature=abc&part=1", "s3://b/p?X-Amz-Signature=***&part=1"),
        ("https://h/?api_key=k#frag", "https://h/?api_key=***#frag"),
        ("see user@host and /a/b?c=d", "see user@host and /a/b?c=d"),
    ],
)
def test_redact(text: str, shown: str) -> None:
    assert redact(text) == shown
    assert redact(shown) == shown


def test_details_redact_credentials() -> None:
    status = error_status(InvalidRequest("endpoint https://AK:secret@minio:9000 refused"))
    assert "secret" not in status.detail and "AK" not in status.detail
