"""``s3://bucket/prefix/`` locations and the object names under them. Pure.

A remote model is the same layout as a local directory (``config.json``, the index,
the shards) as objects directly under one prefix. Object names come from the store,
which whoever writes the bucket controls, so each one becomes a local file name only
after :func:`object_file_name` has checked that it is one plain file name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from ..base.errors import InvalidRequest, UsageError, echo

SCHEME: Final = "s3://"
#: Bucket names as S3 allows them (3-63 of lowercase letters, digits, dots, dashes);
#: S3-compatible stores accept this set too.
_BUCKET: Final = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
#: S3 limits keys to 1024 bytes.
MAX_KEY_BYTES: Final = 1024
#: A file name in the local cache (ext4/xfs limit).
MAX_NAME_BYTES: Final = 255


@dataclass(frozen=True)
class S3Location:
    """A bucket and a key prefix that ends in ``/`` (or is empty: the whole bucket)."""

    bucket: str
    prefix: str

    @property
    def uri(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}"

    def key(self, name: str) -> str:
        return self.prefix + name

    def object_uri(self, name: str) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}{name}"

    def child(self, relative: str) -> S3Location:
        """The location ``relative`` (a/b/) under this one (the caller checked it)."""
        return S3Location(self.bucket, self.prefix + relative.strip("/") + "/")

    @property
    def last_component(self) -> str:
        parts = [p for p in self.prefix.split("/") if p]
        return parts[-1] if parts else self.bucket


def is_remote(source: str) -> bool:
    return source.startswith(SCHEME)


def parse_s3_uri(text: str, *, error: type[Exception] = UsageError) -> S3Location:
    """``s3://bucket/prefix[/]`` as a location; a missing slash is added (it is a prefix).

    Refused: no bucket, a bucket name S3 would refuse, ``.``/``..``/empty segments (a
    prefix is compared as text; ``a/../b`` would not mean what it says), NUL or control
    characters, a prefix over S3's key limit.
    """
    if not text.startswith(SCHEME):
        raise error(f"{echo(text)} is not an s3:// location")
    rest = text[len(SCHEME) :]
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET.match(bucket):
        raise error(
            f"{echo(text)}: bucket name {echo(bucket)} is not valid "
            "(3-63 characters of a-z, 0-9, '.', '-')"
        )
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    if prefix:
        if any(part in ("", ".", "..") for part in prefix[:-1].split("/")):
            raise error(f"{echo(text)}: the prefix has an empty, '.' or '..' segment")
        if not prefix.isprintable():
            raise error(f"{echo(text)}: the prefix has control characters")
    if len(prefix.encode()) > MAX_KEY_BYTES:
        raise error(f"{echo(text)}: the prefix is longer than S3's {MAX_KEY_BYTES}-byte key limit")
    return S3Location(bucket, prefix)


def object_file_name(location: S3Location, key: str) -> str | None:
    """The local file name of object ``key`` directly under ``location``; None for a key
    that is not one plain name there (deeper "directories", odd names): such objects are
    never written to disk."""
    if not key.startswith(location.prefix):
        return None
    name = key[len(location.prefix) :]
    if not name or "/" in name or name in (".", "..") or name.startswith("."):
        return None
    if "\\" in name or not name.isprintable() or len(name.encode()) > MAX_NAME_BYTES:
        return None
    return name


def adapter_location(source: str, roots: tuple[S3Location, ...]) -> S3Location:
    """The adapter at ``source`` (an ``s3://`` prefix) if it lies strictly under one of
    the ``--adapter-root s3://...`` roots; the caller's mistake otherwise."""
    location = parse_s3_uri(source, error=InvalidRequest)
    if not roots:
        raise InvalidRequest(
            f"{echo(source)}: no s3:// adapter roots are configured (--adapter-root)"
        )
    for root in roots:
        if (
            location.bucket == root.bucket
            and location.prefix.startswith(root.prefix)
            and location.prefix != root.prefix
        ):
            return location
    raise InvalidRequest(
        f"{echo(source)} is not under an adapter root ({', '.join(r.uri for r in roots)})"
    )


def default_model_name(source: str) -> str:
    """A model's name when ``--model`` gives none: the directory's (or prefix's) last
    component."""
    if is_remote(source):
        return parse_s3_uri(source).last_component
    import os.path

    return os.path.basename(os.path.realpath(source))
