"""The SDK's failures as typed errors (botocore's own exception objects, as boto3
raises them), and the messages never carrying more than the object and the code."""

from __future__ import annotations

from typing import Any

import pytest
from botocore import exceptions as bx

from weightd.server.base import errors
from weightd.server.sources.s3 import classify

URI = "s3://models/llama/model.safetensors"


def _client_error(code: str, status: int) -> bx.ClientError:
    response: Any = {
        "Error": {"Code": code, "Message": "..."},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return bx.ClientError(response, "GetObject")


@pytest.mark.parametrize(
    ("exc", "cls", "needle"),
    [
        (_client_error("PreconditionFailed", 412), errors.ObjectChanged, "changed"),
        (_client_error("InvalidAccessKeyId", 403), errors.ObjectAccessDenied, "access denied"),
        (_client_error("403", 403), errors.ObjectAccessDenied, "access denied"),
        (_client_error("NoSuchBucket", 404), errors.ObjectNotFound, "bucket does not exist"),
        (_client_error("404", 404), errors.ObjectNotFound, "no such object"),
        (_client_error("SlowDown", 503), errors.ObjectStoreThrottled, "throttling"),
        (_client_error("InternalError", 500), errors.ObjectStoreError, "InternalError"),
        (bx.NoCredentialsError(), errors.ObjectAccessDenied, "no credentials found"),
        (
            bx.EndpointConnectionError(endpoint_url="http://127.0.0.1:1"),
            errors.ObjectStoreUnreachable,
            "cannot reach the object store at http://e",
        ),
    ],
)
def test_sdk_failures_become_typed_errors(exc: BaseException, cls: type, needle: str) -> None:
    typed = classify(exc, URI, "http://e")
    assert type(typed) is cls
    assert typed is not None and str(typed).startswith(URI + ": ") and needle in str(typed)


def test_other_exceptions_are_not_claimed() -> None:
    assert classify(ValueError("x"), URI, None) is None


def test_the_sdk_never_logs_requests_whatever_the_daemon_level() -> None:
    import logging

    from weightd.server.sources.s3 import S3Settings, make_client

    logging.getLogger("botocore").setLevel(logging.DEBUG)
    client = make_client(S3Settings(endpoint="http://127.0.0.1:1"))
    assert client.meta.endpoint_url == "http://127.0.0.1:1"
    for name in ("boto3", "botocore", "urllib3"):
        assert logging.getLogger(name).getEffectiveLevel() >= logging.WARNING, name
