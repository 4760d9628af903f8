"""The S3 client: one boto3 client per daemon, and every failure as a typed error.

Why boto3: it is the well-kept SDK, it resolves credentials through the standard AWS
chain (environment, shared config and profile, web identity, container and instance
roles) so weightd never reads or holds a secret itself, and its ``standard`` retry mode
retries throttling (SlowDown, 503) and dropped connections with backoff. boto3 is an
optional extra (``pip install 'weightd[s3]'``): it is imported only when an ``s3://``
source is configured.

Nothing here logs a request, a header or a credential; error messages name the
``s3://`` object, the store's error code (escaped and cut, :func:`~..base.errors.echo`)
and the endpoint, nothing more. Every answer is read under the bounds of
:mod:`.bounds` (enforced by :mod:`.transport`) and checked field by field: a listing
entry, a size, an ETag or a ``Content-Range`` the store got wrong is one typed line,
never a traceback.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from ..base.errors import (
    ObjectAccessDenied,
    ObjectChanged,
    ObjectNotFound,
    ObjectStoreError,
    ObjectStoreProtocolError,
    ObjectStoreThrottled,
    ObjectStoreTooSlow,
    ObjectStoreUnreachable,
    ObjectTruncated,
    UsageError,
    WeightdError,
    echo,
)
from ..base.redact import redact
from .bounds import (
    MAX_EMPTY_PAGES,
    MAX_LIST_BYTES,
    MAX_LIST_KEYS,
    MAX_LIST_PAGES,
    MAX_PAGE_BYTES,
    MAX_SMALL_BYTES,
    PAGE_KEYS,
    StoreBounds,
)
from .location import S3Location, object_file_name
from .transport import BoundedTransport

#: Longest ETag, version id or continuation token accepted from the store (S3's are
#: tens to a few hundred characters); each must be printable ASCII.
MAX_TOKEN_CHARS: Final = 1024
#: Largest object size believed (S3's limit is 5 TiB; 2**50 leaves room for others).
MAX_OBJECT_BYTES: Final = 1 << 50
_CONTENT_RANGE: Final = re.compile(r"^bytes ([0-9]{1,20})-([0-9]{1,20})/([0-9]{1,20}|\*)$")

_DENIED: Final = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "InvalidToken",
        "ExpiredToken",
        "AllAccessDisabled",
        "403",
    }
)
_MISSING: Final = frozenset({"NoSuchBucket", "NoSuchKey", "404", "NotFound"})
_THROTTLED: Final = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "503"}
)
_CHANGED: Final = frozenset({"PreconditionFailed", "412"})


@dataclass(frozen=True)
class S3Settings:
    """How to reach the store. Credentials are not here: boto3's chain finds them."""

    #: ``--s3-endpoint`` for S3-compatible stores; None: AWS's own for the region.
    endpoint: str | None = None
    #: ``--s3-region``; None: from the AWS configuration (``us-east-1`` if none).
    region: str | None = None
    #: Attempts per request, the first included (the SDK's standard retry mode).
    max_attempts: int = 5
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    #: HTTP connections kept (one per concurrent ranged GET, plus listing).
    pool_connections: int = 10
    #: Bytes and time of every answer (:mod:`.bounds`).
    bounds: StoreBounds = field(default_factory=StoreBounds)


@dataclass(frozen=True)
class RemoteObject:
    """One object as the store described it when we looked: what a download pins."""

    name: str  # the local file name
    key: str
    size: int
    etag: str
    version_id: str | None = None


