"""``--layout`` specs and remembered layout files: what is accepted, what is refused. Pure."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from weightd.server.plan.declared import (
    DeclaredLayout,
    LayoutGroup,
    parse_declared,
    parse_group,
)
from weightd.server.plan.layout import Layout
from weightd.server.transports.layout_memory import (
    MAX_REMEMBERED,
    LayoutMemory,
    parse_memory,
    render_memory,
)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("tp=2", DeclaredLayout(None, LayoutGroup(2))),
        ("llama=tp=2,vocab_pad=64", DeclaredLayout("llama", LayoutGroup(2, vocab_pad=64))),
        ("m=tp=2,pp=2,pp_layers=5+3", DeclaredLayout("m", LayoutGroup(2, 2, 1, (5, 3)))),
        ("vocab_pad=64,tp=4", DeclaredLayout(None, LayoutGroup(4, vocab_pad=64))),
        ("m=tp=1,ep=4", DeclaredLayout("m", LayoutGroup(1, ep_size=4))),
    ],
)
def test_specs_that_parse(text: str, want: DeclaredLayout) -> None:
    got = parse_declared(text)
    assert got == want
    assert parse_declared(str(got)) == got  # str() gives the spec back


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "expected one of"),
        ("m=", "expected one of"),
        ("pp=2", "tp=N is required"),
        ("tp=0", "between 1 and"),
        ("tp=2,tp=4", "given twice"),
        ("tp=-1", "whole number"),
        ("tp=2,foo=1", "expected one of"),
        ("tp=2,pp=2,pp_layers=1+1+1", "lists 3 stages"),
        ("tp=64,pp=64", "at most 256"),
        ("tp=2,vocab_pad=99999999", "whole number"),
        ("a/b=tp=2", "no '/'"),
    ],
)
def test_specs_that_are_refused(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_declared(text)


def test_a_group_is_every_rank_of_its_deployment() -> None:
    group = parse_group("tp=2,pp=2,vocab_pad=64")
    assert group.ranks() == [Layout(2, t, 2, p, 1, 0, (), 64) for p in range(2) for t in range(2)]
    assert {LayoutGroup.of(layout) for layout in group.ranks()} == {group}


def _file(model: str, layouts: object, version: object = 1) -> bytes:
    return json.dumps({"version": version, "model": model, "layouts": layouts}).encode()


def test_a_remembered_file_round_trips() -> None:
    groups = [LayoutGroup(2, vocab_pad=64), LayoutGroup(1), LayoutGroup(2, 2, 1, (3, 1))]
    assert parse_memory(render_memory("m", groups), "m") == groups


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"\xff\xfe", "codec"),
        (b"{", "Expecting"),
        (b"[]", "version-1"),
        (_file("m", [], version=2), "version-1"),
        (_file("other", []), "for model"),
        (_file("m", {"tp": 2}), "not a list"),
        (_file("m", [{"tp": 2, "evil": 1}]), "not a layout"),
        (_file("m", [{"tp": True}]), "not an integer"),
        (_file("m", [{"tp": 0}]), "between 1 and"),
        (_file("m", [{"tp": 1, "pp_layers": "abc"}]), "short list"),
        (_file("m", [{"tp": 1, "pp_layers": [1.5]}]), "other than integers"),
        (b'{"version": 1, "version": 1, "model": "m", "layouts": []}', "twice"),
        (b'{"version": 1, "model": "m", "layouts": [{"tp": NaN}]}', "not a number"),
        (b"[" * 30000 + b"]" * 30000, "nested too deep"),
        (b'{"version": 1, "model": "m", "layouts": [' + b'{"a":' * 20000, "too deep"),
        (_file("m", [{"tp": 1}]).replace(b"}]}", b'}], "asked": [1, 2]}'), "as long as"),
        (_file("m", [{"tp": 1}]).replace(b"}]}", b'}], "asked": ["x"]}'), "not a time"),
    ],
)
def test_hostile_remembered_files_are_refused(data: bytes, match: str) -> None:
    with pytest.raises((ValueError, UnicodeDecodeError), match=match):
        parse_memory(data, "m")


def test_a_remembered_file_is_bounded_and_deduplicated() -> None:
    many = [{"tp": n} for n in range(1, 40)] + [{"tp": 1}]
    got = parse_memory(_file("m", many), "m")
    assert got == [LayoutGroup(n) for n in range(1, MAX_REMEMBERED + 1)]


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_remembered_layouts_not_asked_for_are_forgotten(tmp_path: Path) -> None:
    """A layout nobody asked for within ``forget_after`` is no longer built (issue 48:
    one mistaken fetch is not rebuilt at every start forever); asking again keeps one."""
    clock = Clock()
    day = 24 * 3600.0
    memory = LayoutMemory(str(tmp_path), forget_after=7 * day, clock=clock)
    memory.remember("m", LayoutGroup(4))  # the mistaken one
    clock.now += 3 * day
    memory.remember("m", LayoutGroup(2))  # the engine's
    later = LayoutMemory(str(tmp_path), forget_after=7 * day, clock=clock)  # a restart
    assert later.read("m") == [LayoutGroup(2), LayoutGroup(4)]
    clock.now += 5 * day
    later.remember("m", LayoutGroup(2))  # the engine asks again
    assert LayoutMemory(str(tmp_path), 7 * day, clock).read("m") == [LayoutGroup(2)]
    assert LayoutMemory(str(tmp_path), 0.0, clock).read("m") == [LayoutGroup(2), LayoutGroup(4)]
    # a file from before the field: kept, as asked now
    (tmp_path / os.path.basename(memory.path("old"))).write_bytes(_file("old", [{"tp": 2}]))
    assert LayoutMemory(str(tmp_path), 7 * day, clock).read("old") == [LayoutGroup(2)]
