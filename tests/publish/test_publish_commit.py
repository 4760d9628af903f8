"""The commit of a publish from memory, in process: a trainer gone just before it
publishes nothing, and the side socket's liveness check says so for a closed peer.

Out of process the moment a trainer dies between handing its memfd over and the
commit cannot be hit on purpose (the daemon takes milliseconds); here the check that
runs at that moment is driven directly, over a real registry and real memfds.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.models import VERSIONED_LLAMA, build_model, read_checkpoint
from weightd.client.api.publishing import memfd_of, raw_tensors
from weightd.server.base.errors import MemoryPublishUntrusted, PublishAborted, PublishRefused
from weightd.server.registry.loading import Reloader
from weightd.server.registry.models import ModelRegistry, load_model
from weightd.server.registry.publish import Publisher
from weightd.server.registry.versions import ModelVersions
from weightd.server.transports.publish_socket import peer_gone
from weightd.server.trust.verify import VerifyOptions


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("commit")
    for seed in (1, 2):
        build_model("llama", VERSIONED_LLAMA, seed=seed).save_pretrained(root / f"v{seed}")
    return {"v1": root / "v1", "v2": root / "v2"}


@pytest.fixture
def publisher(dirs: dict[str, Path]) -> Iterator[tuple[ModelRegistry, Publisher]]:
    registry = ModelRegistry()
    versions = ModelVersions()
    versions.attach(registry)
    registry.publish(load_model(str(dirs["v1"]), "m"))
    yield registry, Publisher(Reloader(registry))
    registry.close()


def own_memfds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:weightd-trainer")
    return n


def test_a_trainer_gone_before_the_commit_publishes_nothing(
    publisher: tuple[ModelRegistry, Publisher], dirs: dict[str, Path]
) -> None:
    registry, pub = publisher
    fd, _ = memfd_of(raw_tensors(read_checkpoint(dirs["v2"])))

    def gone() -> None:
        raise PublishAborted("the trainer's connection closed")

    with pytest.raises(PublishAborted):
        pub.publish_memory("m", fd, gone)
    assert own_memfds() == 0  # taken over and closed
    assert registry.get("m").version == 1
    fd, _ = memfd_of(raw_tensors(read_checkpoint(dirs["v2"])))
    assert pub.publish_memory("m", fd).model.version == 2
    assert own_memfds() == 1  # now the version's one shard


def test_a_region_is_checked_before_it_is_read(
    publisher: tuple[ModelRegistry, Publisher], dirs: dict[str, Path]
) -> None:
    registry, pub = publisher
    fd, _ = memfd_of(raw_tensors(read_checkpoint(dirs["v2"])), seal=False)
    with pytest.raises(PublishRefused, match="not sealed"):
        pub.publish_memory("m", fd)
    with open(dirs["v2"] / "config.json", "rb") as f:  # a file, not a memfd
        fd = os.dup(f.fileno())
    with pytest.raises(PublishRefused, match="not a memfd"):
        pub.publish_memory("m", fd)
    assert own_memfds() == 0
    assert registry.get("m").version == 1


def test_peer_gone_sees_a_closed_connection() -> None:
    a, b = socket.socketpair()
    with a:
        assert not peer_gone(a)
        b.close()
        assert peer_gone(a)


def test_a_daemon_that_requires_proofs_refuses_memory(dirs: dict[str, Path]) -> None:
    registry = ModelRegistry()
    registry.publish(load_model(str(dirs["v1"]), "m"))
    try:
        options = VerifyOptions(manifests={"m": str(dirs["v1"] / "manifest.json")})
        pub = Publisher(Reloader(registry, options=options))
        fd, _ = memfd_of(raw_tensors(read_checkpoint(dirs["v2"])))
        with pytest.raises(MemoryPublishUntrusted, match="proved by a manifest"):
            pub.publish_memory("m", fd)
        assert own_memfds() == 0
        assert registry.get("m").version == 0  # no versions attached: never renumbered
    finally:
        registry.close()


def test_a_header_that_is_not_safetensors_is_refused(
    publisher: tuple[ModelRegistry, Publisher],
) -> None:
    registry, pub = publisher
    fd = os.memfd_create("weightd-trainer", os.MFD_ALLOW_SEALING)
    os.write(fd, (9).to_bytes(8, "little") + b"{not json" + b"\0" * 64)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
    with pytest.raises(PublishRefused, match="header is not valid"):
        pub.publish_memory("m", fd)
    assert own_memfds() == 0
    assert registry.get("m").version == 1
