"""Mutual TLS end to end: worker and admin listeners on TCP, certificates made by the test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.conftest import RunningDaemon, run_daemon
from tests.ops.pki import Pair, Pki
from weightd.client import (
    AdminClient,
    PermissionDeniedError,
    WeightClient,
    WeightdError,
    tls_credentials,
)

pytestmark = pytest.mark.e2e


def _creds(pki: Pki, pair: Pair | None, ca: Path | None = None) -> grpc.ChannelCredentials:
    return tls_credentials(
        ca=str(ca or pki.ca),
        cert=None if pair is None else str(pair.cert),
        key=None if pair is None else str(pair.key),
    )


@pytest.fixture(scope="module")
def daemon(
    pki: Pki, demo_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningDaemon]:
    extra = [
        "--tls-cert",
        str(pki.server.cert),
        "--tls-key",
        str(pki.server.key),
        "--tls-client-ca",
        str(pki.ca),
        "--admin-listen",
        "127.0.0.1:0",
        "--admin-allow",
        "admin",
    ]
    with run_daemon(
        tmp_path_factory.mktemp("mtls"),
        [("llama", demo_model)],
        extra,
        listen="127.0.0.1:0",
        credentials=_creds(pki, pki.worker),
    ) as d:
        yield d


def _refused(target: str, credentials: grpc.ChannelCredentials | None) -> WeightdError:
    client = WeightClient(target, timeout=10, credentials=credentials)
    try:
        with pytest.raises(WeightdError) as info:
            client.list_models()
    finally:
        client.close()
    return info.value


def test_worker_with_a_certificate_fetches(daemon: RunningDaemon, pki: Pki) -> None:
    with WeightClient(daemon.target, timeout=60, credentials=_creds(pki, pki.worker)) as client:
        state = client.fetch(1, 2)
    assert state["model.layers.0.self_attn.q_proj.weight"].shape[0] > 0


@pytest.mark.parametrize("who", ["no certificate", "untrusted CA", "plaintext"])
def test_clients_without_a_trusted_certificate_are_refused(
    daemon: RunningDaemon, pki: Pki, who: str
) -> None:
    creds = {
        "no certificate": _creds(pki, None),
        "untrusted CA": _creds(pki, pki.stranger),
        "plaintext": None,
    }[who]
    error = _refused(daemon.target, creds)
    assert error.code is grpc.StatusCode.UNAVAILABLE  # refused in the handshake
    assert daemon.process.poll() is None


def test_admin_needs_an_allowed_identity(daemon: RunningDaemon, pki: Pki) -> None:
    admin_target = daemon.address("admin")
    assert admin_target != daemon.target
    # A worker's (valid) certificate is not an admin identity.
    as_worker = AdminClient(admin_target, timeout=30, credentials=_creds(pki, pki.worker))
    with as_worker, pytest.raises(PermissionDeniedError, match="identity worker is not allowed"):
        as_worker.reload("llama")
    # No certificate at all: refused before any RPC.
    with AdminClient(admin_target, timeout=10, credentials=_creds(pki, None)) as admin:
        with pytest.raises(WeightdError) as info:
            admin.reload("llama")
        assert info.value.code is grpc.StatusCode.UNAVAILABLE
    # The admin identity may reload...
    with AdminClient(admin_target, timeout=60, credentials=_creds(pki, pki.admin)) as admin:
        assert admin.reload("llama").model == "llama"
    # ... but never through the worker listener.
    wrong_door = AdminClient(daemon.target, timeout=30, credentials=_creds(pki, pki.admin))
    with wrong_door, pytest.raises(PermissionDeniedError, match="connect to the admin listener at"):
        wrong_door.reload("llama")
    assert "admin call /weightd.v1.Admin/Reload by admin" in daemon.log()