class RetryCounter:
    """SDK retries seen (``ResponseMetadata.RetryAttempts``), for the metrics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total = 0

    def add(self, response: Any) -> None:
        tries = int(response.get("ResponseMetadata", {}).get("RetryAttempts", 0) or 0)
        if tries:
            with self._lock:
                self.total += tries


def make_client(settings: S3Settings) -> Any:
    """A thread-safe boto3 S3 client (boto3 clients may be shared across threads)."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise UsageError("s3:// sources need boto3: pip install 'weightd[s3]'") from None
    # botocore's DEBUG records carry request headers (the Authorization line names the
    # access key id): whatever --log-level says, the SDK's own loggers stay at WARNING.
    for name in ("boto3", "botocore", "s3transfer", "urllib3"):
        logging.getLogger(name).setLevel(logging.WARNING)
    config = Config(
        retries={"mode": "standard", "max_attempts": settings.max_attempts},
        connect_timeout=settings.connect_timeout,
        read_timeout=settings.read_timeout,
        max_pool_connections=settings.pool_connections,
        s3={"addressing_style": "path"} if settings.endpoint else None,
    )
    session = boto3.session.Session()
    return session.client(  # the caller fits it with its bounds before the first request
        "s3",
        endpoint_url=settings.endpoint,
        region_name=settings.region or session.region_name or "us-east-1",
        config=config,
    )


def classify(exc: BaseException, uri: str, endpoint: str | None) -> ObjectStoreError | None:
    """The typed error for an SDK failure on ``uri``; None: not an SDK failure (pure)."""
    from botocore import exceptions as bx
    from botocore.parsers import ResponseParserError

    where = redact(endpoint) if endpoint else "the AWS endpoint"
    if isinstance(exc, bx.ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        shown = echo(code, bare=True) if code else "no error code"
        said = f"{shown} (HTTP {echo(status, bare=True)})" if status and status != code else shown
        if code in _CHANGED or status == "412":
            return ObjectChanged(uri, f"the object changed since its download began ({said})")
        if code in _DENIED or status == "403":
            return ObjectAccessDenied(
                uri, f"access denied by the store: {said}; check the credentials and policy"
            )
        if code == "NoSuchBucket":
            return ObjectNotFound(uri, f"the bucket does not exist ({said})")
        if code in _MISSING or status == "404":
            return ObjectNotFound(uri, f"no such object ({said})")
        if code in _THROTTLED or status in ("503", "429"):
            return ObjectStoreThrottled(
                uri, f"the store is throttling requests ({said}) after the SDK's retries"
            )
        return ObjectStoreError(uri, f"the store answered {said}")
    if isinstance(exc, bx.NoCredentialsError):
        return ObjectAccessDenied(
            uri,
            "no credentials found (environment, shared config/profile, web identity, "
            "container or instance role)",
        )
    if isinstance(exc, (bx.EndpointConnectionError, bx.ConnectTimeoutError)):
        return ObjectStoreUnreachable(uri, f"cannot reach the object store at {where}")
    if isinstance(exc, (bx.ReadTimeoutError, bx.ResponseStreamingError)):
        return ObjectStoreUnreachable(uri, f"the connection to {where} broke mid-transfer")
    if isinstance(exc, bx.IncompleteReadError):
        return ObjectTruncated(uri, "the answer ended before its announced length")
    if isinstance(exc, ResponseParserError):
        return ObjectStoreProtocolError(
            uri, f"the answer from {where} is not a well-formed S3 answer; refused"
        )
    if isinstance(exc, bx.BotoCoreError):
        return ObjectStoreError(uri, f"{type(exc).__name__} talking to {where}")
    return None


def _integer(uri: str, value: object, what: str) -> int:
    """A size the store gave: a non-negative integer it could hold, or a typed refusal."""
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) < 20:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_OBJECT_BYTES:
        raise ObjectStoreProtocolError(
            uri, f"the store gave {what} {echo(value)}: not a size (an integer 0..2**50)"
        )
    return value


def _token(uri: str, value: object, what: str, *, required: bool = True) -> str | None:
    """An ETag, version id or continuation token: printable ASCII within its bound."""
    if value is None or value == "":
        if required:
            raise ObjectStoreProtocolError(uri, f"the store gave no {what}")
        return None
    if (
        not isinstance(value, str)
        or len(value) > MAX_TOKEN_CHARS
        or not value.isascii()
        or not value.isprintable()
    ):
        raise ObjectStoreProtocolError(
            uri,
            f"the store gave {what} {echo(value)}: not printable ASCII within "
            f"{MAX_TOKEN_CHARS} characters",
        )
    return value


