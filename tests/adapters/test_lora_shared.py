"""The same-host hand-over of weightd adapters to vLLM (``weightd.vllm.lora.shared``),
against a real daemon, without vLLM: the hub names a version instead of writing files,
and a worker maps the daemon's one sealed pack of it, verified."""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import load_file

from bench.lora_adapters import digest_of
from tests.adapters.conftest import Fixture, same_bytes
from tests.conftest import RunningDaemon, run_daemon
from weightd.client.api.admin import AdminClient
from weightd.client.base.errors import DataLossError, FailedPreconditionError, NotFoundError
from weightd.client.transports.local import local_stats
from weightd.client.transports.selection import side_socket_path
from weightd.v1 import local_pb2 as lpb
from weightd.vllm.errors import SettingsError
from weightd.vllm.lora.hub import LoRAHub
from weightd.vllm.lora.options import LoRAOptions, parse_lora_options
from weightd.vllm.lora.shared import (
    SharedVersion,
    map_adapter,
    parse_shared_path,
    shared_path,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def daemon(lora: Fixture, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    tmp = tmp_path_factory.mktemp("shared")
    extra = [
        *("--adapter-root", str(lora.root), "--adapter-autoload", "good"),
        *("--adapter-autoload", "second"),
        *("--adapter-digest", f"good={digest_of(lora.adapter_dir)}"),
        *("--adapter-digest", f"second={digest_of(lora.second_dir)}"),
    ]
    with run_daemon(tmp, [("tiny-llama", lora.base_dir)], extra) as d:
        d.admin = f"unix://{tmp / 'run' / 'admin.sock'}"  # type: ignore[attr-defined]
        yield d


def adapter_packs(d: RunningDaemon, name: str) -> list[lpb.PackStat]:
    side = side_socket_path(d.target)
    assert side is not None
    return [p for p in local_stats(side).packs if p.adapter == name]


def test_hub_names_the_version_and_writes_nothing(
    daemon: RunningDaemon, lora: Fixture, tmp_path: Path
) -> None:
    options = LoRAOptions(daemon.target, dir=str(tmp_path / "copies"), retain_seconds=0)
    hub = LoRAHub(options)
    got = asyncio.run(hub.current("good", str(lora.base_dir)))
    assert got.shared and got.digest == digest_of(lora.adapter_dir)
    assert got.path == shared_path("good", got.version, got.digest)
    assert parse_shared_path(got.path) == SharedVersion("good", got.version, got.digest)
    assert hub.owns(got.path)
    assert not (tmp_path / "copies").exists()  # no private copy, not even its directory
    # The hub leases the pack (built now, before any worker asks) while vLLM may load
    # the version again; retired and past retain_seconds (0 here), it lets go.
    assert [p.leases for p in adapter_packs(daemon, "good")] == [1]
    hub.retire(got.path)
    assert [p.leases for p in adapter_packs(daemon, "good")] == [0]
    assert not hub.owns(got.path)


def test_files_handover_still_writes_the_private_copy(
    daemon: RunningDaemon, tmp_path: Path
) -> None:
    options = LoRAOptions(daemon.target, dir=str(tmp_path / "c"), timeout=60, handover="files")
    got = asyncio.run(LoRAHub(options).current("good"))
    assert not got.shared and Path(got.path, "adapter_model.safetensors").is_file()


def test_tcp_target_falls_back_to_files() -> None:
    hub = LoRAHub(LoRAOptions(target="127.0.0.1:1", timeout=1))
    assert hub.options.handover == "auto"
    from weightd.vllm.lora.shared import side_channel

    assert side_channel("127.0.0.1:1") is None  # another host: the hub writes files


def test_workers_map_one_verified_pack_of_the_whole_adapter(
    daemon: RunningDaemon, lora: Fixture
) -> None:
    hub = LoRAHub(LoRAOptions(target=daemon.target, timeout=60))
    got = asyncio.run(hub.current("second"))
    wanted = parse_shared_path(got.path)
    assert wanted is not None
    first = map_adapter(daemon.target, wanted, timeout=60, max_bytes=1 << 30)
    second = map_adapter(daemon.target, wanted, timeout=60, max_bytes=1 << 30)
    # Named and laid out exactly as the verified file, whole (vLLM cuts per rank).
    reference = load_file(str(lora.second_dir / "adapter_model.safetensors"))
    assert same_bytes(first.tensors, reference) and same_bytes(second.tensors, reference)
    assert first.config == json.loads((lora.second_dir / "adapter_config.json").read_text())
    # One pack on the host for the hub and both "engines": built once (by the hub, before
    # vLLM was given the path), leased by each.
    assert first.pack_id == second.pack_id and not first.built and not second.built
    (pack,) = adapter_packs(daemon, "second")
    assert (pack.adapter_version, pack.leases) == (wanted.version, 3)
    assert (pack.layout.tp_size, pack.layout.tp_rank) == (1, 0)
    # The lease lives exactly as long as the tensors.
    del first, second
    gc.collect()
    assert [p.leases for p in adapter_packs(daemon, "second")] == [1]  # the hub's


def test_a_retired_version_is_served_while_held_and_refused_once_gone(
    daemon: RunningDaemon, lora: Fixture, tmp_path: Path
) -> None:
    admin = AdminClient(daemon.admin, timeout=60)  # type: ignore[attr-defined]
    old = admin.load_adapter("swap", str(lora.adapter_dir))
    held = map_adapter(
        daemon.target,
        SharedVersion("swap", old.version, old.digest),
        timeout=60,
        max_bytes=1 << 30,
    )
    new = admin.load_adapter("swap", str(lora.second_dir))  # a replace: old is retired
    assert new.version > old.version
    again = map_adapter(
        daemon.target,
        SharedVersion("swap", old.version, old.digest),
        timeout=60,
        max_bytes=1 << 30,
    )
    assert same_bytes(again.tensors, held.tensors)  # the version asked for, not the current
    del held, again
    gc.collect()
    with pytest.raises(NotFoundError, match=f"version {old.version}"):
        map_adapter(
            daemon.target,
            SharedVersion("swap", old.version, old.digest),
            timeout=60,
            max_bytes=1 << 30,
        )


def test_a_path_naming_other_content_is_refused(daemon: RunningDaemon) -> None:
    hub = LoRAHub(LoRAOptions(target=daemon.target, timeout=60))
    got = asyncio.run(hub.current("good"))
    forged = SharedVersion("good", got.version, "sha256:" + "0" * 64)
    with pytest.raises(DataLossError, match=r"granted 'good' version \d+ \(sha256:"):
        map_adapter(daemon.target, forged, timeout=60, max_bytes=1 << 30)
    small = SharedVersion("good", got.version, got.digest)
    with pytest.raises(DataLossError, match="over max_bytes 16"):
        map_adapter(daemon.target, small, timeout=60, max_bytes=16)


def test_no_side_channel_names_the_fix(tmp_path: Path) -> None:
    wanted = SharedVersion("good", 1, "sha256:" + "1" * 64)
    with pytest.raises(FailedPreconditionError, match='"handover": "files"'):
        map_adapter(f"unix://{tmp_path}/none.sock", wanted, timeout=5, max_bytes=1 << 30)


@pytest.mark.parametrize("name", ["good", "a/b", "x@v2/..", "ü name", "%2F"])
def test_shared_path_round_trips_any_name(name: str) -> None:
    digest = "sha256:" + "ab" * 32
    path = shared_path(name, 7, digest)
    assert path.startswith("/") and path.count("/") == 2
    assert parse_shared_path(path) == SharedVersion(name, 7, digest)


@pytest.mark.parametrize(
    "path",
    [
        "/weightd-adapter:good@v0/sha256:" + "0" * 64,
        "/weightd-adapter:good@v1/sha256:" + "0" * 63,
        "/weightd-adapter:good/sha256:" + "0" * 64,
        "/weightd-adapter:a/b@v1/sha256:" + "0" * 64,
    ],
)
def test_malformed_shared_paths_are_refused(path: str) -> None:
    with pytest.raises(FailedPreconditionError, match="does not name a weightd adapter version"):
        parse_shared_path(path)


def test_other_paths_are_vllms() -> None:
    assert parse_shared_path("/models/adapters/good") is None


def test_handover_option() -> None:
    assert parse_lora_options('{"handover": "files"}').handover == "files"
    assert parse_lora_options("").handover == "auto"
    with pytest.raises(SettingsError, match="handover"):
        parse_lora_options('{"handover": "stream"}')
