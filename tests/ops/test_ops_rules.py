"""Pure rules of the operations layer, table by table, plus collectors fed fake state."""

from __future__ import annotations

import io
import json
import logging
import os
import time
import types
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry

from weightd.server.base import errors
from weightd.server.base.bounds import MAX_REPEATED, check_fields
from weightd.server.daemon.addresses import Address
from weightd.server.daemon.collectors import (
    GpuMemoryCollector,
    PinnedMemoryCollector,
    PinnedState,
    ShmPackCollector,
    ShmPackState,
)
from weightd.server.daemon.listeners import admin_address, host_port
from weightd.server.daemon.security import (
    TlsFiles,
    TlsMaterial,
    check_admin_listener,
    check_tls_files,
    check_worker_listener,
)
from weightd.server.rpc.guards import authorize, identities_from_auth_context
from weightd.server.rpc.interceptors import split_method
from weightd.server.rpc.status import grpc_status
from weightd.server.rpc.streams import StreamWatchdog
from weightd.server.store.residency import (
    PAGE_BYTES,
    resident_bytes,
    resident_bytes_from_vector,
    windows,
)
from weightd.server.telemetry.logs import JsonFormatter, event, format_event
from weightd.server.telemetry.metrics import FAILURE_REASONS, failure_reason
from weightd.v1 import weightd_pb2 as pb

P = PAGE_BYTES


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (errors.HeaderError("f", "bad"), "header"),
        (errors.IndexFileError("f", "bad"), "index"),
        (errors.ConfigError("f", "bad"), "config"),
        (errors.UnsafePathError("f", "bad"), "unsafe_path"),
        (errors.CheckpointError("f", "bad"), "checkpoint"),
        (errors.DataIntegrityError("x"), "digest_mismatch"),
        (errors.NoShardingRules("x"), "sharding_rules"),
        (errors.ModelNotFound("x"), "other"),
        (PermissionError(13, "denied"), "io"),
        (ValueError("bug"), "internal"),
    ],
)
def test_failure_reason_is_bounded(error: BaseException, reason: str) -> None:
    assert failure_reason(error) == reason
    assert reason in FAILURE_REASONS


@pytest.mark.parametrize(
    ("vec", "length", "resident"),
    [
        (b"", 0, 0),
        (b"\x01", 1, 1),
        (b"\x01", P, P),
        (b"\x00", P, 0),
        (b"\x01\x01", P + 10, P + 10),  # last page counts only its file bytes
        (b"\x00\x01", P + 10, 10),
        (b"\x01\x00", P + 10, P),
        (b"\x03\x02", 2 * P, P),  # only the low bit means resident
        (b"\x01\x01\x01", 2 * P, 2 * P),  # a longer vector than needed is fine
    ],
)
def test_resident_bytes_from_vector(vec: bytes, length: int, resident: int) -> None:
    assert resident_bytes_from_vector(vec, length, P) == resident


def test_resident_vector_too_short_is_an_error() -> None:
    with pytest.raises(ValueError, match="1 entries, 2 pages"):
        resident_bytes_from_vector(b"\x01", P + 1, P)


@pytest.mark.parametrize(
    ("size", "window", "expected"),
    [
        (0, P, []),
        (1, P, [(0, 1)]),
        (P, P, [(0, P)]),
        (2 * P + 1, P, [(0, P), (P, P), (2 * P, 1)]),
        (3 * P, 2 * P, [(0, 2 * P), (2 * P, P)]),
    ],
)
def test_windows(size: int, window: int, expected: list[tuple[int, int]]) -> None:
    assert windows(size, window) == expected


