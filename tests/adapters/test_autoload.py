"""Loads on a worker's request (ResolveAdapter), the files an engine reads
(FetchAdapterFiles) and the ``weightd adapter`` commands, against a real daemon process.

One daemon carries every check: roots, the allow-list, the pinned digests and the
explicit trust of the roots are the operator's settings; a worker may only name.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.adapters.conftest import Fixture
from tests.conftest import RunningDaemon, run_daemon
from weightd.client import WeightClient
from weightd.client.base.errors import (
    DataLossError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from weightd.common.digests import adapter_digest

pytestmark = pytest.mark.e2e


def digest_of(directory: Path) -> str:
    def sha(name: str) -> str:
        return hashlib.sha256((directory / name).read_bytes()).hexdigest()

    return adapter_digest(sha("adapter_config.json"), sha("adapter_model.safetensors"))


class Daemon:
    def __init__(self, d: RunningDaemon, admin: str, metrics: str) -> None:
        self.d, self.admin_target, self.metrics_url = d, admin, metrics

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(self.metrics_url, timeout=30) as r:  # loopback only
            text = r.read().decode()
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "weightd.server.cli.main", "adapter", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def daemon(lora: Fixture, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("autoload")
    root = tmp / "roots"
    root.mkdir()
    for name in ("pinned", "wrong", "trusted", "many", "twin"):
        shutil.copytree(lora.adapter_dir if name != "twin" else lora.second_dir, root / name)
    (root / "notallowed").mkdir()
    extra = [
        *("--adapter-root", str(root), "--metrics-listen", "127.0.0.1:0"),
        *("--adapter-autoload", "pinned", "--adapter-autoload", "wrong"),
        *("--adapter-autoload", "t*", "--adapter-autoload", "many", "--adapter-autoload", "gone"),
        *("--adapter-digest", f"pinned={digest_of(root / 'pinned')}"),
        *("--adapter-digest", "wrong=sha256:" + "0" * 64),
        *("--adapter-digest", f"many={digest_of(root / 'many')}"),
        *("--adapter-digest", f"twin={digest_of(root / 'twin')}"),
        *("--adapter-digest", "gone=sha256:" + "1" * 64),
    ]
    with run_daemon(tmp, [("tiny-llama", lora.base_dir)], extra) as d:
        yield Daemon(d, f"unix://{tmp / 'run' / 'admin.sock'}", d.address("metrics"))


def test_resolve_loads_on_request_under_the_operators_rules(daemon: Daemon, lora: Fixture) -> None:
    with WeightClient(daemon.d.target, timeout=60) as c:
        with pytest.raises(NotFoundError, match="'pinned' is not loaded"):
            c.resolve_adapter("pinned")  # without load: only what is loaded
        s = c.resolve_adapter("pinned", load=True)
        assert (s.name, s.base_model, s.digest) == (
            "pinned",
            "tiny-llama",
            digest_of(lora.adapter_dir),
        )
        again = c.resolve_adapter("pinned", load=True, model="tiny-llama")
        assert again.version == s.version  # held: not loaded twice
        # Not on the allow-list: as if it did not exist, even though the directory does.
        with pytest.raises(NotFoundError, match="--adapter-autoload"):
            c.resolve_adapter("notallowed", load=True)
        # Allowed, but the pinned digest differs: refused, nothing published.
        with pytest.raises(DataLossError, match="adapter digest: expected sha256:000"):
            c.resolve_adapter("wrong", load=True)
        # Allowed by "t*", nothing vouches for it (no digest, roots not trusted).
        with pytest.raises(FailedPreconditionError, match="nothing vouches for its bytes"):
            c.resolve_adapter("trusted", load=True)
        # Allowed and pinned, but under no root.
        with pytest.raises(NotFoundError, match="'gone' is not loaded and is under no adapter"):
            c.resolve_adapter("gone", load=True)
        for bad in ("../pinned", ".hidden", "a/b"):
            with pytest.raises(InvalidArgumentError, match="one plain directory name"):
                c.resolve_adapter(bad, load=True)
        with pytest.raises(NotFoundError, match="model 'other' is not served here"):
            c.resolve_adapter("pinned", model="other")
    log = daemon.d.log()
    assert re.search(
        r"adapter action=load adapter=pinned version=\d+ digest=sha256:\w+ source=", log
    )
    assert re.search(
        r"action=refuse adapter=wrong source=wrong by=worker reason=digest_mismatch", log
    )


def test_files_are_the_verified_bytes(daemon: Daemon, lora: Fixture) -> None:
    with WeightClient(daemon.d.target, timeout=60) as c:
        s = c.resolve_adapter("twin", load=True)
        files = c.fetch_adapter_files("twin")
        assert files.status.version == s.version and files.status.digest == s.digest
        assert files.config == (lora.second_dir / "adapter_config.json").read_bytes()
        assert files.weights == (lora.second_dir / "adapter_model.safetensors").read_bytes()
        assert c.fetch_adapter_files("twin", s.version).weights == files.weights
        with pytest.raises(NotFoundError, match="no longer held"):
            c.fetch_adapter_files("twin", s.version + 1000)
        from weightd.client.base.errors import ResourceExhaustedError

        with pytest.raises(ResourceExhaustedError, match="over this client's limit"):
            c.fetch_adapter_files("twin", max_bytes=1000)


def test_concurrent_resolves_share_one_load(daemon: Daemon) -> None:
    loads = daemon.metric("weightd_adapter_loads_total")
    outcomes = ('{outcome="loaded"}', '{outcome="held"}')
    resolves = sum(daemon.metric(f"weightd_adapter_resolves_total{o}") for o in outcomes)
    barrier = threading.Barrier(16)
    versions: list[int] = []
    errors: list[BaseException] = []

    def ask() -> None:
        try:
            with WeightClient(daemon.d.target, timeout=60) as c:
                barrier.wait()
                versions.append(c.resolve_adapter("many", load=True).version)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=ask) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[0]
    assert len(versions) == 16 and len(set(versions)) == 1
    assert daemon.metric("weightd_adapter_loads_total") == loads + 1
    after = sum(daemon.metric(f"weightd_adapter_resolves_total{o}") for o in outcomes)
    assert after == resolves + 16  # each one counted: waited for the load, or found it


def test_cli_load_list_unload_watch(daemon: Daemon, lora: Fixture) -> None:
    with WeightClient(daemon.d.target, timeout=60) as c:
        c.resolve_adapter("pinned", load=True)  # at least one adapter: the watch's first line
    watch = subprocess.Popen(
        [sys.executable, "-m", "weightd.server.cli.main", "adapter", "watch", daemon.d.target],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert watch.stdout is not None
        seen = [watch.stdout.readline()]  # connected: what is loaded now comes first
        assert seen[0].startswith("load "), seen
        out = daemon.cli("load", daemon.admin_target, "ops", str(lora.second_dir))
        # The adapter root of this daemon is not lora.root: refused, one line.
        assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
        assert "outside the adapter roots" in out.stderr
        src = str(Path(daemon.d.log_path).parent / "roots" / "pinned")
        out = daemon.cli("load", daemon.admin_target, "ops", src)
        assert out.returncode == 0, out.stderr
        assert re.match(r"loaded ops version \d+ sha256:\w+ \(model tiny-llama", out.stdout)
        listed = daemon.cli("list", daemon.admin_target)
        assert re.search(r"^ops\tversion \d+\tsha256:", listed.stdout, re.M), listed.stdout
        out = daemon.cli("unload", daemon.admin_target, "ops")
        assert out.returncode == 0 and out.stdout.startswith("unloaded ops version"), out.stderr
        assert daemon.cli("digest", src).stdout.strip() == digest_of(Path(src))
        gone = daemon.cli("unload", daemon.admin_target, "ops")
        assert gone.returncode == 1 and "no adapter named 'ops'" in gone.stderr
        for line in watch.stdout:
            seen.append(line)
            if line.startswith("unload ops"):
                break
        assert any(line.startswith("load ops version") for line in seen), seen
        assert "(unloaded)" in seen[-1]
    finally:
        watch.terminate()
        watch.wait(30)


def big_adapter(template: Path, out: Path, r: int) -> Path:
    """A valid adapter with ``template``'s modules at rank ``r`` (tens of MB: its load
    takes long enough for concurrent requests to overlap it)."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir()
    config = json.loads((template / "adapter_config.json").read_text())
    config.update(r=r, lora_alpha=2 * r, rank_pattern={}, alpha_pattern={})
    (out / "adapter_config.json").write_text(json.dumps(config))
    tensors = {}
    for name, t in load_file(str(template / "adapter_model.safetensors")).items():
        shape = (r, t.shape[1]) if ".lora_A." in name else (t.shape[0], r)
        tensors[name] = torch.randn(shape)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return out


