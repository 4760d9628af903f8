"""Where the daemon listens by default, known to both sides.

The daemon binds this path when started without ``--listen``; clients that take no
target (vLLM's loader, whose extra config may omit ``target``) connect to the same
path, so "one flag away" holds without either side repeating the rule.
"""

from __future__ import annotations

import os


def default_socket_path() -> str:
    """``$XDG_RUNTIME_DIR/weightd/weightd.sock``, else ``/run/weightd`` for root, else /tmp."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        base = os.path.join(runtime, "weightd")
    elif os.geteuid() == 0:
        base = "/run/weightd"
    else:
        base = f"/tmp/weightd-{os.geteuid()}"
    return os.path.join(base, "weightd.sock")


def default_target() -> str:
    """The default socket as a gRPC target string."""
    return f"unix://{default_socket_path()}"
