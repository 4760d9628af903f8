"""Channel credentials for a daemon that serves TLS or mutual TLS, from PEM files.

``tls_credentials(ca="ca.pem")`` trusts the daemon's CA; add ``cert`` and ``key``
for mutual TLS (a daemon started with ``--tls-client-ca`` refuses clients without
them during the handshake). Pass the result as ``WeightClient(..., credentials=...)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"{what} {path}: cannot read: {exc.strerror}") from None


def tls_credentials(
    ca: str | None = None, cert: str | None = None, key: str | None = None
) -> grpc.ChannelCredentials:
    """TLS credentials; ``ca`` None trusts the system roots; ``cert`` with ``key`` for mTLS."""
    if (cert is None) != (key is None):
        raise ValueError("a client certificate needs its key, and a key its certificate")
    import grpc

    return grpc.ssl_channel_credentials(
        root_certificates=None if ca is None else _read(ca, "CA file"),
        private_key=None if key is None else _read(key, "key file"),
        certificate_chain=None if cert is None else _read(cert, "certificate file"),
    )
