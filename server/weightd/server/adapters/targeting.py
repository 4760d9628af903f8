r"""Where PEFT puts a LoRA pair, and with which ``r`` and ``lora_alpha``: its rules, exactly. Pure.

A worker applies what weightd serves, so weightd must serve a pair exactly where
``PeftModel.from_pretrained`` would create one. These are PEFT's own rules (0.21:
``tuners_utils.check_target_module_exists`` and ``utils.other.get_pattern_key``),
checked against them by ``tests/adapters/test_peft_targeting.py``:

1. ``exclude_modules`` first: a regex (``fullmatch``) or names; a module excluded
   gets no pair whatever ``target_modules`` says.
2. ``target_modules`` as a regex: ``fullmatch`` of the module's dotted name (and
   ``layers_to_transform`` is refused with it, as ``LoraConfig`` refuses it).
3. ``target_modules`` as names: the module is one of them (no layer check then), or
   ends with ``"." + name``, and then, if ``layers_to_transform`` is set (an int or a
   non-empty list), its layer index (the first ``<layers_pattern>.<n>.`` in the name,
   or the first ``.<n>.`` after two components without a pattern) must be listed.
4. ``rank_pattern``/``alpha_pattern``: the first key, in the file's order, with
   ``re.match(rf"(.*\.)?({key})$", module)`` gives the value; else ``r``/``lora_alpha``.

Every regex goes through :mod:`weightd.server.base.patterns` (linear time). A name
list is matched by looking each dot-suffix of the module up in a set, so a config
listing 60,000 names costs a few lookups per module, not 60,000 comparisons.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from ..base.errors import WeightdError
from ..base.patterns import Pattern, compile_pattern

#: PEFT's layer index without ``layers_pattern`` (lazy: the first index, not an expert's).
DEFAULT_LAYER_REGEX: Final = r".*?\.[^.]*\.(?P<idx>\d+)\."


def layer_regex(layers_pattern: str) -> str:
    """PEFT's layer-index expression around one ``layers_pattern`` entry (not escaped)."""
    return rf"(?:^|.*?\.){layers_pattern}\.(?P<idx>\d+)\."


def pattern_key_regex(key: str) -> str:
    """PEFT's expression for a ``rank_pattern``/``alpha_pattern`` key."""
    return rf"(.*\.)?({key})$"


@dataclass(frozen=True, slots=True)
class Names:
    """A list field: a module matches when it is an entry or ends with ``"." + entry``."""

    entries: frozenset[str]

    def matches(self, module: str) -> bool:
        if module in self.entries:
            return True
        dot = module.find(".")
        while dot != -1:
            if module[dot + 1 :] in self.entries:
                return True
            dot = module.find(".", dot + 1)
        return False


@dataclass(frozen=True, slots=True)
class Keyed:
    """``rank_pattern`` or ``alpha_pattern``: keys in the file's order, first match wins."""

    entries: tuple[tuple[str, Pattern, Any], ...] = ()

    def value_for(self, module: str, default: Any) -> Any:
        for _key, pattern, value in self.entries:
            if pattern.match(module) is not None:
                return value
        # PEFT's fallback: with no key matching, the module's own name is looked up as a
        # key (a key such as "a+b" does not match the module "a+b" as a regex, but is it).
        for key, _pattern, value in self.entries:
            if key == module:
                return value
        return default


@dataclass(frozen=True, slots=True)
class Targeting:
    """Which modules PEFT gives a LoRA pair (``exclude_modules``, ``target_modules``,
    ``layers_to_transform``, ``layers_pattern`` together)."""

    targets: Names | Pattern
    exclude: Names | Pattern | None = None
    #: None: every layer (``layers_to_transform`` unset, or an empty list).
    layers: frozenset[int] | None = None
    #: The ``layers_pattern`` expressions; empty: PEFT's default.
    layer_patterns: tuple[Pattern, ...] = ()
    default_layer: Pattern | None = None

    def why_not(self, module: str) -> str | None:
        """None when PEFT puts a pair on ``module``; else why not, naming the field."""
        if self.exclude is not None:
            hit = (
                self.exclude.fullmatch(module)
                if isinstance(self.exclude, Pattern)
                else self.exclude.matches(module)
            )
            if hit:
                return "is excluded by exclude_modules"
        if isinstance(self.targets, Pattern):
            if self.targets.fullmatch(module) is None:
                return "is not matched by target_modules (a regex)"
            return None
        if module in self.targets.entries:
            return None  # named in full: PEFT skips the layer check
        if not self.targets.matches(module):
            return "is not in target_modules"
        if self.layers is None:
            return None
        layer = self.layer_of(module)
        if layer is None:
            return "has no layer index in its name, and layers_to_transform is set"
        if layer not in self.layers:
            shown = sorted(self.layers)[:16]
            return f"is in layer {layer}, which layers_to_transform {shown} does not list"
        return None

    def layer_of(self, module: str) -> int | None:
        """The layer index PEFT reads from ``module`` for ``layers_to_transform``."""
        found = None
        if not self.layer_patterns:
            assert self.default_layer is not None
            found = self.default_layer.match(module)
        for p in self.layer_patterns:
            found = p.match(module)
            if found is not None:
                break
        idx = None if found is None else found.group("idx")
        return None if idx is None else int(idx)


def compile_field(
    pattern: str, path: str, field: str, error: Callable[[str, str], WeightdError]
) -> Pattern:
    """Compile a config field's regex; ``error(path, problem)`` names the file and field."""
    return compile_pattern(
        pattern, f"{path} field {field!r}", lambda why: error(path, f"field {field!r}: {why}")
    )
