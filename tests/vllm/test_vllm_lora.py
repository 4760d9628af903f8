"""weightd's LoRA adapters in vLLM's real OpenAI server (CPU build), resolved by name.

One daemon (local root and an ``s3://`` root on a real SeaweedFS) and one API-server
process per TP size carry every check (engine starts cost 40-90 s here):

* TP=1 uses the middleware route (``--middleware ...WeightdLoRAMiddleware``, no
  development switch): tokens and logprobs, refusals, hot-swap with a request in
  flight, prefix cache per version, unload, single-flight, ``s3://``, more adapters
  than ``max_loras``;
* TP=2 uses the resolver route (``WEIGHTD_LORA`` + ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``):
  tokens and logprobs, and a refusal through vLLM's own error path.

The reference for every adapter is vLLM loading it from its own directory
(``--lora-modules ref-<name>=<dir>``) in the same engine, asked one request at a time.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.vllm_api import ApiServer
from tests.vllm.lora_world import MAX_LORAS, World, running_world, server
from weightd.client import WeightClient
from weightd.client.api.admin import AdminClient
from weightd.client.transports.local import local_stats
from weightd.client.transports.selection import side_socket_path
from weightd.vllm.lora.shared import shared_path

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]

PROMPTS = [[1, 5, 9, 200, 7], [3, 3, 30, 300, 17, 2]]
#: Longer than one KV block (128 tokens on vLLM's CPU build): its prefix is cached.
LONG = list(range(3, 203))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, vllm_python: Path) -> Iterator[World]:
    with running_world(tmp_path_factory.mktemp("vllm-lora")) as w:
        yield w


@pytest.fixture
def tp1(world: World, vllm_python: Path) -> ApiServer:
    return server(world, vllm_python, 1)


@pytest.fixture
def tp2(world: World, vllm_python: Path) -> ApiServer:
    return server(world, vllm_python, 2)


def generate(s: ApiServer, model: str, prompt: list[int], max_tokens: int = 8) -> dict[str, Any]:
    reply = s.complete(model, prompt, max_tokens)
    choice = reply["choices"][0]
    return {
        "model": reply["model"],
        "tokens": list(choice["token_ids"]),
        "logprobs": list(choice["logprobs"]["token_logprobs"]),
        "cached": (reply.get("usage") or {}).get("prompt_tokens_details", {}).get("cached_tokens"),
    }


def version_of(model: str, name: str) -> int:
    m = re.fullmatch(rf"{re.escape(name)}@v(\d+)", model)
    assert m, f"response model {model!r} does not name a version of {name!r}"
    return int(m.group(1))


def same_as_directory(s: ApiServer, name: str, prompts: list[list[int]] = PROMPTS) -> int:
    """``name`` through weightd gives vLLM's tokens and logprobs for its directory; the
    version it was served as."""
    versions = set()
    for prompt in prompts:
        ref = generate(s, f"ref-{name}", prompt)
        got = generate(s, name, prompt)
        assert got["tokens"] == ref["tokens"], (name, prompt)
        assert got["logprobs"] == ref["logprobs"], (name, prompt)
        versions.add(version_of(got["model"], name))
    assert len(versions) == 1
    return versions.pop()


def metric(world: World, name: str) -> float:
    with urllib.request.urlopen(world.metrics_url, timeout=30) as r:  # loopback only
        m = re.search(rf"^{re.escape(name)} (\S+)$", r.read().decode(), re.M)
    return float(m.group(1)) if m else 0.0


def parallel(n: int, fn: Callable[[int], Any]) -> list[Any]:
    """``fn(i)`` for i in range(n), each on its own thread, started together."""
    barrier = threading.Barrier(n)
    out: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait()
            out[i] = fn(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors[0]
    return out


# --- TP=1: the middleware route ---------------------------------------------------------


def base_name(s: ApiServer) -> str:
    """The name vLLM serves the base model under (its directory)."""
    with urllib.request.urlopen(f"{s.url}/v1/models", timeout=30) as reply:  # loopback only
        name: str = json.loads(reply.read())["data"][0]["id"]
        return name


def test_tp1_tokens_and_logprobs_equal_vllm_from_the_directory(
    tp1: ApiServer, world: World
) -> None:
    same_as_directory(tp1, "good")  # attention + MLP, rank_pattern
    # The adapter changes the output: the comparison is not vacuous.
    base = generate(tp1, base_name(tp1), PROMPTS[0])["tokens"]
    assert generate(tp1, "good", PROMPTS[0])["tokens"] != base
    # Handed over through the daemon's shared pack: no private copy written, the worker
    # mapped and verified the pack.
    assert not (world.tmp / "copies-tp1").exists()
    assert re.search(r"adapter 'good' version \d+ mapped from the daemon's pack", tp1.log())


def test_lora_model_from_the_shared_pack_equals_vllms_from_the_directory(
    world: World, vllm_python: Path
) -> None:
    """No engine: vLLM's own ``_load_adapter`` steps, through the wrapped class methods."""
    assert world.daemon is not None
    status = WeightClient(world.daemon.target, timeout=60).resolve_adapter("good", load=True)
    path = shared_path("good", status.version, status.digest)
    env = dict(os.environ, WEIGHTD_LORA=json.dumps({"target": world.daemon.target}))
    script = Path(__file__).with_name("lora_model_check.py")
    done = subprocess.run(
        [str(vllm_python), str(script), path, str(world.dirs["good"])],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["modules"] > 0 and got["differ"] == [] and got["extra"] == []
    assert got["ranks"] == [4, 8]  # rank_pattern kept: PEFT's config, byte for byte
    assert got["views"] > 0  # zero copy: lora_a still views the daemon's pack


@pytest.mark.parametrize(
    ("name", "status", "reason"),
    [
        ("tampered", 400, r"refused: .*(header|bytes|size|data)"),
        ("mismatch", 400, r"refused: .*adapter digest: expected sha256:0000"),
        ("otherbase", 400, r"refused: .*another-llama"),
        ("novouch", 400, r"refused: .*nothing vouches for its bytes"),
        ("nosuch", 404, r"not found: .*under no adapter root"),
    ],
)
def test_tp1_refusals_name_the_adapter_and_reason(
    tp1: ApiServer, name: str, status: int, reason: str
) -> None:
    got_status, reply = tp1.post(
        "/v1/completions", {"model": name, "prompt": PROMPTS[0], "max_tokens": 4}
    )
    assert got_status == status, reply
    message = reply["error"]["message"]
    assert message.startswith(f"weightd adapter {name!r} "), message
    assert re.search(reason, message), message
    # The engine keeps serving: the next request with a good adapter works.
    same_as_directory(tp1, "good", PROMPTS[:1])


def test_tp1_hot_swap_in_flight_request_finishes_on_the_old_version(
    tp1: ApiServer, world: World
) -> None:
    admin = AdminClient(world.admin_target, timeout=120)
    v1 = admin.load_adapter("swap", str(world.dirs["v1"]))
    ref_v1 = generate(tp1, "ref-v1", PROMPTS[1], 240)
    ref_v2 = generate(tp1, "ref-v2", PROMPTS[1], 8)
    first = generate(tp1, "swap", PROMPTS[1], 240)
    assert version_of(first["model"], "swap") == v1.version
    assert first["tokens"] == ref_v1["tokens"]
    assert ref_v1["tokens"][:8] != ref_v2["tokens"], "v1 and v2 must be told apart"
    # The long prompt on v1, twice: the second reuses v1's cached prefix.
    assert generate(tp1, "swap", LONG, 2)["cached"] == 0
    assert generate(tp1, "swap", LONG, 2)["cached"] >= 128

    stream = tp1.stream("swap", PROMPTS[1], 240)
    events = [next(stream)]  # in flight: the engine has produced its first token
    assert not any(c.get("finish_reason") for c in events[0]["choices"])
    v2 = admin.load_adapter("swap", str(world.dirs["v2"]))  # publish v2
    after = generate(tp1, "swap", PROMPTS[1], 8)
    assert version_of(after["model"], "swap") == v2.version
    assert after["tokens"] == ref_v2["tokens"]
    events += list(stream)
    in_flight = [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]
    assert {e["model"] for e in events} == {f"swap@v{v1.version}"}
    assert in_flight == ref_v1["tokens"], "the request in flight must finish on v1, unmixed"

    # v2 never reuses v1's cached blocks: the same long prompt starts cold on v2, and
    # gives v2's tokens.
    cold = generate(tp1, "swap", LONG, 4)
    assert cold["cached"] == 0 and cold["tokens"] == generate(tp1, "ref-v2", LONG, 4)["tokens"]

    admin.unload_adapter("swap")
    status, reply = tp1.post("/v1/completions", {"model": "swap", "prompt": PROMPTS[0]})
    assert status == 404 and "weightd adapter 'swap' not found" in reply["error"]["message"]
    same_as_directory(tp1, "good", PROMPTS[:1])


def test_tp1_no_request_mixes_versions_while_swapping(tp1: ApiServer, world: World) -> None:
    """Four clients ask without pause while the operator publishes six versions, each
    once a client was answered by the one before: every answer is exactly the tokens of
    the content its version names."""
    admin = AdminClient(world.admin_target, timeout=120)
    refs = {d: generate(tp1, f"ref-{d}", PROMPTS[0], 16)["tokens"] for d in ("v1", "v2")}
    content: dict[int, str] = {}
    content[admin.load_adapter("mix", str(world.dirs["v1"])).version] = "v1"
    done = threading.Event()
    answers: list[tuple[int, list[int]]] = []

    def ask(i: int) -> None:
        while not done.is_set():
            got = generate(tp1, "mix", PROMPTS[0], 16)
            answers.append((version_of(got["model"], "mix"), got["tokens"]))

    runner = threading.Thread(target=parallel, args=(4, ask))
    runner.start()
    try:
        for i in range(6):
            version = max(content)
            deadline = time.monotonic() + 300
            while not any(v == version for v, _ in answers) and time.monotonic() < deadline:
                time.sleep(0.05)
            d = ("v2", "v1")[i % 2]
            content[admin.load_adapter("mix", str(world.dirs[d])).version] = d
    finally:
        done.set()
        runner.join(600)
    assert len({v for v, _ in answers}) >= 6, "the swaps must have been seen"
    for version, tokens in answers:
        assert tokens == refs[content[version]], f"version {version} mixed"
    admin.unload_adapter("mix")


def test_tp1_single_flight(tp1: ApiServer, world: World) -> None:
    loads = metric(world, "weightd_adapter_loads_total")
    got = parallel(16, lambda i: generate(tp1, "sf", PROMPTS[0]))
    assert metric(world, "weightd_adapter_loads_total") == loads + 1
    assert len({g["model"] for g in got}) == 1 and len({tuple(g["tokens"]) for g in got}) == 1
    assert got[0]["tokens"] == generate(tp1, "ref-sf", PROMPTS[0])["tokens"]
    # One hand-over and one vLLM load for all 16.
    log = tp1.log()
    for what in (": vLLM's workers map the daemon's pack", " serves new requests"):
        assert len(re.findall(rf"adapter 'sf' version \d+ \(sha256:\w+\){what}", log)) == 1
    assert len(re.findall(r"adapter 'sf' version \d+ mapped from the daemon's pack", log)) == 1


def test_tp1_adapter_from_an_s3_root(tp1: ApiServer) -> None:
    same_as_directory(tp1, "s3only")


def test_tp1_more_adapters_than_max_loras(tp1: ApiServer) -> None:
    names = ["a1", "a2", "a3", "a4"]
    assert len(names) > MAX_LORAS
    refs = {n: generate(tp1, f"ref-{n}", PROMPTS[1], 12)["tokens"] for n in names}
    assert len({tuple(t) for t in refs.values()}) == len(names), "adapters must differ"
    got = parallel(8, lambda i: (names[i % 4], generate(tp1, names[i % 4], PROMPTS[1], 12)))
    for name, g in got:
        assert version_of(g["model"], name) > 0
        assert g["tokens"] == refs[name], name


# --- TP=2: the resolver route -----------------------------------------------------------


def test_tp2_tokens_and_logprobs_equal_vllm_from_the_directory(
    tp2: ApiServer, world: World
) -> None:
    same_as_directory(tp2, "good")
    assert "Resolved and loaded LoRA adapter 'good' using WeightdLoRAResolver" in tp2.log()
    # Both ranks map the one pack of the whole adapter on this host (vLLM's LoRA layers
    # cut per rank), each holding its lease while its adapter cache keeps the adapter,
    # beside the API server's own (it keeps the version while vLLM may load it again);
    # no file is written.
    assert world.daemon is not None
    side = side_socket_path(world.daemon.target)
    assert side is not None
    packs = [p for p in local_stats(side).packs if p.adapter == "good"]
    assert [(p.layout.tp_size, p.layout.tp_rank, p.leases) for p in packs] == [(1, 0, 3)]
    assert not (world.tmp / "copies-tp2").exists()


def test_tp2_resolver_refusal_is_a_clear_http_error(tp2: ApiServer) -> None:
    status, reply = tp2.post(
        "/v1/completions", {"model": "nosuch", "prompt": PROMPTS[0], "max_tokens": 4}
    )
    assert status == 404, reply
    assert reply["error"]["message"].startswith("weightd adapter 'nosuch' not found: "), reply
    status, reply = tp2.post(
        "/v1/completions", {"model": "mismatch", "prompt": PROMPTS[0], "max_tokens": 4}
    )
    assert status == 400 and "adapter digest: expected" in reply["error"]["message"], reply
    same_as_directory(tp2, "good", PROMPTS[:1])
