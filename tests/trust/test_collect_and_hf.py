"""``weightd verify`` lists every problem it can find; a Hugging Face cache snapshot is a
trust source only when asked for, and then verifies and serves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.trust import craft
from tests.trust.corpus import hf_snapshot
from weightd.server.base.errors import (
    DataSectionError,
    HeaderSyntaxError,
    MissingTensorError,
    PathEscapeError,
    TensorShapeError,
)
from weightd.server.cli import main as cli
from weightd.server.registry.models import load_model
from weightd.server.trust.verify import VerifyOptions, verify_checkpoint


def test_verify_collects_every_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = craft.write_checkpoint(tmp_path / "m")
    # both shards broken, differently: both reported
    (d / craft.SHARD1).write_bytes(craft.encode("{oops", b""))
    good2 = (d / craft.SHARD2).read_bytes()
    (d / craft.SHARD2).write_bytes(good2[:-3])
    v = verify_checkpoint(str(d), None, VerifyOptions(progress=False))
    v.store.close()
    assert [type(p) for p in v.problems] == [HeaderSyntaxError, DataSectionError]
    assert "digests not computed" in v.notes[-1]
    # shard 2 transposed, shard 1 lacking a tensor, config asking for a second layer
    tensors = [
        (n, t, (8, 4) if n.endswith("down_proj.weight") else s)
        for n, t, s in craft.shard_tensors(craft.SHARD2)
    ]
    craft.put_shard(d, craft.SHARD2, tensors)
    # every layout problem is listed, not only the first
    craft.put_shard(d, craft.SHARD1, craft.shard_tensors(craft.SHARD1)[:-1])
    config = dict(craft.CONFIG, num_hidden_layers=2)
    (d / "config.json").write_text(json.dumps(config))
    v = verify_checkpoint(str(d), None, VerifyOptions(progress=False))
    v.store.close()
    kinds = [type(p) for p in v.problems]
    assert TensorShapeError in kinds and kinds.count(MissingTensorError) == 10
    assert cli.main(["verify", str(d)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert len([line for line in out if line.startswith("problem: ")]) == len(v.problems)
    assert out[-1] == f"FAILED: {len(v.problems)} problems"
    assert cli.main(["verify", str(d), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [p["type"] for p in report["problems"]] == [k.__name__ for k in kinds]
    assert all(p["file"].startswith(str(d)) for p in report["problems"])


def test_hf_snapshot_verifies_and_loads_only_in_that_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    snap = hf_snapshot(tmp_path)
    plain = verify_checkpoint(str(snap), None, VerifyOptions(progress=False))
    plain.store.close()
    assert type(plain.problems[0]) is PathEscapeError  # links leave the directory
    options = VerifyOptions(trust_hf_cache=True, progress=False)
    v = verify_checkpoint(str(snap), None, options)
    v.store.close()
    assert v.ok, [str(p) for p in v.problems]
    assert v.trust == [
        f"Hugging Face cache blobs of {tmp_path}/hub/models--org--tiny @ {snap.name}"
    ]
    model = load_model(str(snap), "tiny", options=options)
    try:
        t = model.checkpoint.tensors["model.norm.weight"]
        assert model.store.read_exact(t.shard, t.offset, t.nbytes) == craft.payload(t.name, 16)
    finally:
        model.store.close()
    assert cli.main(["verify", str(snap), "--trust-hf-cache"]) == 0
    assert "OK: every check holds" in capsys.readouterr().out
