"""Sharding rules as data: what each tensor name means for each kind of parallelism. Pure.

A :class:`RuleTable` is one architecture family's table, independent of any model:
name patterns mapped to a :class:`Rule`, plus which ``config.json`` fields hold the
head, expert and layer counts. Built-in tables (``builtin_rules``) and ``--rules``
files (``rules_file``) are both parsed from the same JSON-shaped documents.
:meth:`RuleTable.bind` reads those counts from one model's config and gives the
:class:`ArchRules` the planner uses.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from ..base.errors import ConfigError, RulesFileError
from ..base.patterns import Match, Pattern, compile_pattern
from .quant import QuantScheme, parse_quantization

#: Bound on remembered name matches per model (the largest checkpoints have ~100k tensors).
MAX_CACHED_MATCHES: Final = 1 << 20
#: Where the decoder-layer index sits in a tensor name, unless a table says otherwise.
DEFAULT_LAYER_PATTERN: Final = r"(?:^|\.)layers\.(?P<layer>\d+)\."


class Split(enum.Enum):
    """How tensor parallelism cuts a tensor (of a linear module ``[out, in]``)."""

    REPLICATED = "replicated"
    COLUMN = "column"  # output dim, equal blocks
    ROW = "row"  # input dim, equal blocks
    VOCAB = "vocab"  # output dim (the vocabulary), equal blocks
    Q_HEADS = "q_heads"  # output dim, whole query heads
    KV_HEADS = "kv_heads"  # output dim, whole kv heads (GQA replication past kv heads)
    O_HEADS = "o_heads"  # input dim, whole query heads
    QKV_HEADS = "qkv_heads"  # fused [q | k | v] output dim: each rank its q, k and v heads
    FUSED = "fused_column"  # fused [a | b | ...] output dim: each part split separately


class Stage(enum.Enum):
    """Which pipeline stage holds a tensor that lies outside the decoder layers."""

    FIRST = "first"
    LAST = "last"
    ALL = "all"
    #: The input embedding: first stage, and also the last when the checkpoint has no
    #: tensor under a ``head`` rule (tied embeddings: the last stage needs it as lm_head).
    EMBEDDING = "embedding"
    #: The output head: last stage; its presence means the embeddings are not tied.
    HEAD = "head"


class Experts(enum.Enum):
    """How a tensor belongs to experts, for expert parallelism."""

    INDEXED = "indexed"  # one tensor per expert; the index is the pattern's group "expert"
    STACKED = "stacked"  # dim 0 runs over the experts


@functools.lru_cache(maxsize=4096)
def compiled(pattern: str, source: str = "a sharding rules table") -> Pattern:
    """``pattern`` through the linear-time engine (``base.patterns``), compiled once.

    Tables are checked when parsed (``rules_file``), so this raises only for a table
    built by hand with a pattern no file could have carried.
    """
    return compile_pattern(pattern, source, lambda why: RulesFileError(source, f"pattern {why}"))


@dataclass(frozen=True, slots=True)
class Rule:
    pattern: str
    split: Split
    stage: Stage | None = None
    parts: int = 2  # FUSED only: how many equal parts the output dim concatenates
    experts: Experts | None = None
    #: Where the pattern came from ("FILE rules[3].match"), quoted if a name is refused.
    source: str = field(default="a sharding rules table", compare=False)

    def search(self, name: str) -> Match | None:
        return compiled(self.pattern, self.source).search(name)

    def matches(self, name: str) -> bool:
        return self.search(name) is not None


@dataclass(frozen=True, slots=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True, slots=True)
class ArchRules:
    """The rules that apply to one checkpoint: a family's table bound to its config."""

    family: str
    rules: tuple[Rule, ...]
    attention: AttentionShape | None
    num_experts: int | None = None
    num_layers: int | None = None
    layer_pattern: str = DEFAULT_LAYER_PATTERN
    quant: QuantScheme | None = None
    source: str = "built-in"
    #: name → first match, filled on use: every plan matches every tensor name, and a
    #: model's names and rules never change (a reload binds new ArchRules).
    _matches: dict[str, tuple[Rule, Match] | None] = field(
        default_factory=dict, compare=False, repr=False
    )

    def rule_for(self, name: str) -> tuple[Rule, Match] | None:
        """The first rule whose pattern matches ``name``, with its match."""
        if name in self._matches:
            return self._matches[name]
        found = None
        for rule in self.rules:
            m = rule.search(name)
            if m is not None:
                found = (rule, m)
                break
        if len(self._matches) < MAX_CACHED_MATCHES:
            self._matches[name] = found
        return found

    def split_for(self, name: str) -> Split | None:
        found = self.rule_for(name)
        return None if found is None else found[0].split

    def layer_of(self, name: str) -> int | None:
        m = compiled(self.layer_pattern).search(name)
        layer = None if m is None else m.group("layer")
        return None if layer is None else int(layer)


@dataclass(frozen=True, slots=True)
class AttentionFields:
    """The config.json keys holding the attention shape (HF names by default)."""

    num_heads: str = "num_attention_heads"
    num_kv_heads: str = "num_key_value_heads"
    head_dim: str = "head_dim"
    hidden_size: str = "hidden_size"


@dataclass(frozen=True, slots=True)
class RuleTable:
    family: str
    architectures: frozenset[str]
    model_types: frozenset[str]
    rules: tuple[Rule, ...]
    attention: AttentionFields | None = None
    #: config.json keys that may hold the expert count, first present wins (transformers
    #: v5 writes Qwen3-MoE's as ``num_local_experts``, the hub's configs ``num_experts``).
    experts_fields: tuple[str, ...] = ()
    layers_field: str = "num_hidden_layers"
    layer_pattern: str = DEFAULT_LAYER_PATTERN
    source: str = "built-in"

    def applies_to(self, config: Mapping[str, Any]) -> bool:
        archs = config.get("architectures")
        arch = archs[0] if isinstance(archs, list) and archs else None
        if arch is not None:
            return arch in self.architectures
        return config.get("model_type") in self.model_types

    def bind(self, config: Mapping[str, Any]) -> ArchRules:
        """Read this table's counts from ``config``; ConfigError names a bad field."""
        attention = None if self.attention is None else attention_shape(config, self.attention)
        experts = None
        if self.experts_fields:
            key = next((k for k in self.experts_fields if k in config), self.experts_fields[0])
            experts = positive_int(config, key)
        layers = config.get(self.layers_field)
        num_layers = None if layers is None else positive_int(config, self.layers_field)
        return ArchRules(
            family=self.family,
            rules=self.rules,
            attention=attention,
            num_experts=experts,
            num_layers=num_layers,
            layer_pattern=self.layer_pattern,
            quant=parse_quantization(config),
            source=self.source,
        )


def positive_int(config: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if value is None and default is not None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError("config.json", f"field {key!r} must be a positive integer, got {value!r}")
    return value


def attention_shape(config: Mapping[str, Any], fields: AttentionFields) -> AttentionShape:
    heads = positive_int(config, fields.num_heads)
    kv = positive_int(config, fields.num_kv_heads, heads)
    hidden = positive_int(config, fields.hidden_size)
    head_dim = positive_int(
        config, fields.head_dim, hidden // heads if hidden % heads == 0 else None
    )
    if heads % kv:
        raise ConfigError(
            "config.json",
            f"{fields.num_heads}={heads} is not a multiple of {fields.num_kv_heads}={kv}",
        )
    return AttentionShape(heads, kv, head_dim)
