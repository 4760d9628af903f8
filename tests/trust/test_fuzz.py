"""Property tests: mutated real headers, indexes, configs and manifests make the
parsers raise weightd's typed errors and nothing else (no KeyError, TypeError,
OverflowError, RecursionError ... escaping), and never hang.

Inputs start from real files: shards written by the ``safetensors`` library (with a
scalar, a zero-size tensor, BF16 and a sub-byte dtype among them), an index and
config written by ``transformers``-style code, a manifest written by weightd. The
runs are bounded and derandomized for CI; ``WEIGHTD_FUZZ_EXAMPLES=N`` runs more.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.trust import craft
from tests.trust.corpus import manifest_of
from weightd.server.base.errors import WeightdError
from weightd.server.checkpoint.config_check import check_layout
from weightd.server.checkpoint.description import cross_check, parse_config, parse_index
from weightd.server.checkpoint.header import header_length, parse_header
from weightd.server.trust.manifest import parse_manifest
from weightd.server.trust.verify import VerifyOptions, verify_checkpoint

EXAMPLES = int(os.environ.get("WEIGHTD_FUZZ_EXAMPLES", "300"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def _real_shard() -> bytes:
    import torch
    from safetensors.torch import save

    tensors = {
        "model.embed_tokens.weight": torch.randn(6, 4).to(torch.bfloat16),
        "model.norm.weight": torch.ones(4),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "ids": torch.arange(5, dtype=torch.int64),
    }
    return save(tensors, metadata={"format": "pt"})


SHARD = _real_shard()
_HLEN = struct.unpack("<Q", SHARD[:8])[0]
HEADER = SHARD[8 : 8 + _HLEN]
DATA = SHARD[8 + _HLEN :]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value inside a JSON document (for picking what to mutate)."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def mutated_json(draw: st.DrawFn, doc: Any) -> str:
    """``doc`` with a few structural mutations, serialized (sometimes with raw edits)."""
    doc = json.loads(json.dumps(doc))
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(doc)
        path = draw(st.sampled_from(paths))
        op = draw(st.sampled_from(["replace", "delete", "insert", "rename"]))
        if not path:
            if op == "replace":
                doc = draw(json_values)
            continue
        parent = doc
        for p in path[:-1]:
            parent = parent[p]
        key = path[-1]
        if op == "replace":
            parent[key] = draw(json_values)
        elif op == "delete":
            del parent[key]
        elif op == "insert" and isinstance(parent, dict):
            parent[draw(st.text(max_size=10))] = draw(json_values)
        elif op == "insert" and isinstance(parent, list):
            parent.insert(key, draw(json_values))
        elif op == "rename" and isinstance(parent, dict):
            parent[draw(st.text(max_size=10))] = parent.pop(key)
    text = json.dumps(doc, allow_nan=True)
    if draw(st.booleans()) and len(text) > 2:
        # a raw textual edit too: duplicate a member, or splice bytes in
        i = draw(st.integers(0, len(text) - 1))
        j = draw(st.integers(i, min(len(text), i + 40)))
        text = (
            text[:i]
            + draw(st.sampled_from([text[i:j] * 2, "", "NaN", '"\\u0000"', "}"]))
            + text[j:]
        )
    return text


OUTCOMES: dict[str, int] = {}


def _only_weightd_errors(fn: Any, *args: Any) -> None:
    """Run ``fn``; a WeightdError is fine, anything else fails the test (by escaping)."""
    try:
        fn(*args)
        outcome = "ok"
    except WeightdError as exc:
        outcome = type(exc).__name__
    OUTCOMES[outcome] = OUTCOMES.get(outcome, 0) + 1


@FUZZ
@given(
    edits=st.lists(
        st.tuples(st.integers(0, 8 + _HLEN + 16), st.integers(0, 255), st.sampled_from("rid")),
        min_size=1,
        max_size=6,
    )
)
def test_byte_mutations_of_a_real_shard(edits: list[tuple[int, int, str]]) -> None:
    raw = bytearray(SHARD)
    for where, byte, op in edits:
        pos = min(where, len(raw) - 1)
        if op == "r":
            raw[pos] = byte
        elif op == "i":
            raw.insert(pos, byte)
        else:
            del raw[pos]
    blob = bytes(raw)

    def parse() -> None:
        length = header_length("s.safetensors", blob[:8], len(blob))
        parse_header("s.safetensors", blob[8 : 8 + length], len(blob))

    _only_weightd_errors(parse)


@FUZZ
@given(text=mutated_json(json.loads(HEADER)))
def test_structural_mutations_of_a_real_header(text: str) -> None:
    raw = text.encode("utf-8", "surrogatepass")
    raw += b" " * (-len(raw) % 8)
    size = 8 + len(raw) + len(DATA)
    _only_weightd_errors(parse_header, "s.safetensors", raw, size)


@pytest.fixture(scope="module")
def real_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return craft.write_checkpoint(tmp_path_factory.mktemp("fuzz") / "model")


def _headers(d: Path) -> dict[str, Any]:
    from weightd.server.checkpoint.scan import read_header
    from weightd.server.store.shards import ShardStore

    store = ShardStore(str(d))
    try:
        return {s: read_header(store, s) for s in (craft.SHARD1, craft.SHARD2)}
    finally:
        store.close()


INDEX_DOC = {
    "metadata": {"total_size": 880},
    "weight_map": {n: s for n, (s, _) in craft.PARAMS.items()},
}


@FUZZ
@given(text=mutated_json(INDEX_DOC))
def test_mutated_indexes(real_checkpoint: Path, text: str) -> None:
    headers = _headers(real_checkpoint)

    def check() -> None:
        weight_map, metadata = parse_index(
            str(real_checkpoint), text.encode("utf-8", "surrogatepass")
        )
        present = {k: v for k, v in headers.items() if k in set(weight_map.values())}
        cross_check(str(real_checkpoint), weight_map, present, metadata)

    _only_weightd_errors(check)


@FUZZ
@given(text=mutated_json(craft.CONFIG))
def test_mutated_configs(real_checkpoint: Path, text: str) -> None:
    from weightd.server.checkpoint.scan import scan_checkpoint

    scan = scan_checkpoint(str(real_checkpoint))
    scan.store.close()
    assert scan.checkpoint is not None

    def check() -> None:
        config = parse_config("config.json", text.encode("utf-8", "surrogatepass"))
        check_layout(str(real_checkpoint), config, scan.checkpoint.tensors)  # type: ignore[union-attr]

    _only_weightd_errors(check)


@pytest.fixture(scope="module")
def manifest_doc(real_checkpoint: Path) -> dict[str, Any]:
    return manifest_of(real_checkpoint)


@FUZZ
@given(data=st.data())
def test_mutated_manifests(manifest_doc: dict[str, Any], data: st.DataObject) -> None:
    text = data.draw(mutated_json(manifest_doc))
    _only_weightd_errors(parse_manifest, "/m/manifest.json", text.encode("utf-8", "surrogatepass"))


@settings(FUZZ, max_examples=max(20, EXAMPLES // 10))
@given(
    edits=st.lists(st.tuples(st.integers(0, 1 << 12), st.integers(0, 255)), min_size=1, max_size=4)
)
def test_verify_never_raises_on_mutated_files(
    tmp_path_factory: pytest.TempPathFactory, edits: list[tuple[int, int]]
) -> None:
    """The whole pipeline on disk: problems are reported, never raised."""
    d = craft.write_checkpoint(tmp_path_factory.mktemp("onfile") / "model")
    raw = bytearray((d / craft.SHARD2).read_bytes())
    for pos, byte in edits:
        raw[pos % len(raw)] = byte
    (d / craft.SHARD2).write_bytes(bytes(raw))
    v = verify_checkpoint(str(d), None, VerifyOptions(progress=False))
    v.store.close()
    assert all(isinstance(p, WeightdError) for p in v.problems)
