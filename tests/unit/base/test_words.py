"""Counts in messages (issue #39: verify said "1 shards")."""

from __future__ import annotations

from pathlib import Path

import pytest

from weightd.server.base.words import count


@pytest.mark.parametrize(
    ("n", "noun", "said"),
    [(0, "shard", "0 shards"), (1, "shard", "1 shard"), (2, "tensor", "2 tensors")],
)
def test_count(n: int, noun: str, said: str) -> None:
    assert count(n, noun) == said
    assert count(1, "index", "indices") == "1 index" and count(3, "index", "indices") == "3 indices"


def test_verify_of_a_one_shard_checkpoint_says_1_shard(tmp_path: Path) -> None:
    from weightd.server.cli.demo import DEMO_CONFIG, write_llama_checkpoint
    from weightd.server.cli.trust_commands import _report_text
    from weightd.server.trust.verify import VerifyOptions, verify_checkpoint

    model = tmp_path / "m"
    write_llama_checkpoint(str(model), dict(DEMO_CONFIG, num_hidden_layers=1), shards=1)
    v = verify_checkpoint(str(model), options=VerifyOptions(progress=False))
    try:
        text = "\n".join(_report_text(v, trust_given=False))
    finally:
        v.store.close()
    assert "structure  1 shard, " in text and "1 shards" not in text, text