def test_residency_of_a_real_file_clamps_a_shrunken_file(tmp_path: Path) -> None:
    path = tmp_path / "shard"
    path.write_bytes(os.urandom(3 * P + 5))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.pread(fd, 3 * P + 5, 0)  # just written and read: in the page cache
        mapped, resident = resident_bytes(fd, 3 * P + 5)
        assert mapped == 3 * P + 5
        assert 0 < resident <= mapped
        os.truncate(path, P + 1)  # shrinks under us: no SIGBUS, clamped to the new size
        mapped, resident = resident_bytes(fd, 3 * P + 5)
        assert mapped == P + 1 and resident <= P + 1
        os.truncate(path, 0)
        assert resident_bytes(fd, 3 * P + 5) == (0, 0)
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    ("model", "names", "needle"),
    [
        ("m", [], None),
        ("m", ["a"] * MAX_REPEATED, None),
        ("m", ["a"] * (MAX_REPEATED + 1), f"has {MAX_REPEATED + 1} elements; the limit is"),
        ("m", ["x" * 1025], "field names is 1025 bytes"),
        ("m" * 257, [], "field model is 257 bytes"),
    ],
)
def test_fetch_bounds(model: str, names: list[str], needle: str | None) -> None:
    """Fetch's fields are bounded by the one request bound every RPC goes through."""
    request = pb.FetchRequest(model=model, names=names)
    if needle is None:
        check_fields(request)
        return
    with pytest.raises(errors.RequestTooLarge, match=needle) as info:
        check_fields(request)
    assert grpc_status(info.value)[0] is grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.parametrize(
    ("auth", "identities"),
    [
        ({}, []),
        ({"transport_security_type": [b"ssl"]}, []),
        ({"x509_common_name": [b"admin"]}, ["admin"]),
        (
            {"x509_common_name": [b"a"], "x509_subject_alternative_name": [b"b", b"a"]},
            ["a", "b"],
        ),
    ],
)
def test_identities_from_auth_context(auth: dict[str, list[bytes]], identities: list[str]) -> None:
    assert identities_from_auth_context(auth) == identities


@pytest.mark.parametrize(
    ("identities", "outcome"),
    [
        ([], grpc.StatusCode.UNAUTHENTICATED),
        (["worker"], grpc.StatusCode.PERMISSION_DENIED),
        (["worker", "admin"], "admin"),
        (["admin"], "admin"),
    ],
)
def test_authorize(identities: list[str], outcome: object) -> None:
    if isinstance(outcome, str):
        assert authorize(identities, frozenset({"admin"})) == outcome
        return
    with pytest.raises(errors.WeightdError) as info:
        authorize(identities, frozenset({"admin"}))
    assert grpc_status(info.value)[0] is outcome


UNIX = Address("unix", path="/run/w/weightd.sock")
LOOP = Address("tcp", host="127.0.0.1", port=7070)
ANY = Address("tcp", host="0.0.0.0", port=7070)
LOOP0 = Address("tcp", host="127.0.0.1", port=0)


@pytest.mark.parametrize(
    ("address", "tls", "insecure", "outcome"),
    [
        (UNIX, False, False, None),
        (LOOP, True, False, None),
        (ANY, True, False, None),
        (LOOP, False, False, "refusing to serve weights on TCP 127.0.0.1:7070 without TLS"),
        (ANY, False, False, "refusing to serve weights on TCP 0.0.0.0:7070 without TLS"),
        (LOOP, False, True, "INSECURE: serving weights over plaintext TCP on 127.0.0.1:7070"),
        (ANY, False, True, "plaintext TCP on non-loopback 0.0.0.0:7070"),
    ],
)
def test_worker_listener_policy(
    address: Address, tls: bool, insecure: bool, outcome: str | None
) -> None:
    if outcome is None or outcome.startswith("INSECURE") or "non-loopback" in outcome:
        warning = check_worker_listener(address, tls=tls, insecure=insecure)
        assert (warning is None) == (outcome is None)
        if outcome is not None:
            assert warning is not None and outcome in warning
        return
    with pytest.raises(errors.SecurityConfigError, match=outcome):
        check_worker_listener(address, tls=tls, insecure=insecure)


MTLS = TlsMaterial(b"cert", b"key", b"ca")
TLS = TlsMaterial(b"cert", b"key", None)


