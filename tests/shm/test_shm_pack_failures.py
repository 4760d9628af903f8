"""A pack whose build fails says why: the shard that changed, as DATA_LOSS (#15 item 11).

The build reads each slice into the memfd through a writable mapping. When a read fails
(a shard rewritten in place after it was verified), the frames of that failure still
hold views into the mapping, and unmapping it in cleanup raised ``BufferError: cannot
close exported pointers exist``, which replaced the real error: the client saw INTERNAL.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import run_daemon
from weightd.client import DataLossError, WeightClient

pytestmark = pytest.mark.e2e


def test_a_shard_changed_during_a_pack_build_is_data_loss_naming_it(
    demo_model: Path, tmp_path: Path
) -> None:
    model = tmp_path / "model"
    shutil.copytree(demo_model, model)
    shard = sorted(model.glob("*.safetensors"))[0]
    # No file watcher: the rewrite must be met by the pack build itself.
    with run_daemon(tmp_path, [("demo", model)], ["--watch-interval", "0"]) as daemon:
        with WeightClient(daemon.target, timeout=60) as c:
            # Rank 1 over gRPC anchors every TP=2 slice (rank 0's too), so rank 0's pack
            # build below goes straight to copying bytes.
            c.fetch(1, 2, transport="grpc")
            size = shard.stat().st_size
            with open(shard, "r+b") as f:  # same inode and size, new bytes and mtime
                f.seek(size // 2)
                f.write(b"\x5a" * (size - size // 2))
            with pytest.raises(DataLossError) as err:
                c.fetch(0, 2, transport="shm")
        assert shard.name in err.value.detail
        assert err.value.transport is None  # the model's fault: auto must not fall back
        log = daemon.log_path.read_text()
        assert "BufferError" not in log
        assert "exported pointers" not in log
