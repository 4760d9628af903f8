"""Rules files: the built-in tables' own format, checked completely at start-up."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from tests.layouts.fakes import fake_checkpoint
from tests.layouts.specs import VARIANTS
from weightd.server.base.errors import RulesFileError
from weightd.server.plan.builtin_rules import BUILTIN_DOCS, LLAMA_DOC, MIXTRAL_DOC, rules_for
from weightd.server.plan.layout import Layout, every_rank
from weightd.server.plan.planner import plan
from weightd.server.plan.rules import Experts, Split, Stage
from weightd.server.plan.rules_file import load_rules_file, parse_table


def doc(**over: Any) -> dict[str, Any]:
    d = copy.deepcopy(LLAMA_DOC)
    d["family"], d["architectures"], d["model_types"] = "mine", ["MineForCausalLM"], []
    d.update(over)
    return {k: v for k, v in d.items() if v is not None}


def rule(**over: Any) -> dict[str, Any]:
    return {"match": r"\.w$", "split": "column", **over}


BAD = [
    ([], "a rules table must be a JSON object"),
    (doc(extra=1), "extra: unknown key"),
    (doc(family=""), "'family' must be a non-empty string"),
    (doc(architectures=[], model_types=[]), "name the 'architectures'"),
    (doc(architectures="X"), "'architectures' must be a list"),
    (doc(attention=[]), "'attention' must be an object"),
    (doc(attention={"heads": "n"}), "attention.heads: unknown key"),
    (doc(attention={"num_heads": 3}), "attention.num_heads must be a non-empty string"),
    (doc(experts={"count": 4}), "experts.count must name the config field"),
    (doc(experts={"count": "n", "x": 1}), "'experts' must be an object with just 'count'"),
    (doc(layers={"pattern": r"layers\.(\d+)"}), "layers.pattern needs a (?P<layer>...) group"),
    (doc(layers={"pattern": "("}), "layers.pattern '(' is not a valid regex"),
    (doc(rules=[]), "'rules' must be a non-empty list"),
    (doc(rules=["x"]), "rules[0] must be an object"),
    (doc(rules=[rule(), rule(what=1)]), "rules[1].what: unknown key"),
    (doc(rules=[rule(match="[")]), "rules[0].match '[' is not a valid regex"),
    (doc(rules=[rule(match="")]), "rules[0].match must be a non-empty regex string"),
    # Patterns run on the linear-time engine: what it cannot run is refused (#15 item 1).
    (doc(rules=[rule(), rule(match=r"(?=q)\.w$")]), "rules[1].match '(?=q)\\\\.w$' cannot be"),
    (doc(rules=[rule(match=r"(\w)\1")]), "uses numeric escape"),
    (doc(rules=[rule(match="a{4294967296}")]), "is not a valid regex"),
    (doc(layers={"pattern": r"layers\.(?P<layer>\d{1,2000})\."}), "layers.pattern"),
    (
        doc(rules=[rule(split="colum")]),
        "rules[0].split is 'colum'; expected one of replicated, column",
    ),
    (doc(rules=[rule(stage="middle")]), "rules[0].stage is 'middle'; expected one of first"),
    (doc(rules=[rule(parts=3)]), "rules[0].parts applies only to split 'fused_column'"),
    (doc(rules=[rule(split="fused_column", parts=1)]), "rules[0].parts must be an integer from 2"),
    (doc(rules=[rule(split="fused_column", parts=True)]), "rules[0].parts must be an integer"),
    (doc(rules=[rule(match=r"\.experts\.(?P<expert>\d+)\.w$")]), "rules[0] is an expert rule"),
    (
        doc(experts={"count": "n"}, rules=[rule(experts="indexed")]),
        "experts 'indexed' needs a (?P<expert>...) group",
    ),
    (
        doc(experts={"count": "n"}, rules=[rule(match=r"(?P<expert>\d+)", experts="stacked")]),
        "'stacked' must not have one",
    ),
    (
        doc(attention=None, rules=[rule(split="kv_heads")]),
        "rules[0].split 'kv_heads' needs head counts",
    ),
]


@pytest.mark.parametrize(("document", "needle"), BAD, ids=[b[1][:40] for b in BAD])
def test_bad_tables_name_the_key(document: object, needle: str) -> None:
    with pytest.raises(RulesFileError) as info:
        parse_table(document, "mine.json")
    assert str(info.value).startswith("mine.json: ")
    assert needle in str(info.value), str(info.value)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('{"family": "a", "family": "b"}', "duplicate key 'family'"),
        ('{"family": NaN}', "non-finite number NaN"),
        ("{", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
    ],
)
def test_bad_files(tmp_path: Path, text: str | bytes, needle: str) -> None:
    path = tmp_path / "rules.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(RulesFileError, match=needle):
        load_rules_file(str(path))
    with pytest.raises(RulesFileError, match="cannot read"):
        load_rules_file(str(tmp_path / "missing.json"))


def test_builtin_docs_are_rules_files(tmp_path: Path) -> None:
    """Each built-in table, written out as a file and read back, is the same table."""
    for d in BUILTIN_DOCS:
        path = tmp_path / f"{d['family']}.json"
        path.write_text(json.dumps(d))
        table = load_rules_file(str(path))
        builtin = parse_table(d, "x")
        assert table.rules == builtin.rules and table.architectures == builtin.architectures


def test_rule_fields_parse() -> None:
    t = parse_table(MIXTRAL_DOC, "built-in")
    kinds = {(r.split, r.stage, r.experts) for r in t.rules}
    assert (Split.VOCAB, Stage.EMBEDDING, None) in kinds
    assert (Split.COLUMN, None, Experts.INDEXED) in kinds
    assert (Split.FUSED, None, Experts.STACKED) in kinds


def test_a_user_table_serves_an_unknown_architecture_like_the_builtin(tmp_path: Path) -> None:
    c, s = VARIANTS["llama"]
    mine = {**c, "architectures": ["MineForCausalLM"]}
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(doc()))
    tables = [load_rules_file(str(path))]
    assert rules_for(mine) is None
    bound = rules_for(mine, tables)
    assert bound is not None and bound.family == "mine" and bound.source == str(path)
    fake = fake_checkpoint(c, s)
    for lay in every_rank(2, 3):
        assert plan(fake.ckpt, bound, lay) == plan(fake.ckpt, rules_for(c), lay)


def test_user_tables_come_before_builtins(tmp_path: Path) -> None:
    """A user may replace a built-in table: here every Llama tensor is replicated."""
    c, s = VARIANTS["llama"]
    mine = doc(architectures=["LlamaForCausalLM"], rules=[{"match": ".", "split": "replicated"}])
    bound = rules_for(c, [parse_table(mine, "mine.json")])
    assert bound is not None and bound.family == "mine"
    fake = fake_checkpoint(c, s)
    assert all(x.replicated for x in plan(fake.ckpt, bound, Layout(4, 1)).slices)


def test_a_rule_refuses_a_name_it_would_read_differently_naming_its_file() -> None:
    """Python's \\d matches non-ASCII digits and RE2's does not: such a name is refused,
    quoting the file and rule, rather than matched differently (#15 item 1)."""
    from weightd.server.base.errors import UnmatchableName

    table = parse_table(doc(rules=[rule(match=r"\.w\d$")]), "mine.json")
    assert table.rules[0].search("layer.w1") is not None
    with pytest.raises(UnmatchableName, match=r"from mine\.json rules\[0\]\.match"):
        table.rules[0].search("layer.w\u0661")
