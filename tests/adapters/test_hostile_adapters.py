"""Hostile adapter directories and rules files against a real daemon, out of process (#15 1, 6).

Each attack is bounded in count and time, over Unix sockets only, and each checks
that the daemon's health ``Check`` keeps answering while it runs. Before:

* ``target_modules: "(a+)+$"`` and a 30-character module name made ``LoadAdapter``
  backtrack for minutes (2x per character) with the GIL held: health stopped answering;
  a ``--rules`` pattern did the same to the first ``tp=2`` Fetch;
* every failed load of a large adapter kept the bytes it read until a later garbage
  collection (exception -> traceback -> frame -> bytes, in a cycle);
* an adapter over the budget was read whole before being refused;
* a config of any size up to 64 MiB, with any number of targets, was parsed and held.

Bounds on time here are correctness bounds (the old code took minutes), far above
what the calls take; nothing is measured.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from safetensors.torch import load_file, save_file

from tests.adapters.conftest import BASE_CONFIG, TARGETS, Fixture
from tests.conftest import RunningDaemon, run_daemon
from weightd.client import WeightClient
from weightd.client.api.admin import AdminClient
from weightd.client.base.errors import (
    DataLossError,
    FailedPreconditionError,
    ResourceExhaustedError,
)
from weightd.server.plan.builtin_rules import LLAMA_DOC

pytestmark = pytest.mark.e2e

#: A module name Python's re needs 2**30 steps to refuse against "(a+)+$".
EVIL_MODULE = "a" * 30 + "!"


def _admin(tmp: Path) -> AdminClient:
    return AdminClient(f"unix://{tmp / 'run' / 'admin.sock'}", timeout=60)


@contextmanager
def health_probe(target: str) -> Iterator[list[float]]:
    """Health ``Check`` every 50 ms with a 5 s deadline while the block runs; afterwards
    assert every one answered SERVING. Yields the latencies."""
    latencies: list[float] = []
    failures: list[BaseException] = []
    done = threading.Event()

    def probe() -> None:
        with grpc.insecure_channel(target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not done.is_set():
                started = time.monotonic()
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                except grpc.RpcError as exc:
                    failures.append(exc)
                    return
                latencies.append(time.monotonic() - started)
                if reply.status != health_pb2.HealthCheckResponse.SERVING:
                    failures.append(AssertionError(f"health said {reply.status}"))
                    return
                time.sleep(0.05)

    thread = threading.Thread(target=probe)
    thread.start()
    try:
        yield latencies
    finally:
        done.set()
        thread.join(30)
    assert not failures, failures[0]
    assert latencies  # it really ran while the attack did


def _timed(call: Callable[[], object]) -> tuple[float, BaseException | None]:
    started = time.monotonic()
    try:
        call()
    except Exception as exc:
        return time.monotonic() - started, exc
    return time.monotonic() - started, None


def _adapter_dir(
    root: Path, name: str, config: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(d / "adapter_model.safetensors"))
    return d


def _config(lora: Fixture, **changes: Any) -> dict[str, Any]:
    cfg = json.loads((lora.adapter_dir / "adapter_config.json").read_text())
    cfg.update(changes)
    return cfg


def test_catastrophic_target_regex_is_answered_at_once(lora: Fixture, tmp_path: Path) -> None:
    root = tmp_path / "adapters"
    evil = {
        f"base_model.model.{EVIL_MODULE}.lora_A.weight": torch.zeros(4, 64),
        f"base_model.model.{EVIL_MODULE}.lora_B.weight": torch.zeros(64, 4),
    }
    d = _adapter_dir(root, "evil", _config(lora, target_modules="(a+)+$", rank_pattern={}), evil)
    # A pattern RE2 cannot run is refused by name, not run by the backtracking engine.
    lookaround = _adapter_dir(
        root, "lookaround", _config(lora, target_modules=r"(?=a)(a+)+$"), evil
    )
    extra = ["--adapter-root", str(root)]
    with run_daemon(tmp_path, [("tiny-llama", lora.base_dir)], extra) as daemon:
        admin = _admin(tmp_path)
        with health_probe(daemon.target):
            for _ in range(3):
                took, err = _timed(lambda: admin.load_adapter("evil", str(d)))
                assert isinstance(err, FailedPreconditionError), err
                assert f"module '{EVIL_MODULE}' has LoRA weights but is not matched" in str(err)
                assert took < 10, took
            took, err = _timed(lambda: admin.load_adapter("evil", str(lookaround)))
            assert isinstance(err, FailedPreconditionError), err
            assert "adapter_config.json: field 'target_modules': " in str(err)
            assert "cannot be matched in linear time" in str(err)
        assert admin.list_adapters() == []
        admin.close()


def test_catastrophic_rules_pattern_does_not_stall_a_tp2_fetch(
    lora: Fixture, tmp_path: Path
) -> None:
    table = copy.deepcopy(LLAMA_DOC)
    table["family"] = "evil-llama"
    # Tried first on every tensor name (38+ characters): 2**38 steps for Python's re.
    table["rules"] = [{"match": "^(.+)+X$", "split": "replicated"}, *table["rules"]]
    rules = tmp_path / "evil-rules.json"
    rules.write_text(json.dumps(table))
    extra = ["--rules", str(rules)]
    with run_daemon(tmp_path, [("tiny-llama", lora.base_dir)], extra) as daemon:
        with health_probe(daemon.target), WeightClient(daemon.target, timeout=30) as client:
            took, err = _timed(lambda: client.fetch(1, 2, transport="grpc"))
            assert err is None, err
            assert took < 20, took
            state = client.fetch(0, 2, transport="grpc")
        q = state["model.layers.0.self_attn.q_proj.weight"]
        assert tuple(q.shape) == (BASE_CONFIG["hidden_size"] // 2, BASE_CONFIG["hidden_size"])


def test_weightd_plan_refuses_a_rules_pattern_it_cannot_run_in_linear_time(
    lora: Fixture, tmp_path: Path
) -> None:
    """The CLI compiles rules files through the same engine: one line naming file and rule."""
    import subprocess

    from tests.conftest import weightd_command

    table = copy.deepcopy(LLAMA_DOC)
    table["family"] = "evil-llama"
    table["rules"] = [{"match": r"(?<=x)\.q_proj\.weight$", "split": "column"}, *table["rules"]]
    rules = tmp_path / "lookbehind.json"
    rules.write_text(json.dumps(table))
    cmd = weightd_command("plan", str(lora.base_dir), "--tp", "2", "--rules", str(rules))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode != 0
    assert f"{rules}: rules[0].match " in done.stderr, done.stderr
    assert "cannot be matched in linear time" in done.stderr
    assert "Traceback" not in done.stderr


def _big_adapter(lora: Fixture, root: Path, name: str, r: int) -> tuple[Path, int]:
    """A valid adapter of about 8 KB x r (every targeted module of both layers, fp32)."""
    h, i = BASE_CONFIG["hidden_size"], BASE_CONFIG["intermediate_size"]
    kv = h // BASE_CONFIG["num_attention_heads"] * BASE_CONFIG["num_key_value_heads"]
    shapes = {
        "self_attn.q_proj": (h, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, h),
        "mlp.gate_proj": (i, h),
        "mlp.up_proj": (i, h),
        "mlp.down_proj": (h, i),
    }
    tensors = {}
    for layer in range(BASE_CONFIG["num_hidden_layers"]):
        for module, (out, inn) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.zeros(r, inn)
            tensors[f"{prefix}.lora_B.weight"] = torch.zeros(out, r)
    config = _config(lora, r=r, lora_alpha=2 * r, target_modules=TARGETS, rank_pattern={})
    d = _adapter_dir(root, name, config, tensors)
    return d, (d / "adapter_model.safetensors").stat().st_size


def _status_kb(daemon: RunningDaemon, field: str) -> int:
    for line in Path(f"/proc/{daemon.process.pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/<pid>/status")


def test_failed_loads_return_their_memory_when_the_call_ends(lora: Fixture, tmp_path: Path) -> None:
    root = tmp_path / "adapters"
    d, size = _big_adapter(lora, root, "big", 12288)
    assert size > 90 << 20
    extra = ["--adapter-root", str(root)]
    with run_daemon(tmp_path, [("tiny-llama", lora.base_dir)], extra) as daemon:
        admin = _admin(tmp_path)
        wrong = "sha256:" + "0" * 64
        # One failure first: what the first load allocates once (imports, caches) is
        # not what this test is about.
        with pytest.raises(DataLossError, match="adapter digest: expected sha256:00"):
            admin.load_adapter("big", str(d), expected_digest=wrong)
        baseline = _status_kb(daemon, "VmRSS") << 10
        rss = []
        with health_probe(daemon.target):
            for _ in range(5):
                with pytest.raises(DataLossError):
                    admin.load_adapter("big", str(d), expected_digest=wrong)
                rss.append(_status_kb(daemon, "VmRSS") << 10)
        # Each load reads the whole file (> 90 MiB); kept, five would add > 450 MiB.
        assert max(rss) - baseline < size, (baseline, rss, size)
        assert admin.list_adapters() == []
        # And a good load of the same adapter still works afterwards.
        assert admin.load_adapter("big", str(d)).nbytes >= size
        admin.close()


def test_an_adapter_over_the_budget_is_refused_before_it_is_read(
    lora: Fixture, tmp_path: Path
) -> None:
    root = tmp_path / "adapters"
    d, size = _big_adapter(lora, root, "big", 12288)
    extra = ["--adapter-root", str(root), "--adapter-root", str(lora.root)]
    extra += ["--adapter-budget-bytes", str(1 << 20)]
    with run_daemon(tmp_path, [("tiny-llama", lora.base_dir)], extra) as daemon:
        admin = _admin(tmp_path)
        peak = _status_kb(daemon, "VmHWM") << 10
        with health_probe(daemon.target):
            for _ in range(3):
                took, err = _timed(lambda: admin.load_adapter("big", str(d)))
                assert isinstance(err, ResourceExhaustedError), err
                assert took < 20, took
                assert "needs" in str(err) and "the adapter budget of 1048576 bytes" in str(err)
        # The peak resident size never grew by the file: it was not read.
        assert (_status_kb(daemon, "VmHWM") << 10) - peak < size // 2
        # An adapter that fits still loads under the same budget.
        assert admin.load_adapter("small", str(lora.adapter_dir)).nbytes < 1 << 20
        admin.close()


def test_a_huge_config_is_refused_from_its_size_and_its_target_count(
    lora: Fixture, tmp_path: Path
) -> None:
    root = tmp_path / "adapters"
    good = load_file(str(lora.adapter_dir / "adapter_model.safetensors"))
    names = [f"model.layers.{i}.self_attn.q_proj_{i:07d}" for i in range(70_000)]
    many = _adapter_dir(root, "many", _config(lora, target_modules=[*TARGETS, *names]), good)
    assert (many / "adapter_config.json").stat().st_size < 4 << 20
    huge = _adapter_dir(
        root, "huge", _config(lora, target_modules=[*TARGETS, *names, *names]), good
    )
    assert (huge / "adapter_config.json").stat().st_size > 4 << 20
    extra = ["--adapter-root", str(root)]
    with run_daemon(tmp_path, [("tiny-llama", lora.base_dir)], extra) as daemon:
        admin = _admin(tmp_path)
        with health_probe(daemon.target):
            took, err = _timed(lambda: admin.load_adapter("many", str(many)))
            assert isinstance(err, FailedPreconditionError), err
            assert "field 'target_modules' lists 70007 names; the limit is 65536" in str(err)
            assert took < 20, took
            took, err = _timed(lambda: admin.load_adapter("huge", str(huge)))
            assert isinstance(err, FailedPreconditionError), err
            assert "adapter_config.json: " in str(err)
            assert "larger than the 4194304-byte limit" in str(err)
        assert admin.list_adapters() == []
        admin.close()
