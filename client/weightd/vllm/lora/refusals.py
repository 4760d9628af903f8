"""The one table from a refusal to the HTTP answer a request for a weightd adapter gets.

A request's adapter name reaches weightd through two doors, vLLM's resolver
(``resolver.py``, answered as vLLM's ``GracefulHTTPError``) and the middleware
(``middleware.py``, answered as vLLM's JSON error body); both answer with the status
and message of the :class:`~weightd.vllm.errors.AdapterUnavailable` made here, and
the middleware names the status's error type from :data:`ERROR_TYPES`. The daemon's
refusals are matched by their typed class (its reason), never by their words.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Final

from weightd.client import (
    AdapterLoadPending,
    DeadlineExceededError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
    WeightdError,
)

from ..errors import AdapterUnavailable

#: The daemon's refusal → the HTTP status and what the message says, first match wins
#: (``{name}``: the adapter, ``{target}``: the daemon's address); any other refusal is
#: 400, the adapter refused.
_GONE: Final = HTTPStatus.SERVICE_UNAVAILABLE
DAEMON_REFUSALS: Final[tuple[tuple[type[WeightdError], HTTPStatus, str], ...]] = (
    (NotFoundError, HTTPStatus.NOT_FOUND, "{name} not found"),
    (AdapterLoadPending, _GONE, "{name}: the daemon is still loading it"),
    (UnavailableError, _GONE, "{name}: the daemon at {target} is unreachable"),
    (DeadlineExceededError, _GONE, "{name}: the daemon at {target} is unreachable"),
    (ResourceExhaustedError, _GONE, "{name}: the daemon cannot hold it now"),
)

#: The error type vLLM's OpenAI server names for each status (its error body's ``type``).
ERROR_TYPES: Final = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
}


def unavailable(name: str, target: str, exc: WeightdError) -> AdapterUnavailable:
    """The HTTP answer for the daemon's refusal ``exc`` about adapter ``name`` (pure)."""
    for kind, status, said in DAEMON_REFUSALS:
        if isinstance(exc, kind):
            what = said.format(name=f"weightd adapter {name!r}", target=target)
            return AdapterUnavailable(status, f"{what}: {exc.detail}")
    return refused(name, exc.detail)


def refused(name: str, why: str) -> AdapterUnavailable:
    """Adapter ``name`` will not be served as it is (400): ``why`` says what is wrong."""
    return AdapterUnavailable(HTTPStatus.BAD_REQUEST, f"weightd adapter {name!r} refused: {why}")


def not_written(name: str, exc: OSError) -> AdapterUnavailable:
    """The private copy of adapter ``name`` could not be written here (500)."""
    return AdapterUnavailable(
        HTTPStatus.INTERNAL_SERVER_ERROR,
        f"weightd adapter {name!r}: cannot write its private copy: {exc}",
    )


def error_type(status: HTTPStatus) -> str:
    """The error type vLLM names for ``status`` in its error body."""
    return ERROR_TYPES.get(status, "BadRequestError")


def not_loaded(name: str, version: int, exc: Exception) -> AdapterUnavailable:
    """vLLM's engine refused to load the verified copy of adapter ``name`` (400)."""
    return AdapterUnavailable(
        HTTPStatus.BAD_REQUEST,
        f"weightd adapter {name!r} version {version}: vLLM could not load it: {exc}",
    )
