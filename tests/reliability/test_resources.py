"""Resources running out: a full disk under manifests, keys and the hash cache; memory
budgets (shared-memory packs, adapters; pinned and GPU budgets on a GPU).

A full disk is real (see ``diskfull``): writes fail part-way, and weightd must leave
the previous file exactly as it was and no temporary file behind, say one line
naming the file (CLI, exit 1), and keep serving (daemon). A budget exceeded is
RESOURCE_EXHAUSTED with the numbers, and the daemon goes on serving what fits.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from bench.loadgen import reference_slices
from tests.adapters.conftest import Fixture
from tests.conftest import run_daemon
from tests.gpu.conftest import cuda_usable
from tests.reliability.diskfull import FullDisk, run, small_disk
from tests.reliability.files_support import assert_rank, read_tensors
from tests.reliability.load_support import many_tensor_model
from weightd.client import AdminClient, ResourceExhaustedError, WeightClient

__all__ = ["many_tensor_model"]  # a fixture, used by name

pytestmark = pytest.mark.e2e


def _one_line_naming(stderr: str, path: Path, disk: FullDisk, command: str = "manifest") -> None:
    """One error line (after the usual INFO progress lines), no traceback."""
    lines = [line for line in stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert lines[0].startswith(f"weightd {command}: error: "), stderr
    assert f"cannot write {path}" in lines[0], stderr
    assert any(e in lines[0] for e in disk.errors), stderr


def test_manifest_and_keys_on_a_full_disk(
    transformers_models: dict[str, Path], tmp_path: Path
) -> None:
    with small_disk(tmp_path / "disk", size=256 << 10, limit=64) as disk:
        out = disk.directory / "llama.manifest.json"
        first = run(disk, ["manifest", "create", str(transformers_models["llama"]), "-o", str(out)])
        assert first.returncode == 0, first.stderr
        old = out.read_bytes()
        assert json.loads(old)["tensors"]

        disk.fill()
        # Replacing it (another model's manifest) fails whole: the old file stays.
        again = run(disk, ["manifest", "create", str(transformers_models["qwen2"]), "-o", str(out)])
        assert again.returncode == 1
        _one_line_naming(again.stderr, out, disk)
        assert out.read_bytes() == old
        # A new file is not created at all, not even empty.
        new = disk.directory / "qwen2.manifest.json"
        fresh = run(disk, ["manifest", "create", str(transformers_models["qwen2"]), "-o", str(new)])
        assert fresh.returncode == 1
        _one_line_naming(fresh.stderr, new, disk)
        # Keys: neither half of a pair is left behind.
        private, public = disk.directory / "k", disk.directory / "k.pub"
        keys = run(
            disk,
            ["manifest", "keygen", "--out-private", str(private), "--out-public", str(public)],
        )
        assert keys.returncode == 1, keys.stderr
        assert "cannot write" in keys.stderr and str(disk.directory) in keys.stderr
        assert disk.files() == [out.name]  # no temporary files, no partial outputs

        disk.drain()
        ok = run(disk, ["manifest", "create", str(transformers_models["qwen2"]), "-o", str(out)])
        assert ok.returncode == 0, ok.stderr
        assert out.read_bytes() != old and json.loads(out.read_bytes())["tensors"]
        print(f"full disk simulated with {disk.mode}")


def _is_rank(path: Path, model: Path, rank: int) -> None:
    from safetensors.torch import load

    got = load(path.read_bytes())
    want = reference_slices(str(model), 2, rank)
    assert set(got) == set(want)
    for name, w in want.items():
        assert torch.equal(got[name].view(torch.uint8), w.view(torch.uint8)), name


def test_fetch_out_on_a_full_disk_keeps_the_old_file(
    many_tensor_model: Path, tmp_path: Path
) -> None:
    """``weightd fetch --out``: a rank that does not fit leaves the previous file whole."""
    with (
        run_daemon(tmp_path, [("many", many_tensor_model)]) as daemon,
        small_disk(tmp_path / "disk", size=24 << 20, limit=256 << 10) as disk,
    ):
        out = disk.directory / "rank.safetensors"

        def fetch(rank: int) -> subprocess.CompletedProcess[str]:
            argv = ["fetch", daemon.target, "--rank", str(rank), "--world-size", "2"]
            return run(disk, [*argv, "--out", str(out)])

        first = fetch(0)
        assert first.returncode == 0, first.stderr
        old = out.read_bytes()
        _is_rank(out, many_tensor_model, 0)

        disk.fill()
        again = fetch(1)
        assert again.returncode == 1, again.stderr
        _one_line_naming(again.stderr, out, disk, command="fetch")
        assert out.read_bytes() == old
        assert disk.files() == [out.name]  # no temporary file left behind

        disk.drain()
        ok = fetch(1)
        assert ok.returncode == 0, ok.stderr
        _is_rank(out, many_tensor_model, 1)
        print(f"full disk simulated with {disk.mode}")


def _many_tensor_model(directory: Path, count: int = 2000) -> Path:
    """A model whose hash-cache entry is large (~100 bytes per tensor)."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"architectures": ["ManyForTest"]}))
    rng = np.random.default_rng(3)
    tensors = {f"t.{i}": rng.standard_normal(4).astype(np.float32) for i in range(count)}
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def test_hash_cache_on_a_full_disk_keeps_the_old_cache_and_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _many_tensor_model(tmp_path / "many")
    want = read_tensors(model)
    # run_daemon points WEIGHTD_CACHE_DIR at tmp/cache: that is the small disk.
    with small_disk(tmp_path / "cache", size=1 << 20, limit=96 << 10) as disk:
        monkeypatch.setattr("tests.conftest.weightd_command", disk.command)
        with run_daemon(tmp_path, [("many", model)]) as d:
            assert "hashed many" in d.log()
        (cache_file,) = (disk.directory / "hashes").iterdir()
        old = cache_file.read_bytes()
        assert len(old) > disk.limit  # the rewrite really crosses the limit in rlimit mode

        shard = model / "model.safetensors"
        stat = shard.stat()
        os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
        disk.fill()
        with run_daemon(tmp_path, [("many", model)]) as d:
            log = d.log()
            assert f"cannot write {cache_file}" in log, log
            assert any(e in log for e in disk.errors), log
            assert "serving continues" in log
            with WeightClient(d.target, timeout=60) as client:
                got = client.fetch(0, 1)
            assert got.keys() == want.keys()
            assert all(torch.equal(got[n], want[n]) for n in want)
        assert cache_file.read_bytes() == old
        assert sorted(os.listdir(disk.directory / "hashes")) == [cache_file.name]


