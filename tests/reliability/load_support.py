"""Fixtures and probes for the client-fault, load and restart tests.

Imported explicitly by those test modules (``from tests.reliability.load_support
import ...``) so that the other reliability tests' ``conftest.py`` stays theirs.
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bench.procstats import ProcUsage, proc_usage
from tests.conftest import RunningDaemon
from weightd.client.transports.local import local_stats
from weightd.client.transports.selection import side_socket_path

#: Llama-style, 8 layers: 75 tensors, ~16 MB of BF16 in 3 shards. Enough tensors that
#: a stream cut in its middle has complete tensors behind it and many ahead.
MANY_TENSORS_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def write_many_tensor_model(directory: Path, seed: int = 11) -> Path:
    from weightd.server.cli.demo import write_llama_checkpoint

    write_llama_checkpoint(str(directory), MANY_TENSORS_CONFIG, shards=3, seed=seed)
    return directory


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from weightd.server.cli.demo import ensure_demo_checkpoint

    return Path(ensure_demo_checkpoint(str(tmp_path_factory.mktemp("rel-demo"))))


@pytest.fixture(scope="session")
def many_tensor_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_many_tensor_model(tmp_path_factory.mktemp("rel-many") / "many")


# --- what the daemon holds ------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    """The daemon's resources and live objects at one moment."""

    usage: ProcUsage
    fetch_streams: float  # weightd_active_streams{method="Fetch"}
    packs: int
    leases: int
    side_connections: int

    def row(self) -> str:
        return (
            f"{self.usage.row()}, Fetch streams {self.fetch_streams:g}, packs {self.packs}, "
            f"leases {self.leases}, side connections {self.side_connections}"
        )


def scrape_metric(url: str, name: str, labels: dict[str, str]) -> float:
    """One sample of a Prometheus text scrape (0 when the series is absent)."""
    with urllib.request.urlopen(url, timeout=30) as reply:  # loopback only
        text = reply.read().decode()
    for line in text.splitlines():
        m = re.match(rf"{name}\{{(.*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            return float(m.group(2))
    return 0.0


def snapshot(daemon: RunningDaemon) -> Snapshot:
    side = side_socket_path(daemon.target)
    assert side is not None
    stats = local_stats(side)
    streams = scrape_metric(
        daemon.address("metrics"),
        "weightd_active_streams",
        {"method": "Fetch"},
    )
    return Snapshot(
        usage=proc_usage(daemon.process.pid),
        fetch_streams=streams,
        packs=len(stats.packs),
        leases=sum(p.leases for p in stats.packs),
        # The stats request itself holds one connection while it is answered.
        side_connections=stats.connections - 1,
    )


def settle(daemon: RunningDaemon, ok: Callable[[Snapshot], bool], timeout: float = 30) -> Snapshot:
    """Poll until ``ok`` holds (the last snapshot either way): releases are asynchronous."""
    deadline = time.monotonic() + timeout
    while True:
        s = snapshot(daemon)
        if ok(s) or time.monotonic() > deadline:
            return s
        time.sleep(0.2)
