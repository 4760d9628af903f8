r"""Rules tables from JSON documents: ``weightd serve --rules FILE`` and the built-ins.

A rules file describes one architecture family; the built-in tables are written in
the same shape and parsed by the same code, so a user's table can do anything a
built-in one does. Example (every key except ``family``, ``rules`` and one of
``architectures``/``model_types`` is optional)::

    {
      "family": "my-llama",
      "architectures": ["MyLlamaForCausalLM"],
      "model_types": ["my_llama"],
      "attention": {"num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
                    "head_dim": "head_dim", "hidden_size": "hidden_size"},
      "experts": {"count": ["num_local_experts", "num_experts"]},
      "layers": {"count": "num_hidden_layers", "pattern": "(?:^|\\.)layers\\.(?P<layer>\\d+)\\."},
      "rules": [
        {"match": "\\.q_proj\\.weight$", "split": "q_heads"},
        {"match": "\\.experts\\.(?P<expert>\\d+)\\.w1\\.weight$", "split": "column"},
        {"match": "(^|\\.)embed_tokens\\.weight$", "split": "vocab", "stage": "embedding"}
      ]
    }

Rules are tried in order; the first whose ``match`` (a Python regex, searched) fits a
tensor name applies. Patterns are matched by the linear-time engine of
:mod:`weightd.server.base.patterns` (a file's pattern must not be able to stall the
daemon), which refuses backreferences, lookaround and repeats over ``{1000}``.
Everything is checked here, at start-up: unknown keys, bad regexes, splits that need
head counts in a table without ``attention``, expert rules without ``experts``. Each
error names the file and the rule's index.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from ..base.errors import RulesFileError
from ..base.patterns import Pattern, compile_pattern
from .rules import DEFAULT_LAYER_PATTERN, AttentionFields, Experts, Rule, RuleTable, Split, Stage

MAX_RULES_BYTES: Final = 1 << 20
HEAD_SPLITS: Final = frozenset({Split.Q_HEADS, Split.KV_HEADS, Split.O_HEADS, Split.QKV_HEADS})
_TABLE_KEYS: Final = frozenset(
    {"family", "architectures", "model_types", "attention", "experts", "layers", "rules"}
)
_RULE_KEYS: Final = frozenset({"match", "split", "stage", "parts", "experts"})


def _strings(path: str, doc: Mapping[str, Any], key: str) -> frozenset[str]:
    value = doc.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise RulesFileError(path, f"{key!r} must be a list of non-empty strings")
    return frozenset(value)


def _object(path: str, doc: Mapping[str, Any], key: str, allowed: frozenset[str]) -> dict[str, str]:
    value = doc.get(key)
    if not isinstance(value, dict):
        raise RulesFileError(path, f"{key!r} must be an object")
    for k, v in value.items():
        if k not in allowed:
            raise RulesFileError(
                path, f"{key}.{k}: unknown key (known: {', '.join(sorted(allowed))})"
            )
        if not isinstance(v, str) or not v:
            raise RulesFileError(path, f"{key}.{k} must be a non-empty string")
    return dict(value)


def _regex(path: str, where: str, pattern: object) -> Pattern:
    """Compile a table's pattern with the linear-time engine, or say why not (file, field)."""
    if not isinstance(pattern, str) or not pattern:
        raise RulesFileError(path, f"{where} must be a non-empty regex string")
    return compile_pattern(
        pattern, f"{path} {where}", lambda why: RulesFileError(path, f"{where} {why}")
    )


def _enum(
    path: str, where: str, value: object, kind: type[Split] | type[Stage] | type[Experts]
) -> Any:
    names = [m.value for m in kind]
    if not isinstance(value, str) or value not in names:
        raise RulesFileError(path, f"{where} is {value!r}; expected one of {', '.join(names)}")
    return kind(value)


