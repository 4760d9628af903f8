"""``WEIGHTD_LORA``: the one setting of weightd's LoRA integration for vLLM.

Either a gRPC target (``unix:///run/weightd/weightd.sock``; empty or ``default``: the
daemon's default socket) or a JSON object with the keys (all optional):

* ``target``: the daemon's worker address;
* ``model``: the served base model adapters must apply to (default: the daemon's
  only model);
* ``load``: ask the daemon to load an adapter that is not loaded (default true; the
  daemon decides, by its ``--adapter-autoload`` list, whether it may);
* ``dir``: where the private copies of verified adapters are written (default: a
  fresh 0700 directory under ``$TMPDIR``, removed at exit);
* ``retain_seconds``: how long a version's copy stays, once vLLM gives new requests
  another one, for requests still using it (default 3600);
* ``timeout``: seconds per daemon call (default 60; a load from object storage
  counts in it);
* ``max_bytes``: the largest adapter (both files) accepted (default 4 GiB).

An unknown key or a value of the wrong type is refused: a typo must not silently turn
a setting off. vLLM's own switches (``--enable-lora``, ``--max-lora-rank``, ...) stay
vLLM's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from weightd.common.sockets import default_target

ENV: Final = "WEIGHTD_LORA"
_KEYS: Final = ("target", "model", "load", "dir", "retain_seconds", "timeout", "max_bytes")


class LoRAOptionsError(ValueError):
    """``WEIGHTD_LORA`` cannot be read; the message names the key."""


@dataclass(frozen=True)
class LoRAOptions:
    target: str
    model: str = ""
    load: bool = True
    dir: str = ""
    retain_seconds: float = 3600.0
    timeout: float = 60.0
    max_bytes: int = (4 << 30) + (4 << 20)


def _get(raw: Mapping[str, Any], key: str, kind: type | tuple[type, ...], default: Any) -> Any:
    value = raw.get(key, default)
    if isinstance(value, bool) and kind is not bool:
        raise LoRAOptionsError(f"{ENV}[{key!r}] must not be a boolean, got {value!r}")
    if not isinstance(value, kind):
        raise LoRAOptionsError(f"{ENV}[{key!r}] has the wrong type: {value!r}")
    return value


def parse_lora_options(text: str | None) -> LoRAOptions:
    """The options from ``WEIGHTD_LORA``'s text (None or empty: every default)."""
    text = (text or "").strip()
    if not text.startswith("{"):
        return LoRAOptions(target=default_target() if text in ("", "default") else text)
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LoRAOptionsError(f"{ENV} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise LoRAOptionsError(f"{ENV} must be a target or a JSON object")
    unknown = sorted(set(raw) - set(_KEYS))
    if unknown:
        raise LoRAOptionsError(f"{ENV} has unknown key(s) {unknown}; known keys: {list(_KEYS)}")
    options = LoRAOptions(
        target=_get(raw, "target", str, "") or default_target(),
        model=_get(raw, "model", str, ""),
        load=_get(raw, "load", bool, True),
        dir=_get(raw, "dir", str, ""),
        retain_seconds=float(_get(raw, "retain_seconds", (int, float), 3600.0)),
        timeout=float(_get(raw, "timeout", (int, float), 60.0)),
        max_bytes=_get(raw, "max_bytes", int, (4 << 30) + (4 << 20)),
    )
    if options.timeout <= 0 or options.retain_seconds < 0 or options.max_bytes <= 0:
        raise LoRAOptionsError(
            f"{ENV}: timeout and max_bytes must be positive, retain_seconds not negative"
        )
    return options