def test_loads_on_request_hold_few_server_threads(
    lora: Fixture, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """With --max-workers 4 one load on request runs at a time: a second one meanwhile
    is told to ask again (UNAVAILABLE) at once, never parked on a server thread; the
    vLLM side asks again and gets it."""
    import asyncio

    from weightd.client import AdapterLoadPending
    from weightd.client.base.errors import UnavailableError
    from weightd.vllm.lora.hub import LoRAHub
    from weightd.vllm.lora.options import LoRAOptions

    tmp = tmp_path_factory.mktemp("slots")
    root = tmp / "roots"
    root.mkdir()
    for name in ("big1", "big2", "big3", "big4"):
        big_adapter(lora.second_dir, root / name, 4096)
    extra = [
        *("--adapter-root", str(root), "--max-workers", "4"),
        *("--adapter-autoload", "big*", "--adapter-autoload-trust-roots"),
    ]
    with run_daemon(tmp, [("tiny-llama", lora.base_dir)], extra) as d:
        outcomes: dict[str, object] = {}

        def ask(name: str) -> None:
            with WeightClient(d.target, timeout=120) as c:
                try:
                    outcomes[name] = c.resolve_adapter(name, load=True).version
                except UnavailableError as exc:
                    outcomes[name] = exc

        threads = [threading.Thread(target=ask, args=(n,)) for n in ("big1", "big2")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        refused = [v for v in outcomes.values() if isinstance(v, UnavailableError)]
        assert len(outcomes) == 2 and len(refused) == 1, outcomes
        assert "ask again shortly" in refused[0].detail
        assert isinstance(refused[0], AdapterLoadPending)  # the typed reason clients act on
        hub = LoRAHub(LoRAOptions(target=d.target, dir=str(tmp / "copies"), timeout=120))

        async def both() -> list[int]:
            got = await asyncio.gather(hub.current("big3"), hub.current("big4"))
            return [p.version for p in got]

        assert len(set(asyncio.run(both()))) == 2  # one of them asked again, and got it
        assert hub.retry_stats.retries["UNAVAILABLE"] >= 1  # through the client's backoff