def test_memory_budgets_refuse_precisely_and_the_daemon_keeps_serving(
    lora: Fixture, tmp_path: Path
) -> None:
    base = read_tensors(lora.base_dir)
    config = json.loads((lora.base_dir / "config.json").read_text())
    total = sum(t.numel() * t.element_size() for t in base.values())

    def adapter_bytes(d: Path) -> int:  # what the registry holds: the weights and config
        return sum(
            (d / f).stat().st_size for f in ("adapter_model.safetensors", "adapter_config.json")
        )

    a, b = adapter_bytes(lora.adapter_dir), adapter_bytes(lora.second_dir)
    shm_budget = total * 3 // 4  # one rank of two fits, two do not
    extra = [
        "--adapter-root",
        str(lora.root),
        "--adapter-budget-bytes",
        str(a + b - 1),
        "--shm-budget-bytes",
        str(shm_budget),
    ]
    with run_daemon(tmp_path, [("tiny-llama", lora.base_dir)], extra) as d:
        admin = AdminClient(f"unix://{tmp_path / 'run' / 'admin.sock'}", timeout=60)
        client = WeightClient(d.target, timeout=60)
        try:
            # Shared-memory packs: rank 0 leased, rank 1 does not fit beside it.
            held = client.fetch(0, 2, transport="shm")
            with pytest.raises(ResourceExhaustedError) as err:
                client.fetch(1, 2, transport="shm")
            assert "budget exhausted" in err.value.detail, err.value.detail
            assert str(shm_budget) in err.value.detail
            # ... and everything else is still served, correctly.
            assert_rank(client.fetch(1, 2, transport="grpc"), base, config, 2, 1)
            assert_rank(dict(held), base, config, 2, 0)

            # Adapters: "a" pinned, "b" does not fit beside it.
            admin.load_adapter("a", str(lora.adapter_dir))
            admin.pin_adapter("a")
            with pytest.raises(ResourceExhaustedError) as err:
                admin.load_adapter("b", str(lora.second_dir))
            detail = err.value.detail
            assert f"adapter 'b' needs {b} bytes" in detail, detail
            assert f"adapter budget of {a + b - 1} bytes holds {a}" in detail, detail
            assert [s.name for s in admin.list_adapters()] == ["a"]
            assert client.fetch_adapter("a", 0, 2).tensors
            assert_rank(client.fetch(0, 2, transport="grpc"), base, config, 2, 0)

            # Once room is made, both work again.
            del held
            gc.collect()
            admin.pin_adapter("a", pinned=False)
            assert admin.load_adapter("b", str(lora.second_dir)).name == "b"
            assert_rank(client.fetch(1, 2, transport="shm"), base, config, 2, 1)
            assert d.process.poll() is None
        finally:
            client.close()
            admin.close()


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_usable(), reason="needs CUDA (torch and libcuda.so.1)")
def test_pinned_and_gpu_budgets_on_a_gpu(
    transformers_models: dict[str, Path], tmp_path: Path
) -> None:
    """Over the pin budget a pack is served pageable (never refused); over the GPU budget
    a CUDA IPC pack is RESOURCE_EXHAUSTED naming the numbers, and gRPC still serves."""
    model = transformers_models["llama"]
    base = read_tensors(model)
    config = json.loads((model / "config.json").read_text())
    budget = sum(t.numel() * t.element_size() for t in base.values()) * 3 // 4
    flags = ["--pin", "--pin-budget-bytes", str(budget), "--cuda-ipc"]
    flags += ["--cuda-budget-bytes", str(budget), "--pack-ttl", "60"]
    with (
        run_daemon(tmp_path, [("llama", model)], flags) as d,
        WeightClient(d.target, timeout=120) as client,
    ):
        s0, i0 = client.fetch_with_info(0, 2, transport="shm")
        s1, i1 = client.fetch_with_info(1, 2, transport="shm")
        assert i0.pack is not None and i0.pack.pinned
        assert i1.pack is not None and not i1.pack.pinned  # past the pin budget: pageable
        assert_rank(dict(s1), base, config, 2, 1)
        assert_rank(dict(s0), base, config, 2, 0)  # held: its lease keeps the pack pinned

        g0 = client.fetch(0, 2, device="cuda", transport="cuda_ipc")
        with pytest.raises(ResourceExhaustedError) as err:
            client.fetch(1, 2, device="cuda", transport="cuda_ipc")
        assert err.value.transport == "cuda_ipc"
        assert "budget exhausted" in err.value.detail and str(budget) in err.value.detail
        g1 = client.fetch(1, 2, device="cuda", transport="grpc")
        assert_rank({n: t.cpu() for n, t in g1.items()}, base, config, 2, 1)
        assert_rank({n: t.cpu() for n, t in g0.items()}, base, config, 2, 0)
        assert d.process.poll() is None
