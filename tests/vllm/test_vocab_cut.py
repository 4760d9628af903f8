"""weightd's ``vocab_pad`` cut against vLLM's own ``VocabParallelEmbedding._get_indices``.

vLLM runs in ``.venv-vllm`` (a subprocess; a few seconds, no engine): for every
(vocabulary, world size, padding) of the planner's table it reports the original
vocabulary's rows of each rank, or that vLLM refuses (its ``divide`` asserts when the
padded vocabulary does not split evenly). weightd must give the same rows, and
refuse exactly where vLLM does.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.unit.plan.test_vocab_pad import TABLE
from weightd.server.plan.tpcut import padded_vocab_rows

pytestmark = pytest.mark.e2e

SCRIPT = """
import json, sys
from vllm.model_executor.layers.vocab_parallel_embedding import (
    VocabParallelEmbedding, pad_vocab_size)
out = []
for vocab, tp, pad in json.loads(sys.stdin.read()):
    padded = pad_vocab_size(vocab, pad)
    rows = []
    try:
        for rank in range(tp):
            si = VocabParallelEmbedding._get_indices(padded, padded, vocab, vocab, rank, tp)
            rows.append([si.org_vocab_start_index, si.org_vocab_end_index])
    except AssertionError:
        rows = None
    out.append(rows)
print(json.dumps(out))
"""


def test_rows_equal_vllms_own_function(vllm_python: Path) -> None:
    proc = subprocess.run(
        [str(vllm_python), "-c", SCRIPT],
        input=json.dumps(TABLE),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(theirs) == len(TABLE)
    refused = 0
    for (vocab, tp, pad), rows in zip(TABLE, theirs, strict=True):
        if rows is None:
            refused += 1
            with pytest.raises(ValueError, match="not divisible"):
                padded_vocab_rows(vocab, tp, 0, pad)
            continue
        ours = [list(padded_vocab_rows(vocab, tp, r, pad)) for r in range(tp)]
        assert ours == rows, (vocab, tp, pad)
    assert 0 < refused < len(TABLE)
