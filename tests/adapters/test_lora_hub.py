"""The API-server side of weightd LoRA in vLLM (``weightd.vllm.lora.hub``), against a real
daemon, without vLLM: private copies, single-flight, base identity, errors as HTTP."""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.lora_adapters import digest_of
from tests.adapters.conftest import Fixture
from tests.conftest import RunningDaemon, run_daemon
from weightd.client.base.errors import (
    AdapterLoadPending,
    DataLossError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnavailableError,
    WeightdError,
)
from weightd.vllm.errors import AdapterUnavailable, SettingsError
from weightd.vllm.lora.hub import LoRAHub
from weightd.vllm.lora.options import LoRAOptions, parse_lora_options
from weightd.vllm.lora.refusals import unavailable

pytestmark = pytest.mark.e2e
FILES = functools.partial(LoRAOptions, handover="files")


@pytest.fixture(scope="module")
def daemon(lora: Fixture, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    tmp = tmp_path_factory.mktemp("hub")
    extra = [
        *("--adapter-root", str(lora.root), "--adapter-autoload", "good"),
        *("--adapter-autoload", "second"),
        *("--adapter-digest", f"good={digest_of(lora.adapter_dir)}"),
        *("--adapter-digest", f"second={digest_of(lora.second_dir)}"),
    ]
    with run_daemon(tmp, [("tiny-llama", lora.base_dir)], extra) as d:
        yield d


def hub_for(d: RunningDaemon, tmp: Path) -> LoRAHub:
    """A hub writing private copies: the hand-over where the daemon's side socket is not
    on the API server's host (``handover: files`` forces it here; the same-host shared
    hand-over is tested in test_lora_shared.py)."""
    return LoRAHub(FILES(target=d.target, dir=str(tmp / "copies"), timeout=60))


def test_private_copy_is_the_verified_files_read_only(
    daemon: RunningDaemon, lora: Fixture, tmp_path: Path
) -> None:
    hub = hub_for(daemon, tmp_path)
    got = asyncio.run(hub.current("good", str(lora.base_dir)))
    assert got.lora_name == f"good@v{got.version}" and got.digest == digest_of(lora.adapter_dir)
    path = Path(got.path)
    assert path.parent.parent == tmp_path / "copies"
    assert path.name.startswith(f"good@v{got.version}-")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (path / name).read_bytes() == (lora.adapter_dir / name).read_bytes()
        assert stat.S_IMODE((path / name).stat().st_mode) == 0o400
    assert stat.S_IMODE(path.stat().st_mode) == 0o500
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert hub.owns(got.path)
    again = asyncio.run(hub.current("good"))
    assert again.path == got.path and again.prepared_seconds == got.prepared_seconds


def test_concurrent_callers_share_one_round_trip(daemon: RunningDaemon, tmp_path: Path) -> None:
    hub = hub_for(daemon, tmp_path)

    async def many() -> list[str]:
        return [p.path for p in await asyncio.gather(*(hub.current("second") for _ in range(16)))]

    paths = asyncio.run(many())
    assert len(set(paths)) == 1
    assert len(os.listdir(hub.root())) == 1  # one copy written


@pytest.mark.parametrize(
    ("name", "status", "text"),
    [
        ("nosuch", 404, "weightd adapter 'nosuch' not found: "),
        ("../good", 400, "weightd adapter '../good' refused: "),
    ],
)
def test_errors_carry_http_status_and_name(
    daemon: RunningDaemon, tmp_path: Path, name: str, status: int, text: str
) -> None:
    with pytest.raises(AdapterUnavailable) as caught:
        asyncio.run(hub_for(daemon, tmp_path).current(name))
    assert caught.value.status == status and caught.value.message.startswith(text)


def test_another_base_model_is_refused(
    daemon: RunningDaemon, lora: Fixture, tmp_path: Path
) -> None:
    other = tmp_path / "other-base"
    shutil.copytree(lora.base_dir, other)
    config = (other / "config.json").read_text().replace('"vocab_size": 128', '"vocab_size": 129')
    (other / "config.json").write_text(config)
    with pytest.raises(AdapterUnavailable, match="is not vLLM's base model") as caught:
        asyncio.run(hub_for(daemon, tmp_path).current("good", str(other)))
    assert caught.value.status == 400


def test_unreachable_daemon_is_503(tmp_path: Path) -> None:
    hub = LoRAHub(LoRAOptions(target=f"unix://{tmp_path}/none.sock", timeout=5))
    with pytest.raises(AdapterUnavailable, match="unreachable") as caught:
        asyncio.run(hub.current("good"))
    assert caught.value.status == 503


@pytest.mark.parametrize(
    ("text", "target", "model"),
    [
        ("unix:///x.sock", "unix:///x.sock", ""),
        ('{"target": "unix:///y.sock", "model": "m"}', "unix:///y.sock", "m"),
    ],
)
def test_options(text: str, target: str, model: str) -> None:
    o = parse_lora_options(text)
    assert (o.target, o.model) == (target, model)


@pytest.mark.parametrize(
    "text",
    [
        '{"targt": "x"}',
        '{"timeout": "5"}',
        '{"load": 1}',
        "{",
        '{"timeout": 0}',
        '{"timeout": NaN}',  # the loader refused NaN; WEIGHTD_LORA accepted it
        '{"timeout": Infinity}',
        '{"retain_seconds": NaN}',
        '{"max_bytes": 1.5}',
        '{"target": "http://h:1"}',  # the one address rule, as the loader's
        "localhost",
        '{"handover": "stream"}',
    ],
)
def test_bad_options(text: str) -> None:
    with pytest.raises(SettingsError, match="WEIGHTD_LORA"):
        parse_lora_options(text)


@pytest.mark.parametrize(
    ("error", "status", "start"),
    [
        (NotFoundError("x"), 404, "weightd adapter 'a' not found: x"),
        (UnavailableError("x"), 503, "weightd adapter 'a': the daemon at T is unreachable: x"),
        (AdapterLoadPending("x"), 503, "weightd adapter 'a': the daemon is still loading it: x"),
        # The reason decides, not the words: a plain UNAVAILABLE is the daemon gone.
        (
            UnavailableError("ask again shortly"),
            503,
            "weightd adapter 'a': the daemon at T is unreachable",
        ),
        (DeadlineExceededError("x"), 503, "weightd adapter 'a': the daemon at T is unreachable"),
        (ResourceExhaustedError("x"), 503, "weightd adapter 'a': the daemon cannot hold it now"),
        (DataLossError("x"), 400, "weightd adapter 'a' refused: x"),
        (FailedPreconditionError("x"), 400, "weightd adapter 'a' refused: x"),
        (InvalidArgumentError("x"), 400, "weightd adapter 'a' refused: x"),
        (PermissionDeniedError("x"), 400, "weightd adapter 'a' refused: x"),
    ],
)
def test_status_table(error: WeightdError, status: int, start: str) -> None:
    got = unavailable("a", "T", error)
    assert got.status == status and got.message.startswith(start)


def test_a_retired_copy_goes_after_retain_seconds(
    daemon: RunningDaemon, lora: Fixture, tmp_path: Path
) -> None:
    from weightd.client.api.admin import AdminClient

    hub = LoRAHub(
        FILES(target=daemon.target, dir=str(tmp_path / "c"), retain_seconds=0, timeout=60)
    )
    admin = AdminClient(f"unix://{daemon.log_path.parent / 'run' / 'admin.sock'}", timeout=60)
    admin.load_adapter("retire", str(lora.adapter_dir))
    old = asyncio.run(hub.current("retire"))
    admin.load_adapter("retire", str(lora.second_dir))  # a new version
    new = asyncio.run(hub.current("retire"))
    assert new.version > old.version and new.path != old.path
    assert os.path.isdir(old.path)  # vLLM may still serve it: kept until retired
    hub.retire(old.path)  # what the middleware does once vLLM serves the new one
    hub.retire("/not/ours")  # nothing
    assert not os.path.exists(old.path) and os.path.isdir(new.path)
    assert hub.owns(new.path) and not hub.owns(old.path)
    assert hub.newer(new.path, old.path) and not hub.newer(old.path, new.path)
    admin.unload_adapter("retire")
    with pytest.raises(AdapterUnavailable, match="not found"):
        asyncio.run(hub.current("retire"))


def test_a_parent_other_users_can_write_is_refused(daemon: RunningDaemon, tmp_path: Path) -> None:
    """Another user could swap their own ``weightd-lora-*`` directory in such a parent."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # world-writable, not sticky
    hub = LoRAHub(FILES(target=daemon.target, dir=str(shared), timeout=60))
    with pytest.raises(AdapterUnavailable, match="other users can write") as caught:
        asyncio.run(hub.current("good"))
    assert caught.value.status == 500
    assert os.listdir(shared) == []
    # a private directory below it is no better: the branch can be renamed away
    (shared / "mine").mkdir(mode=0o700)
    hub = LoRAHub(FILES(target=daemon.target, dir=str(shared / "mine"), timeout=60))
    with pytest.raises(AdapterUnavailable, match=f"other users can write {shared}"):
        asyncio.run(hub.current("good"))
    (shared / "mine").rmdir()
    hub = LoRAHub(FILES(target=daemon.target, dir=str(shared), timeout=60))
    shared.chmod(0o1777)  # sticky, as /tmp: no one else can replace what this user made
    got = asyncio.run(hub.current("good"))
    assert Path(got.path).parent.parent == shared


def test_a_copy_not_verified_again_is_never_handed_out(
    daemon: RunningDaemon, lora: Fixture, tmp_path: Path
) -> None:
    """An existing version directory is re-verified (owner, mode, links, digest) or
    rebuilt; a changed hub directory is refused."""
    hub = hub_for(daemon, tmp_path)
    got = asyncio.run(hub.current("good"))
    path = Path(got.path)
    for planted_by in (65534, os.geteuid()):  # another user's, then a stale copy of ours
        hub._ready.clear()
        shutil.rmtree(path)
        path.mkdir(mode=0o500 if planted_by != 65534 else 0o755)
        (path / "adapter_config.json").write_text('{"lora_alpha": 9999, "r": 8}')
        (path / "adapter_model.safetensors").write_bytes(b"made up")
        os.chown(path, planted_by, planted_by)
        again = asyncio.run(hub.current("good"))
        assert again.path == got.path
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            assert (path / name).read_bytes() == (lora.adapter_dir / name).read_bytes()
            assert (path / name).stat().st_uid == os.geteuid()
    # a link in place of a file is not followed
    hub._ready.clear()
    os.chmod(path, 0o700)
    (path / "adapter_config.json").unlink()
    (path / "adapter_config.json").symlink_to(lora.adapter_dir / "adapter_config.json")
    os.chmod(path, 0o500)
    asyncio.run(hub.current("good"))
    assert not (path / "adapter_config.json").is_symlink()
    # the hub's own directory opened up to others: refused, not used
    root = path.parent
    root.chmod(0o777)
    with pytest.raises(AdapterUnavailable, match="replaced or opened up"):
        asyncio.run(hub.current("good"))
    root.chmod(0o700)