def _rule(path: str, i: int, doc: object, has_attention: bool, has_experts: bool) -> Rule:
    where = f"rules[{i}]"
    if not isinstance(doc, dict):
        raise RulesFileError(path, f"{where} must be an object")
    for k in doc:
        if k not in _RULE_KEYS:
            raise RulesFileError(
                path, f"{where}.{k}: unknown key (known: {', '.join(sorted(_RULE_KEYS))})"
            )
    compiled = _regex(path, f"{where}.match", doc.get("match"))
    split = _enum(path, f"{where}.split", doc.get("split"), Split)
    stage = None if doc.get("stage") is None else _enum(path, f"{where}.stage", doc["stage"], Stage)
    parts = doc.get("parts", 2)
    if "parts" in doc and split is not Split.FUSED:
        raise RulesFileError(path, f"{where}.parts applies only to split 'fused_column'")
    if not isinstance(parts, int) or isinstance(parts, bool) or not 2 <= parts <= 64:
        raise RulesFileError(path, f"{where}.parts must be an integer from 2 to 64, got {parts!r}")
    grouped = "expert" in compiled.groupindex
    experts: Experts | None = Experts.INDEXED if grouped else None
    if doc.get("experts") is not None:
        experts = _enum(path, f"{where}.experts", doc["experts"], Experts)
        if (experts is Experts.INDEXED) != grouped:
            raise RulesFileError(
                path,
                f"{where}: experts 'indexed' needs a (?P<expert>...) group in match, and "
                "'stacked' must not have one",
            )
    if experts is not None and not has_experts:
        raise RulesFileError(path, f"{where} is an expert rule but the table has no 'experts'")
    if split in HEAD_SPLITS and not has_attention:
        raise RulesFileError(
            path, f"{where}.split {split.value!r} needs head counts: the table has no 'attention'"
        )
    return Rule(compiled.text, split, stage, parts, experts, compiled.source)


def parse_table(doc: object, path: str) -> RuleTable:
    """Check a rules document completely and build its table."""
    if not isinstance(doc, dict):
        raise RulesFileError(path, "a rules table must be a JSON object")
    for k in doc:
        if k not in _TABLE_KEYS:
            raise RulesFileError(
                path, f"{k}: unknown key (known: {', '.join(sorted(_TABLE_KEYS))})"
            )
    family = doc.get("family")
    if not isinstance(family, str) or not family:
        raise RulesFileError(path, "'family' must be a non-empty string")
    archs = _strings(path, doc, "architectures")
    types = _strings(path, doc, "model_types")
    if not archs and not types:
        raise RulesFileError(path, "name the 'architectures' (or 'model_types') the table is for")
    attention = None
    if doc.get("attention") is not None:
        fields = _object(path, doc, "attention", frozenset(AttentionFields.__slots__))
        attention = AttentionFields(**fields)
    experts_fields: tuple[str, ...] = ()
    if doc.get("experts") is not None:
        experts = doc["experts"]
        if not isinstance(experts, dict) or set(experts) != {"count"}:
            raise RulesFileError(path, "'experts' must be an object with just 'count'")
        count = experts["count"]
        keys = [count] if isinstance(count, str) else count
        if (
            not isinstance(keys, list)
            or not keys
            or not all(isinstance(k, str) and k for k in keys)
        ):
            raise RulesFileError(
                path, "experts.count must name the config field (or list the fields) to read"
            )
        experts_fields = tuple(keys)
    layers_field, layer_pattern = "num_hidden_layers", DEFAULT_LAYER_PATTERN
    if doc.get("layers") is not None:
        layers = _object(path, doc, "layers", frozenset({"count", "pattern"}))
        layers_field = layers.get("count", layers_field)
        compiled = _regex(path, "layers.pattern", layers.get("pattern", layer_pattern))
        layer_pattern = compiled.text
        if "layer" not in compiled.groupindex:
            raise RulesFileError(path, "layers.pattern needs a (?P<layer>...) group")
    raw_rules = doc.get("rules")
    if not isinstance(raw_rules, list) or not raw_rules:
        raise RulesFileError(path, "'rules' must be a non-empty list")
    rules = tuple(
        _rule(path, i, r, attention is not None, bool(experts_fields))
        for i, r in enumerate(raw_rules)
    )
    return RuleTable(
        family=family,
        architectures=archs,
        model_types=types,
        rules=rules,
        attention=attention,
        experts_fields=experts_fields,
        layers_field=layers_field,
        layer_pattern=layer_pattern,
        source=path,
    )


def load_rules_file(path: str) -> RuleTable:
    """Read and check one rules file (strict JSON: no duplicate keys, no NaN)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_RULES_BYTES + 1)
    except OSError as exc:
        raise RulesFileError(path, f"cannot read: {exc.strerror}") from None
    if len(raw) > MAX_RULES_BYTES:
        raise RulesFileError(path, f"larger than the {MAX_RULES_BYTES}-byte limit")

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise RulesFileError(path, f"duplicate key {key!r}")
            out[key] = value
        return out

    def constant(token: str) -> Any:
        raise RulesFileError(path, f"non-finite number {token} is not valid JSON")

    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=hook, parse_constant=constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        # RecursionError: nesting deeper than the parser's stack, one line like the rest.
        raise RulesFileError(path, f"not valid JSON: {exc}") from None
    return parse_table(doc, path)
