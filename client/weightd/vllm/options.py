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

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

from weightd.common.sockets import default_target

from .errors import WeightdLoadError

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
    timeout = extra.get("timeout")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0
    ):
        raise WeightdLoadError(
            f"model_loader_extra_config['timeout'] must be a positive number, got {timeout!r}"
        )
    return LoaderOptions(
        target=_string(extra, "target") or default_target(),
        model=_string(extra, "model"),
        fallback=cast(Fallback, _choice(extra, "fallback", ("none", "disk"), "none")),
        transport=cast(
            LoaderTransport, _choice(extra, "transport", ("auto", "grpc", "shm"), "auto")
        ),
        timeout=None if timeout is None else float(timeout),
        identity=cast(IdentityCheck, _choice(extra, "identity", ("strict", "warn"), "strict")),
    )
