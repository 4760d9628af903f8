"""Security defaults for listeners: who may listen how, and the TLS material they use.

The policy, in one place (:func:`check_worker_listener`, :func:`check_admin_listener`,
both pure):

* a Unix socket needs no TLS: its 0700 directory already limits who can connect;
* TCP requires TLS (``--tls-cert``/``--tls-key``) unless ``--insecure`` is given, and
  then the daemon logs a loud warning, louder still off loopback;
* ``--tls-client-ca`` turns TLS into mutual TLS: clients without a certificate signed
  by that CA are refused during the handshake;
* the admin listener over TCP always requires mutual TLS *and* an allow-list of client
  identities (``--admin-allow``): ``--insecure`` never opens admin RPCs to the network.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from ..base.errors import SecurityConfigError
from .addresses import Address


@dataclass(frozen=True)
class TlsFiles:
    """Paths given on the command line (any may be None)."""

    cert: str | None = None
    key: str | None = None
    client_ca: str | None = None

    @property
    def enabled(self) -> bool:
        return self.cert is not None


@dataclass(frozen=True)
class TlsMaterial:
    """The bytes read from :class:`TlsFiles`, read once at start-up."""

    cert: bytes
    key: bytes
    client_ca: bytes | None

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )


def check_tls_files(files: TlsFiles) -> None:
    """Refuse incomplete TLS flags (pure)."""
    if (files.cert is None) != (files.key is None):
        raise SecurityConfigError("--tls-cert and --tls-key must be given together")
    if files.client_ca is not None and files.cert is None:
        raise SecurityConfigError(
            "--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)"
        )


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 20)
    except OSError as exc:
        raise SecurityConfigError(f"{flag} {path}: cannot read: {exc.strerror}") from None
    if b"-----BEGIN " not in data:
        raise SecurityConfigError(f"{flag} {path}: not a PEM file")
    return data


def read_tls(files: TlsFiles) -> TlsMaterial | None:
    """Read the PEM files, or None when TLS is not configured."""
    check_tls_files(files)
    if files.cert is None or files.key is None:
        return None
    return TlsMaterial(
        cert=_read(files.cert, "--tls-cert"),
        key=_read(files.key, "--tls-key"),
        client_ca=None if files.client_ca is None else _read(files.client_ca, "--tls-client-ca"),
    )


def check_worker_listener(address: Address, *, tls: bool, insecure: bool) -> str | None:
    """Refuse plaintext TCP without ``--insecure``; return the warning to log loudly (pure)."""
    if address.kind == "unix":
        return None
    if tls:
        return None
    where = f"{address.host}:{address.port}"
    if not insecure:
        raise SecurityConfigError(
            f"refusing to serve weights on TCP {where} without TLS; give --tls-cert and "
            "--tls-key (and --tls-client-ca for mutual TLS), use a Unix socket, or pass "
            "--insecure to accept plaintext"
        )
    if address.is_loopback:
        return (
            f"INSECURE: serving weights over plaintext TCP on {where} (--insecure); any local "
            "user can connect"
        )
    return (
        f"INSECURE: serving weights over plaintext TCP on non-loopback {where} (--insecure): "
        "anyone on the network can read every weight, and nothing is authenticated"
    )


def check_admin_listener(
    address: Address, *, tls: TlsMaterial | None, allowed: frozenset[str]
) -> frozenset[str] | None:
    """The identities the admin listener admits (None: the Unix socket's permissions do).

    Admin over TCP requires mutual TLS and a non-empty ``--admin-allow`` (pure).
    """
    if address.kind == "unix":
        return None
    where = f"{address.host}:{address.port}"
    if tls is None or not tls.mutual:
        raise SecurityConfigError(
            f"admin listener on TCP {where} requires mutual TLS (--tls-cert, --tls-key, "
            "--tls-client-ca); --insecure does not apply to admin RPCs"
        )
    if not allowed:
        raise SecurityConfigError(
            f"admin listener on TCP {where} needs --admin-allow IDENTITY (a client "
            "certificate CN or SAN allowed to call admin RPCs)"
        )
    return allowed