@pytest.mark.parametrize(
    ("address", "tls", "allowed", "outcome"),
    [
        (UNIX, None, frozenset(), None),
        (LOOP, MTLS, frozenset({"admin"}), frozenset({"admin"})),
        (LOOP, None, frozenset({"admin"}), "requires mutual TLS"),
        (LOOP, TLS, frozenset({"admin"}), "requires mutual TLS"),
        (LOOP, MTLS, frozenset(), "needs --admin-allow"),
    ],
)
def test_admin_listener_policy(
    address: Address, tls: TlsMaterial | None, allowed: frozenset[str], outcome: object
) -> None:
    if isinstance(outcome, str):
        with pytest.raises(errors.SecurityConfigError, match=outcome):
            check_admin_listener(address, tls=tls, allowed=allowed)
    else:
        assert check_admin_listener(address, tls=tls, allowed=allowed) == outcome


@pytest.mark.parametrize(
    ("files", "needle"),
    [
        (TlsFiles(), None),
        (TlsFiles("c", "k"), None),
        (TlsFiles("c", "k", "ca"), None),
        (TlsFiles("c"), "must be given together"),
        (TlsFiles(key="k"), "must be given together"),
        (TlsFiles(client_ca="ca"), "needs --tls-cert"),
    ],
)
def test_tls_flags(files: TlsFiles, needle: str | None) -> None:
    if needle is None:
        check_tls_files(files)
    else:
        with pytest.raises(errors.SecurityConfigError, match=needle):
            check_tls_files(files)


@pytest.mark.parametrize(
    ("text", "worker", "expected"),
    [
        (None, UNIX, Address("unix", path="/run/w/admin.sock")),
        ("none", UNIX, None),
        ("NONE", LOOP, None),
        ("unix:///x/a.sock", UNIX, Address("unix", path="/x/a.sock")),
        # both on port 0: two different ports once bound
        ("127.0.0.1:0", Address("tcp", host="127.0.0.1", port=0), LOOP0),
        ("127.0.0.1:9", LOOP, Address("tcp", host="127.0.0.1", port=9)),
    ],
)
def test_admin_address(text: str | None, worker: Address, expected: Address | None) -> None:
    assert admin_address(text, worker) == expected


@pytest.mark.parametrize("text", ["unix:///run/w/weightd.sock", "127.0.0.1:7070"])
def test_admin_address_must_differ_from_the_worker(text: str) -> None:
    worker = UNIX if text.startswith("unix") else LOOP
    with pytest.raises(errors.SecurityConfigError, match="is the worker listener"):
        admin_address(text, worker)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("9464", ("127.0.0.1", 9464)), (":0", ("127.0.0.1", 0)), ("0.0.0.0:9", ("0.0.0.0", 9))],
)
def test_metrics_host_port(text: str, expected: tuple[str, int]) -> None:
    assert host_port(text) == expected


@pytest.mark.parametrize(
    ("full", "expected"),
    [
        ("/weightd.v1.Weights/Fetch", ("weightd.v1.Weights", "Fetch")),
        ("/grpc.health.v1.Health/Check", ("grpc.health.v1.Health", "Check")),
    ],
)
def test_split_method(full: str, expected: tuple[str, str]) -> None:
    assert split_method(full) == expected


@pytest.mark.parametrize(
    ("name", "fields", "line"),
    [
        ("serving", {"models": "a,b"}, "serving models=a,b"),
        ("exit", {"status": 0, "aborted": False}, "exit status=0 aborted=false"),
        ("reload", {"error": "bad thing: x"}, 'reload error="bad thing: x"'),
        ("verified", {"seconds": 1.23456}, "verified seconds=1.235"),
        ("drain", {"empty": ""}, 'drain empty=""'),
    ],
)
def test_format_event(name: str, fields: dict[str, object], line: str) -> None:
    assert format_event(name, fields) == line


def test_json_log_lines_carry_event_fields() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("weightd")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        event("reload", model="m", outcome="ok", seconds=0.5)
        logging.getLogger("weightd.x").info("plain %s", "message")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["event"] == "reload" and first["model"] == "m" and first["seconds"] == 0.5
    assert first["level"] == "INFO" and first["logger"] == "weightd"
    assert second["msg"] == "plain message" and "event" not in second


def test_unknown_event_names_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown lifecycle event"):
        event("started-ish")


# --- collectors with fake state -----------------------------------------------------------


