"""The S3 client: one boto3 client per daemon, and every failure as a typed error.

Why boto3: it is the well-kept SDK, it resolves credentials through the standard AWS
chain (environment, shared config and profile, web identity, container and instance
roles) so weightd never reads or holds a secret itself, and its ``standard`` retry mode
retries throttling (SlowDown, 503) and dropped connections with backoff. boto3 is an
optional extra (``pip install 'weightd[s3]'``): it is imported only when an ``s3://``
source is configured.

Nothing here logs a request, a header or a credential; error messages name the
``s3://`` object, the store's error code and the endpoint, nothing more.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

from ..base.errors import (
    ObjectAccessDenied,
    ObjectChanged,
    ObjectNotFound,
    ObjectStoreError,
    ObjectStoreThrottled,
    ObjectStoreUnreachable,
    UsageError,
)
from .location import S3Location, object_file_name

#: Most objects listed under one prefix: a model directory holds tens of files; a prefix
#: with more is not a model directory (and listing it would be unbounded work).
MAX_OBJECTS: Final = 10_000

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
    return session.client(
        "s3",
        endpoint_url=settings.endpoint,
        region_name=settings.region or session.region_name or "us-east-1",
        config=config,
    )


def classify(exc: BaseException, uri: str, endpoint: str | None) -> ObjectStoreError | None:
    """The typed error for an SDK failure on ``uri``; None: not an SDK failure (pure)."""
    from botocore import exceptions as bx

    where = endpoint or "the AWS endpoint"
    if isinstance(exc, bx.ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        said = f"{code} (HTTP {status})" if status and status != code else code
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
    if isinstance(exc, bx.BotoCoreError):
        return ObjectStoreError(uri, f"{type(exc).__name__} talking to {where}")
    return None


class S3Store:
    """The calls a download makes, each raising typed errors only."""

    def __init__(self, settings: S3Settings, client: Any | None = None) -> None:
        self.settings = settings
        self.client = client if client is not None else make_client(settings)
        self.retries = RetryCounter()

    def _call(self, uri: str, method: str, **kwargs: Any) -> Any:
        try:
            response = getattr(self.client, method)(**kwargs)
        except Exception as exc:
            typed = classify(exc, uri, self.settings.endpoint)
            if typed is None:
                raise
            raise typed from None
        self.retries.add(response)
        return response

    def list(self, location: S3Location) -> tuple[list[RemoteObject], int]:
        """The plain-named objects directly under ``location``, and how many others were
        skipped (deeper keys, odd names). Bounded by :data:`MAX_OBJECTS`."""
        found: list[RemoteObject] = []
        skipped = 0
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {
                "Bucket": location.bucket,
                "Prefix": location.prefix,
                "Delimiter": "/",
            }
            if token:
                kwargs["ContinuationToken"] = token
            page = self._call(location.uri, "list_objects_v2", **kwargs)
            skipped += len(page.get("CommonPrefixes", []))
            for item in page.get("Contents", []):
                name = object_file_name(location, str(item["Key"]))
                if name is None:
                    skipped += 1
                    continue
                found.append(
                    RemoteObject(name, str(item["Key"]), int(item["Size"]), str(item["ETag"]))
                )
            if len(found) + skipped > MAX_OBJECTS:
                raise ObjectStoreError(
                    location.uri, f"more than {MAX_OBJECTS} objects: not a model directory"
                )
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return found, skipped

    def head(self, location: S3Location, name: str) -> RemoteObject:
        """One object's current size, ETag and version (when the bucket versions)."""
        uri = location.object_uri(name)
        meta = self._call(uri, "head_object", Bucket=location.bucket, Key=location.key(name))
        return RemoteObject(
            name,
            location.key(name),
            int(meta["ContentLength"]),
            str(meta["ETag"]),
            meta.get("VersionId") or None,
        )

    def get_range(
        self, location: S3Location, obj: RemoteObject, start: int, end: int, chunk: int
    ) -> Iterator[bytes]:
        """Bytes ``[start, end)`` of the pinned version of ``obj``, in pieces of at most
        ``chunk`` bytes (memory stays bounded whatever the range).

        Pinned twice: ``If-Match`` with the ETag seen at the start (the store answers
        412 when it changed), and the answer's own ETag, Content-Range total and length
        compared with the pin, so a store that ignores ``If-Match`` cannot slip another
        version's bytes into the file.
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
        response = self._call(uri, "get_object", **kwargs)
        etag = str(response.get("ETag", obj.etag))
        if etag != obj.etag:
            raise ObjectChanged(uri, f"ETag is {etag}, the download began at {obj.etag}")
        total = str(response.get("ContentRange", "")).rpartition("/")[2]
        if total and total != "*" and int(total) != obj.size:
            raise ObjectChanged(
                uri, f"the object is {total} bytes now, the download began at {obj.size}"
            )
        body = response["Body"]
        try:
            while True:
                try:
                    piece = body.read(chunk)
                except Exception as exc:
                    typed = classify(exc, uri, self.settings.endpoint)
                    if typed is None:
                        raise
                    raise typed from None
                if not piece:
                    return
                yield piece
        finally:
            body.close()