def _entries(uri: str, page: Mapping[str, Any], field_name: str) -> list[Mapping[str, Any]]:
    items = page.get(field_name, [])
    if not isinstance(items, list) or not all(isinstance(i, Mapping) for i in items):
        raise ObjectStoreProtocolError(uri, f"the listing's {field_name} is not a list of entries")
    return items


def listed_object(location: S3Location, item: Mapping[str, Any], n: int) -> RemoteObject | None:
    """Listing entry ``n`` as an object to download; None for a key that is not one plain
    name directly under the prefix (never written to disk). A malformed entry (no
    ``Key``, a ``Size`` that is no size, an odd ETag) is refused, naming the entry."""
    key = item.get("Key")
    if not isinstance(key, str) or not key:
        raise ObjectStoreProtocolError(
            location.uri, f"listing entry {n} has no Key; the store's listing is malformed"
        )
    name = object_file_name(location, key)
    if name is None:
        return None
    uri = location.object_uri(name)
    size = _integer(uri, item.get("Size"), "Size")
    etag = _token(uri, item.get("ETag"), "ETag")
    assert etag is not None
    return RemoteObject(name, key, size, etag)


class S3Store:
    """The calls a download makes, each bounded (:mod:`.bounds`) and raising typed errors
    only."""

    def __init__(self, settings: S3Settings, client: Any | None = None) -> None:
        self.settings = settings
        self.client = client if client is not None else make_client(settings)
        self.transport = BoundedTransport(settings.bounds)
        self.transport.install(self.client)
        self.retries = RetryCounter()

    @property
    def bounds(self) -> StoreBounds:
        return self.settings.bounds

    def close(self) -> None:
        """Cancel every request in flight (shutdown): blocked reads end at once."""
        self.transport.close()

    def _call(self, uri: str, method: str, budget: Any, **kwargs: Any) -> Any:
        try:
            response = getattr(self.client, method)(**kwargs)
        except WeightdError:
            raise
        except Exception as exc:
            if budget.failure is not None:
                raise budget.failure from None
            typed = classify(exc, uri, self.settings.endpoint)
            if typed is None and isinstance(exc, (ValueError, TypeError, KeyError, IndexError)):
                # The SDK's parser choking on the answer (a Size or Content-Length that is
                # not a number, a missing element): the store's fault, said in one line.
                typed = ObjectStoreProtocolError(
                    uri,
                    f"the store's answer to {method} could not be read "
                    f"({type(exc).__name__}: {echo(str(exc))}); refused",
                )
            if typed is None:
                raise
            raise typed from None
        finally:
            self.transport.detach()
        self.retries.add(response)
        return response

    def list(
        self, location: S3Location, cancel: threading.Event | None = None
    ) -> tuple[list[RemoteObject], int]:
        """The plain-named objects directly under ``location``, and how many others were
        skipped (deeper keys, odd names). Bounded in pages, entries, bytes and time
        (:mod:`.bounds`); a listing that breaks a bound is refused as soon as it does."""
        uri = location.uri
        b = self.bounds
        found: list[RemoteObject] = []
        skipped = entries = pages = empty = received = 0
        seen: set[str] = set()
        names: set[str] = set()
        token: str | None = None
        deadline = time.monotonic() + b.list_seconds
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ObjectStoreTooSlow(
                    uri, f"the listing took more than {b.list_seconds:g} s ({pages} pages); refused"
                )
            if pages >= MAX_LIST_PAGES:
                raise ObjectStoreProtocolError(
                    uri,
                    f"the listing needs more than {MAX_LIST_PAGES} pages; not a model directory",
                )
            kwargs: dict[str, Any] = {
                "Bucket": location.bucket,
                "Prefix": location.prefix,
                "Delimiter": "/",
                "MaxKeys": PAGE_KEYS,
            }
            if token:
                kwargs["ContinuationToken"] = token
            with self.transport.budget(
                uri,
                f"listing page {pages + 1}",
                seconds=min(b.request_seconds, left),
                max_bytes=min(MAX_PAGE_BYTES, MAX_LIST_BYTES - received),
                cancel=cancel,
            ) as budget:
                page = self._call(uri, "list_objects_v2", budget, **kwargs)
            received += budget.received
            pages += 1
            contents = _entries(uri, page, "Contents")
            prefixes = _entries(uri, page, "CommonPrefixes")
            n = len(contents) + len(prefixes)
            if n > PAGE_KEYS:
                raise ObjectStoreProtocolError(
                    uri,
                    f"listing page {pages} holds {n} entries, more than the {PAGE_KEYS} "
                    "asked for; refused",
                )
            entries += n
            if entries > MAX_LIST_KEYS:
                raise ObjectStoreProtocolError(
                    uri, f"more than {MAX_LIST_KEYS} objects: not a model directory"
                )
            skipped += len(prefixes)
            for i, item in enumerate(contents):
                obj = listed_object(location, item, entries - n + i + 1)
                if obj is None:
                    skipped += 1
                elif obj.name in names:
                    raise ObjectStoreProtocolError(
                        location.object_uri(obj.name),
                        "listed twice: the store's listing is not one object per key; refused",
                    )
                else:
                    names.add(obj.name)
                    found.append(obj)
            if not page.get("IsTruncated"):
                return found, skipped
            token = _token(uri, page.get("NextContinuationToken"), "continuation token")
            assert token is not None
            if token in seen:
                raise ObjectStoreProtocolError(
                    uri,
                    f"listing page {pages} repeats an earlier continuation token: the "
                    "listing loops; refused",
                )
            seen.add(token)
            empty = empty + 1 if n == 0 else 0
            if empty >= MAX_EMPTY_PAGES:
                raise ObjectStoreProtocolError(
                    uri,
                    f"{empty} truncated listing pages in a row hold no entry: the "
                    "listing does not progress; refused",
                )

    def head(
        self, location: S3Location, name: str, cancel: threading.Event | None = None
    ) -> RemoteObject:
        """One object's current size, ETag and version (when the bucket versions)."""
        uri = location.object_uri(name)
        with self.transport.budget(
            uri,
            "HEAD",
            seconds=self.bounds.request_seconds,
            max_bytes=MAX_SMALL_BYTES,
            cancel=cancel,
        ) as budget:
            meta = self._call(
                uri, "head_object", budget, Bucket=location.bucket, Key=location.key(name)
            )
        etag = _token(uri, meta.get("ETag"), "ETag")
        assert etag is not None
        return RemoteObject(
            name,
            location.key(name),
            _integer(uri, meta.get("ContentLength"), "Content-Length"),
            etag,
            _token(uri, meta.get("VersionId"), "version id", required=False),
        )

    def get_range(
        self,
        location: S3Location,
        obj: RemoteObject,
        start: int,
        end: int,
        chunk: int,
        *,
        pace: Callable[[int], float] | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[bytes]:
        """Bytes ``[start, end)`` of the pinned version of ``obj``, in pieces of at most
        ``chunk`` bytes, each its own ``bytes`` (see :meth:`get_range_into`)."""
        buffer = memoryview(bytearray(max(1, min(chunk, end - start))))
        for n in self.get_range_into(location, obj, start, end, buffer, pace=pace, cancel=cancel):
            yield bytes(buffer[:n])

    def get_range_into(
        self,
        location: S3Location,
        obj: RemoteObject,
        start: int,
        end: int,
        buffer: memoryview,
        *,
        pace: Callable[[int], float] | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[int]:
        """Bytes ``[start, end)`` of the pinned version of ``obj``, read into ``buffer``
        piece by piece: each yield says how many bytes of it the piece holds (valid until
        the next one), never more than ``end - start`` in all (memory stays bounded
        whatever the range or the store: the caller's buffer).

        Pinned twice: ``If-Match`` with the ETag seen at the start (the store answers
        412 when it changed), and the answer itself must prove its version: the pinned
        ETag, a ``Content-Range`` of exactly the range and the object's size (a ``200``
        without one only for the whole object) and the version id when one is pinned.
        An answer that cannot prove which version it came from is refused, so a store
        that ignores ``If-Match`` cannot slip another version's bytes into the file.
        ``pace(n)`` is the daemon's own throttle: the seconds to wait before ``n`` more
        bytes, booked as not the store's time before they are waited.
        """
        uri = location.object_uri(obj.name)
        kwargs: dict[str, Any] = {
            "Bucket": location.bucket,
            "Key": obj.key,
            "Range": f"bytes={start}-{end - 1}",
            "IfMatch": obj.etag,
        }
        if obj.version_id:
            kwargs["VersionId"] = obj.version_id
        budget = self.transport.open(
            uri,
            f"range [{start}, {end})",
            seconds=self.bounds.range_seconds(end - start),
            max_bytes=end - start,
            rate=True,
            cancel=cancel,
        )
        try:
            response = self._call(uri, "get_object", budget, **kwargs)
            body = response["Body"]
            try:
                self._check_answer(uri, obj, start, end, response)
                while True:
                    try:
                        n = body.readinto(buffer)
                    except WeightdError:
                        raise
                    except Exception as exc:
                        budget.check()
                        typed = classify(exc, uri, self.settings.endpoint)
                        if typed is None:
                            raise
                        raise typed from None
                    if not n:
                        budget.check()
                        return
                    if pace is not None:
                        # Booked before the wait: the watchdog must not take the
                        # daemon's own throttle for a slow store.
                        delay = pace(n)
                        budget.pause(delay)
                        if delay > 0:
                            time.sleep(delay)
                    yield n
            finally:
                body.close()
        finally:
            self.transport.close_budget(budget)

    @staticmethod
    def _check_answer(
        uri: str, obj: RemoteObject, start: int, end: int, response: Mapping[str, Any]
    ) -> None:
        """Refuse an answer that is not provably bytes ``[start, end)`` of ``obj``'s pin."""
        etag = response.get("ETag")
        if etag is None or etag == "":
            raise ObjectStoreProtocolError(
                uri,
                "the answer carries no ETag: it cannot prove which version of the object "
                "it came from; refused",
            )
        if etag != obj.etag:
            raise ObjectChanged(
                uri, f"ETag is {echo(etag)}, the download began at {echo(obj.etag)}"
            )
        version = response.get("VersionId")
        if obj.version_id and version and version != obj.version_id:
            raise ObjectChanged(
                uri, f"version {echo(version)}, the download began at {echo(obj.version_id)}"
            )
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        told = response.get("ContentRange")
        if told is None or told == "":
            if not (status == 200 and start == 0 and end == obj.size):
                raise ObjectStoreProtocolError(
                    uri,
                    f"the answer to range [{start}, {end}) carries no Content-Range: it "
                    "cannot prove which bytes of which object size it holds; refused",
                )
        else:
            m = _CONTENT_RANGE.match(str(told))
            if m is None or m.group(3) == "*":
                raise ObjectStoreProtocolError(
                    uri, f"Content-Range {echo(told)} is not 'bytes FIRST-LAST/SIZE'; refused"
                )
            first, last, total = int(m.group(1)), int(m.group(2)), int(m.group(3))
            if total != obj.size:
                raise ObjectChanged(
                    uri, f"the object is {total} bytes now, the download began at {obj.size}"
                )
            if (first, last) != (start, end - 1):
                raise ObjectStoreProtocolError(
                    uri,
                    f"Content-Range {echo(told)} answers range [{start}, {end}) "
                    "with other bytes; refused",
                )
        length = response.get("ContentLength")
        if length is not None and _integer(uri, length, "Content-Length") != end - start:
            raise ObjectTruncated(
                uri, f"the answer to range [{start}, {end}) announces {length} bytes"
            )
