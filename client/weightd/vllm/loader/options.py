"""``--model-loader-extra-config`` for ``--load-format weightd``, checked strictly.

Keys (all optional): ``target`` (gRPC target of the daemon; default: its default Unix
socket), ``model`` (the served model's name; default: the daemon's only model),
``fallback`` (``"none"``, or ``"disk"``: if weightd cannot serve this worker, load
from the model directory with vLLM's default loader and say so in the log),
``transport`` (``"auto"``: shared memory on the daemon's host, else gRPC; or
``"grpc"`` / ``"shm"`` to insist), ``timeout`` (seconds per call), ``identity``
(``"strict"``: refuse to load when a shard in the model directory cannot be proven to
be the daemon's, see ``identity.py``; ``"warn"``: the operator's opt-out, load and name
every unproven shard in a WARNING). An unknown key or a value of the wrong type is
refused: a typo must not silently turn a setting off.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

from weightd.common.addresses import AddressError, parse_address
from weightd.common.sockets import default_target

from ..errors import WeightdLoadError

Fallback = Literal["none", "disk"]
LoaderTransport = Literal["auto", "grpc", "shm"]
IdentityCheck = Literal["strict", "warn"]

_KEYS = ("target", "model", "fallback", "transport", "timeout", "identity")


@dataclass(frozen=True)
class LoaderOptions:
    target: str
    model: str | None = None
    fallback: Fallback = "none"
    transport: LoaderTransport = "auto"
    timeout: float | None = None
    identity: IdentityCheck = "strict"

    @property
    def model_label(self) -> str:
        """The model as messages name it: its name, or what the default means."""
        return repr(self.model) if self.model else "(the daemon's only model)"


def _string(extra: Mapping[str, Any], key: str) -> str | None:
    value = extra.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise WeightdLoadError(
            f"model_loader_extra_config[{key!r}] must be a non-empty string, got {value!r}"
        )
    return value


#: Longest ``timeout`` accepted: a day. Past it a "timeout" is no bound at all (and
#: gRPC turns huge deadlines into overflow errors).
MAX_TIMEOUT_SECONDS = 86400.0


def _seconds(extra: Mapping[str, Any], key: str) -> float | None:
    """A number of seconds: finite, positive, at most a day. ``NaN`` and ``Infinity`` (which
    Python's JSON reads) are refused: with either, every call would fail at once with
    DEADLINE_EXCEEDED (NaN compares false with everything, so a ``<= 0`` check passes it).
    Every float option of the loader is read through here."""
    value = extra.get(key)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not 0 < value <= MAX_TIMEOUT_SECONDS
    ):
        raise WeightdLoadError(
            f"model_loader_extra_config[{key!r}] must be a positive, finite number of seconds "
            f"(at most {MAX_TIMEOUT_SECONDS:g}), got {value!r}"
        )
    return float(value)


def _choice(extra: Mapping[str, Any], key: str, allowed: tuple[str, ...], default: str) -> str:
    value = _string(extra, key) or default
    if value not in allowed:
        raise WeightdLoadError(
            f"model_loader_extra_config[{key!r}] is {value!r}; expected one of {list(allowed)}"
        )
    return value


def parse_options(extra: Mapping[str, Any] | None) -> LoaderOptions:
    """The loader's options from vLLM's ``model_loader_extra_config`` (a dict or None)."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(_KEYS))
    if unknown:
        raise WeightdLoadError(
            f"model_loader_extra_config has unknown key(s) {unknown} for load_format "
            f"'weightd'; known keys: {list(_KEYS)}"
        )
    timeout = _seconds(extra, "timeout")
    target = _string(extra, "target") or default_target()
    try:
        parse_address(target)  # the one address rule, as WeightClient applies it
    except AddressError as exc:
        raise WeightdLoadError(f"model_loader_extra_config['target']: {exc}") from None
    return LoaderOptions(
        target=target,
        model=_string(extra, "model"),
        fallback=cast(Fallback, _choice(extra, "fallback", ("none", "disk"), "none")),
        transport=cast(
            LoaderTransport, _choice(extra, "transport", ("auto", "grpc", "shm"), "auto")
        ),
        timeout=timeout,
        identity=cast(IdentityCheck, _choice(extra, "identity", ("strict", "warn"), "strict")),
    )
