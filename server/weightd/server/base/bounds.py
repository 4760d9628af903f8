"""Bounds on what a client sends: every string field of a request, and what errors quote.

:func:`check_fields` walks a request message by its descriptor, so a field added to the
proto is bounded the day it exists, on gRPC and on the side channel alike. Error
details quote client-supplied strings through :func:`~.errors.echo`, which truncates: a
detail never grows with what the client sent.
"""

from __future__ import annotations

from typing import Final

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from .errors import RequestTooLarge, echo

#: Bytes a string field may hold, by field name; anything not named gets the default.
FIELD_LIMITS: Final = {
    "model": 256,
    "name": 1024,  # adapter names are checked tighter by the adapter domain
    "names": 1024,  # each tensor name
    "source_dir": 4096,  # PATH_MAX
    "service": 1024,
    "expected_digest": 256,
    "model_fingerprint": 256,
    "source": 4096,  # a checkpoint directory or s3:// prefix (Publish)
    "manifest": 4096,
    "holder": 128,  # an engine's id (HoldVersion)
    "hold_id": 64,
}
DEFAULT_FIELD_BYTES: Final = 1024
#: Elements a repeated field may hold (a Fetch naming every tensor of a big model).
MAX_REPEATED: Final = 1 << 16


def check_fields(msg: Message, path: str = "") -> None:
    """Raise :class:`RequestTooLarge` naming the first field past its bound (pure)."""
    for field, value in msg.ListFields():
        where = f"{path}{field.name}"
        repeated = field.is_repeated
        if repeated and len(value) > MAX_REPEATED:
            raise RequestTooLarge(
                f"field {where} has {len(value)} elements; the limit is {MAX_REPEATED}"
            )
        items = value if repeated else [value]
        if field.type == FieldDescriptor.TYPE_STRING:
            limit = FIELD_LIMITS.get(field.name, DEFAULT_FIELD_BYTES)
            for item in items:
                size = len(item.encode())
                if size > limit:
                    raise RequestTooLarge(
                        f"field {where} is {size} bytes ({echo(item)}); the limit is {limit}"
                    )
        elif field.type == FieldDescriptor.TYPE_MESSAGE and not _is_map(field):
            for item in items:
                check_fields(item, f"{where}.")


def _is_map(field: FieldDescriptor) -> bool:
    """A map field (no request has one; its entries are counted, not walked)."""
    entry = field.message_type
    return entry is not None and entry.GetOptions().map_entry
