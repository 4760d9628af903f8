"""Declared layouts: the deployments a host will serve, named ahead so their packs are
built at load, not on the first worker's critical path. Pure.

A :class:`LayoutGroup` is a layout without ranks (sizes, stage split, vocabulary
convention); its :meth:`~LayoutGroup.ranks` are every worker of such a deployment.
The operator writes one as ``[MODEL=]tp=2[,pp=2][,pp_layers=5+5][,ep=N][,vocab_pad=64]``
(``weightd serve --layout``); the daemon also remembers the groups workers asked for
(``transports/layout_memory.py``) and writes them as :meth:`LayoutGroup.to_json`.

What vLLM asks for: ``tp=N`` at TP=1, and ``tp=N,vocab_pad=64`` at TP>1 (its
vocabulary padding); pipeline stages with its own split, which is the default
(even, remainder to the stages before the last) unless ``VLLM_PP_LAYER_PARTITION``
says otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from .layout import MAX_PARALLEL_SIZE, MAX_VOCAB_PAD, Layout, every_rank

#: Workers in one declared group at most (each gets a pack built at load).
MAX_GROUP_RANKS: Final = 256
_KEYS: Final = ("tp", "pp", "ep", "pp_layers", "vocab_pad")


@dataclass(frozen=True, slots=True)
class LayoutGroup:
    tp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    pp_layers: tuple[int, ...] = ()
    vocab_pad: int = 0

    @classmethod
    def of(cls, layout: Layout) -> LayoutGroup:
        """The deployment ``layout`` is one worker of."""
        return cls(
            layout.tp_size, layout.pp_size, layout.ep_size, layout.pp_layers, layout.vocab_pad
        )

    def ranks(self) -> list[Layout]:
        """Every worker, in global-rank order."""
        return every_rank(self.tp_size, self.pp_size, self.ep_size, self.pp_layers, self.vocab_pad)

    def check(self) -> None:
        """Raise ValueError naming the first field out of range."""
        for key, value in (("tp", self.tp_size), ("pp", self.pp_size), ("ep", self.ep_size)):
            if not 1 <= value <= MAX_PARALLEL_SIZE:
                raise ValueError(f"{key}={value}: must be between 1 and {MAX_PARALLEL_SIZE}")
        if self.tp_size * self.pp_size * self.ep_size > MAX_GROUP_RANKS:
            raise ValueError(
                f"{self}: {self.tp_size * self.pp_size * self.ep_size} workers; at most "
                f"{MAX_GROUP_RANKS} per declared layout"
            )
        if self.pp_layers and len(self.pp_layers) != self.pp_size:
            raise ValueError(f"pp_layers lists {len(self.pp_layers)} stages, pp={self.pp_size}")
        if any(not 0 <= n <= 1 << 20 for n in self.pp_layers):
            raise ValueError(f"pp_layers {list(self.pp_layers)}: a count out of range")
        if not 0 <= self.vocab_pad <= MAX_VOCAB_PAD:
            raise ValueError(f"vocab_pad={self.vocab_pad}: must be between 0 and {MAX_VOCAB_PAD}")

    def __str__(self) -> str:
        parts = [f"tp={self.tp_size}"]
        if self.pp_size > 1:
            parts.append(f"pp={self.pp_size}")
        if self.pp_layers:
            parts.append("pp_layers=" + "+".join(map(str, self.pp_layers)))
        if self.ep_size > 1:
            parts.append(f"ep={self.ep_size}")
        if self.vocab_pad:
            parts.append(f"vocab_pad={self.vocab_pad}")
        return ",".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "tp": self.tp_size,
            "pp": self.pp_size,
            "ep": self.ep_size,
            "pp_layers": list(self.pp_layers),
            "vocab_pad": self.vocab_pad,
        }

    @classmethod
    def from_json(cls, value: object) -> LayoutGroup:
        """A group from :meth:`to_json`'s form; ValueError for anything else (hostile input)."""
        if not isinstance(value, Mapping) or set(value) - set(_KEYS):
            raise ValueError(f"not a layout: {str(value)[:80]!r}")

        def number(key: str, default: int) -> int:
            v = value.get(key, default)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{key} is not an integer: {str(v)[:40]!r}")
            return v

        layers = value.get("pp_layers", [])
        if not isinstance(layers, list) or len(layers) > MAX_PARALLEL_SIZE:
            raise ValueError("pp_layers is not a short list")
        if any(isinstance(n, bool) or not isinstance(n, int) for n in layers):
            raise ValueError("pp_layers holds something other than integers")
        group = cls(
            number("tp", 1), number("pp", 1), number("ep", 1), tuple(layers), number("vocab_pad", 0)
        )
        group.check()
        return group


@dataclass(frozen=True, slots=True)
class DeclaredLayout:
    """``--layout [MODEL=]SPEC``: the group, for one model or (``model`` None) every model."""

    model: str | None
    group: LayoutGroup

    def __str__(self) -> str:
        return f"{self.model}={self.group}" if self.model is not None else str(self.group)


def parse_group(spec: str) -> LayoutGroup:
    """``tp=2,pp=2,pp_layers=5+5,ep=1,vocab_pad=64`` (any order, ``tp`` required)."""
    fields: dict[str, str] = {}
    for part in spec.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or key not in _KEYS:
            raise ValueError(f"{part!r}: expected one of {', '.join(k + '=N' for k in _KEYS)}")
        if key in fields:
            raise ValueError(f"{key} given twice")
        fields[key] = value.strip()
    if "tp" not in fields:
        raise ValueError(f"{spec!r}: tp=N is required")

    def number(text: str, key: str) -> int:
        if not text.isdigit() or len(text) > 7:
            raise ValueError(f"{key}={text!r}: expected a whole number")
        return int(text)

    layers = fields.get("pp_layers", "")
    group = LayoutGroup(
        tp_size=number(fields["tp"], "tp"),
        pp_size=number(fields.get("pp", "1"), "pp"),
        ep_size=number(fields.get("ep", "1"), "ep"),
        pp_layers=tuple(number(n, "pp_layers") for n in layers.split("+")) if layers else (),
        vocab_pad=number(fields.get("vocab_pad", "0"), "vocab_pad"),
    )
    group.check()
    return group


def parse_declared(text: str) -> DeclaredLayout:
    """``[MODEL=]SPEC``: a leading ``NAME=`` whose NAME is not a layout key names the model."""
    name, sep, rest = text.partition("=")
    if sep and name.strip() not in _KEYS:
        if not name or "/" in name:
            raise ValueError(f"{text!r}: a model name before '=' has no '/' and is not empty")
        return DeclaredLayout(name, parse_group(rest))
    return DeclaredLayout(None, parse_group(text))