def _fake_torch(available: bool, initialized: bool, devices: int) -> types.SimpleNamespace:
    cuda = types.SimpleNamespace(
        is_available=lambda: available,
        is_initialized=lambda: initialized,
        device_count=lambda: devices,
        memory_allocated=lambda i: 1000 * (i + 1),
        memory_reserved=lambda i: 4000 * (i + 1),
    )
    return types.SimpleNamespace(cuda=cuda)


@pytest.mark.parametrize(
    ("torch", "series"),
    [
        (None, 0),
        (_fake_torch(False, False, 0), 0),
        (_fake_torch(True, False, 2), 0),  # CUDA present but unused here: no context created
        (_fake_torch(True, True, 2), 2),
    ],
)
def test_gpu_collector_reports_only_real_state(torch: object, series: int) -> None:
    registry = CollectorRegistry()
    registry.register(GpuMemoryCollector(lambda: torch))
    for device in range(2):
        allocated = registry.get_sample_value(
            "weightd_gpu_allocated_bytes", {"device": f"cuda:{device}"}
        )
        reserved = registry.get_sample_value(
            "weightd_gpu_reserved_bytes", {"device": f"cuda:{device}"}
        )
        if device < series:
            assert allocated == 1000 * (device + 1) and reserved == 4000 * (device + 1)
        else:
            assert allocated is None and reserved is None


def test_gpu_collector_without_torch_imported_yields_nothing() -> None:
    """The real default source: this daemon process never imported torch."""
    registry = CollectorRegistry()
    registry.register(GpuMemoryCollector(lambda: None))
    assert list(registry.collect()) == []


def test_pinned_and_shm_collectors_follow_their_source() -> None:
    registry = CollectorRegistry()
    pinned: list[PinnedState | None] = [None]
    packs: list[ShmPackState] = []
    registry.register(PinnedMemoryCollector(lambda: pinned[0]))
    registry.register(ShmPackCollector(lambda: packs))
    assert registry.get_sample_value("weightd_pinned_bytes") is None
    assert registry.get_sample_value("weightd_shm_pack_bytes", {"model": "m"}) is None
    pinned[0] = PinnedState(used_bytes=3 << 30, budget_bytes=4 << 30)
    packs.append(ShmPackState("m", bytes=1 << 20, leases=3))
    assert registry.get_sample_value("weightd_pinned_bytes") == 3 << 30
    assert registry.get_sample_value("weightd_pinned_budget_bytes") == 4 << 30
    assert registry.get_sample_value("weightd_shm_pack_bytes", {"model": "m"}) == 1 << 20
    assert registry.get_sample_value("weightd_shm_pack_leases", {"model": "m"}) == 3


class _FakeContext:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def test_watchdog_cancels_only_streams_past_the_cap() -> None:
    dog = StreamWatchdog(0.05, slack_seconds=0)
    late, released = _FakeContext(), _FakeContext()
    dog.watch(late, "late")  # type: ignore[arg-type]
    dog.release(dog.watch(released, "released"))  # type: ignore[arg-type]
    try:
        for _ in range(200):  # bounded wait for the watchdog thread
            if late.cancelled:
                break
            time.sleep(0.05)
        assert late.cancelled
        assert not released.cancelled
    finally:
        dog.close()


def test_watchdog_cancels_only_streams_blocked_past_the_idle_bound() -> None:
    dog = StreamWatchdog(0, idle_seconds=0.05)
    stuck, moving, working = _FakeContext(), _FakeContext(), _FakeContext()
    stuck_token = dog.watch(stuck, "stuck")  # type: ignore[arg-type]
    moving_token = dog.watch(moving, "moving")  # type: ignore[arg-type]
    dog.watch(working, "working")  # type: ignore[arg-type]  # never blocked: computing
    dog.blocked(stuck_token)
    try:
        for _ in range(200):  # bounded wait for the watchdog thread
            dog.blocked(moving_token)  # the client takes each message at once
            dog.moving(moving_token)
            if stuck.cancelled:
                break
            time.sleep(0.01)
        assert stuck.cancelled
        assert not moving.cancelled and not working.cancelled
    finally:
        dog.close()
