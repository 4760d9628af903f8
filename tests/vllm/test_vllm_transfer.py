"""Running vLLM engines take new versions from weightd in place: the real engine, CPU build.

One scenario, run once by a module fixture because engine starts are expensive here
(40-90 s each): two engines, at TP=1 and TP=2, started on v1 from disk with
``weight_transfer_config={"backend": "weightd"}``, each one process driven step by step
(``transfer_engine.py``), against one daemon that starts serving v1:

0. each engine initialises its ``weightd`` backend (``init_weight_transfer_engine``),
   which makes every rank's layout known to the daemon;
1. a v2 is published whose shard is then overwritten in place (same size, same mtime:
   only digests can tell) and both engines are asked to move to it over gRPC (its
   packs, built at the publish from the verified bytes, would serve it unharmed);
2. the clean v2 is published; each engine's update goes with one rank's fetch through
   a proxy that cuts it off mid-stream;
3. both engines update to v2 at once, each with one rank's fetch stalled mid-stream
   by a proxy while the model's source is switched to v3 and reloaded; then released;
4. both update to v3, to v2 again (republished: a new number), then to a republished
   v1, then are asked for a version the daemon no longer holds and for one whose
   shapes changed;
5. the TP=2 engine is asked to take other content on each rank (another version
   number on rank 1; one number meaning other bytes on two daemons), then the same
   content from two daemons;
6. two fresh engines (TP=1, TP=2) are started on v2 from disk, for reference;
7. (before 6, engines still up) a trainer *process* publishes v2's tensors from its
   memory (``publish_tensors``: a sealed memfd, no checkpoint written) and both engines
   update to that version.

Every step records each worker's digests of what it computes with (parameters,
buffers, and the weights inside each CPU GEMM), greedy tokens and logprobs, and after
each update to v1, v2 or v3 the same digests of a model each worker builds afresh from
that version's directory through vLLM's start-up path (``reference``; proven against
the real fresh engines of step 6); the tests below assert on the record. Engine scripts and proxies:
``transfer_engine.py``, ``transfer_fixtures.py``.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import RunningDaemon, run_daemon
from tests.models import build_model
from tests.vllm.conftest import MODELS
from tests.vllm.transfer_fixtures import ByteProxy, EngineProcess
from weightd.client import AdminClient, WeightClient

#: The daemon's bytes a proxied rank gets before its fetch is stalled or cut: past the
#: hold, the description and the stream's first messages, well short of its share.
MID_STREAM = 256 << 10
TPS = (1, 2)
Record = dict[str, Any]


def tamper_in_place(shard: Path) -> None:
    """Flip a byte of tensor data, keeping the file's size and mtime (the inode too)."""
    before = shard.stat()
    with shard.open("r+b") as f:
        (header,) = struct.unpack("<Q", f.read(8))
        offset = 8 + header + (before.st_size - 8 - header) // 2
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert shard.stat().st_size == before.st_size


def scrape(daemon: RunningDaemon) -> str:
    with urllib.request.urlopen(daemon.address("metrics"), timeout=30) as r:
        text: str = r.read().decode()
        return text


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory, vllm_python: Path) -> dict[str, Path]:
    import torch

    root = tmp_path_factory.mktemp("transfer-models")
    kind, overrides = MODELS["llama"]
    out = {}
    for name, seed, extra in (
        ("v1", 1, {}),
        ("v2", 2, {}),
        ("v3", 3, {}),
        ("wide", 4, {"intermediate_size": 768}),
    ):
        model = build_model(kind, {**overrides, **extra}, seed=seed).to(torch.bfloat16)
        model.save_pretrained(root / name, max_shard_size="400KB")
        out[name] = root / name
    shutil.copytree(root / "v2", root / "v2-tampered")
    out["v2-tampered"] = root / "v2-tampered"
    (root / "live").symlink_to(root / "v2")  # the source a reload follows
    out["live"] = root / "live"
    return out


def _engines(
    python: Path, directory: Path, logs: Path, daemon: RunningDaemon | None
) -> dict[int, EngineProcess]:
    """Both engines, started at once (their start-ups overlap), ready."""
    engines = {
        tp: EngineProcess(
            python,
            directory,
            tp,
            logs / f"{directory.name}-tp{tp}.log",
            target=daemon.target if daemon else None,
            model="m",
        )
        for tp in TPS
    }
    try:
        for e in engines.values():
            e.wait_ready()
    except BaseException:
        for e in engines.values():
            e.close()
        raise
    return engines


def _snapshot(e: EngineProcess, reference: Path | None = None) -> Record:
    """The engine's state and tokens; with ``reference``, a fresh model's state from it."""
    state = e.call("state")
    assert "state" in state, f"{state}\nlog tail:\n{e.tail()}"
    gen = e.call("generate")
    assert "tokens" in gen, f"{gen}\nlog tail:\n{e.tail()}"
    out = {"state": state["state"], "version": state["version"], **gen}
    if reference is not None:
        ref = e.call("reference", dir=str(reference))
        assert "state" in ref, f"{ref}\nlog tail:\n{e.tail()}"
        out["reference"] = ref["state"]
    return out


def _update_both(
    engines: dict[int, EngineProcess], version: int, **per_tp: Any
) -> dict[int, Record]:
    for tp, e in engines.items():
        e.send("update", version=version, **per_tp.get(f"tp{tp}", {}))
    return {tp: e.reply() for tp, e in engines.items()}


def _mixed_content(
    e: EngineProcess, ckpts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Record:
    """Step 5: per-rank ``update_info`` sending the TP=2 engine's ranks to other content.

    Three more daemons: B serves v1 as its version 1, keeps it held and publishes v2 as
    its version 2; C serves v3 as its version 1 (the same number, other bytes); D
    serves v1 as its version 1 (the same number and bytes as B's).
    """
    rec: Record = {}
    root = tmp_path_factory.mktemp("mixed")
    for name in "bcd":
        (root / name).mkdir()
    with (
        run_daemon(root / "b", [("m", ckpts["v1"])]) as b,
        run_daemon(root / "c", [("m", ckpts["v3"])]) as c,
        run_daemon(root / "d", [("m", ckpts["v1"])]) as d,
        WeightClient(b.target, timeout=300) as client,
        client.hold_version("m", 1, holder="test", ttl=900),
        AdminClient(b.address("admin"), timeout=300) as admin,
    ):
        assert admin.publish(str(ckpts["v2"]), model="m").version == 2
        rec["targets"] = {"b": b.target, "c": c.target, "d": d.target}
        rec["before"] = _snapshot(e)
        for name, target, per_rank in (
            ("version", b.target, [{}, {"version": 2}]),
            ("daemons", None, [{"target": b.target}, {"target": c.target}]),
        ):
            start = len(e.log.read_text())
            rec[name] = e.call("update", version=1, target=target, per_rank=per_rank)
            rec[name]["log"] = e.log.read_text()[start:]
            rec[name]["after"] = _snapshot(e)
        rec["same"] = e.call(
            "update", version=1, per_rank=[{"target": b.target}, {"target": d.target}]
        )
        rec["same"]["after"] = _snapshot(e, ckpts["v1"])
    return rec


#: A trainer: v2's tensors in its memory (read once, as a training step leaves them),
#: published through the admin side socket's sealed memfd; prints the version number.
_TRAINER = """
import sys
from pathlib import Path
from safetensors.torch import load_file
from weightd.client import AdminClient
tensors = {}
for shard in sorted(Path(sys.argv[1]).glob("*.safetensors")):
    tensors.update(load_file(shard))
with AdminClient(sys.argv[2], timeout=300) as admin:
    print(admin.publish_tensors(tensors, model="m", transport="shm").version)
"""


def _from_memory(
    engines: dict[int, EngineProcess],
    admin: AdminClient,
    ckpts: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Record:
    """Step 7: a trainer process publishes from memory; both engines update to it, and
    are compared with a fresh model built from a directory holding the same tensors
    (written here only for that reference) and with the fresh v2 engines."""
    from safetensors.torch import load_file, save_file

    admin.publish(str(ckpts["v1"]), model="m")  # the serving shapes: v1's, not wide's
    proc = subprocess.run(
        [sys.executable, "-c", _TRAINER, str(ckpts["v2"]), admin.target],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    version = int(proc.stdout.strip())
    reference = tmp_path_factory.mktemp("trainer-reference")
    tensors = {}
    for shard in sorted(ckpts["v2"].glob("*.safetensors")):
        tensors.update(load_file(shard))
    save_file(tensors, reference / "model.safetensors")
    shutil.copy(ckpts["v2"] / "config.json", reference / "config.json")
    return {
        "version": version,
        "update": _update_both(engines, version),
        "after": {tp: _snapshot(e, reference) for tp, e in engines.items()},
    }


@pytest.fixture(scope="module")
def scenario(
    vllm_python: Path, ckpts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Record]:
    tmp = tmp_path_factory.mktemp("transfer")
    logs = tmp_path_factory.mktemp("transfer-logs")
    rec: Record = {"steps": {}}
    steps = rec["steps"]
    with run_daemon(tmp, [("m", ckpts["v1"])], ["--metrics-listen", "127.0.0.1:0"]) as daemon:
        rec["daemon"] = daemon
        admin = AdminClient(daemon.address("admin"), timeout=300)
        sock = daemon.target.removeprefix("unix://")
        engines = _engines(vllm_python, ckpts["v1"], logs, daemon)
        try:
            steps["start"] = {tp: _snapshot(e) for tp, e in engines.items()}

            # 1. a published version whose shard was then overwritten in place
            mark = len(daemon.log())
            tampered = admin.publish(str(ckpts["v2-tampered"]), model="m")
            publish_log = daemon.log()[mark:]
            shard = sorted(ckpts["v2-tampered"].glob("*.safetensors"))[2]
            tamper_in_place(shard)
            grpc = {"transport": "grpc"}
            steps["tampered"] = {
                "published": tampered.version,
                "publish_log": publish_log,
                "update": _update_both(engines, tampered.version, tp1=grpc, tp2=grpc),
                "after": {tp: _snapshot(e) for tp, e in engines.items()},
            }

            # 2. the clean v2; one rank's fetch cut off mid-stream (TP=1: its only rank)
            v2 = admin.publish(str(ckpts["live"]), model="m")
            cut: Record = {"published": v2.version, "update": {}, "after": {}}
            for tp, e in engines.items():
                proxy = ByteProxy(sock)
                try:
                    per_rank = [{}] * (tp - 1) + [{"target": proxy.target}]
                    proxy.stall_after(MID_STREAM)
                    e.send("update", version=v2.version, per_rank=per_rank)
                    proxy.wait_stalled()
                    proxy.cut()
                    cut["update"][tp] = e.reply()
                    cut["bytes_before_cut"] = proxy.from_daemon
                finally:
                    proxy.close()
                cut["after"][tp] = _snapshot(e)
            steps["cut"] = cut

            # 3. both engines at once, a reload to v3 while their fetches are mid-stream
            proxies = {tp: ByteProxy(sock) for tp in TPS}
            try:
                for tp, e in engines.items():
                    proxies[tp].stall_after(MID_STREAM)
                    per_rank = [{}] * (tp - 1) + [{"target": proxies[tp].target}]
                    e.send("update", version=v2.version, per_rank=per_rank)
                for p in proxies.values():
                    p.wait_stalled()
                held_before = scrape(daemon)
                ckpts["live"].unlink()
                ckpts["live"].symlink_to(ckpts["v3"])
                reloaded = admin.reload("m")
                held_during = scrape(daemon)
                for p in proxies.values():
                    p.release()
                updates = {tp: e.reply() for tp, e in engines.items()}
            finally:
                for p in proxies.values():
                    p.close()
            steps["concurrent"] = {
                "reloaded": reloaded.model,
                "held_before": held_before,
                "held_during": held_during,
                "held_after": scrape(daemon),
                "update": updates,
                "after": {tp: _snapshot(e, ckpts["v2"]) for tp, e in engines.items()},
            }
            v3 = admin.publish(str(ckpts["live"]), model="m")  # same content: its number
            mark = len(daemon.log())
            steps["v3"] = {
                "version": v3.version,
                "update": _update_both(engines, v3.version),
                "update_log": daemon.log()[mark:],
                "after": {tp: _snapshot(e, ckpts["v3"]) for tp, e in engines.items()},
            }
            again = admin.publish(str(ckpts["v2"]), model="m")
            steps["again"] = {
                "version": again.version,
                "update": _update_both(engines, again.version),
                "after": {tp: _snapshot(e, ckpts["v2"]) for tp, e in engines.items()},
            }

            # 4. back to v1's weights, then two refusals before any rank loads a byte
            v1 = admin.publish(str(ckpts["v1"]), model="m")
            steps["back"] = {
                "version": v1.version,
                "update": _update_both(engines, v1.version),
                "after": {tp: _snapshot(e, ckpts["v1"]) for tp, e in engines.items()},
            }
            # v1's first number: dropped when v2 was published, never held since
            steps["not_held"] = {"update": _update_both(engines, 1)}
            wide = admin.publish(str(ckpts["wide"]), model="m")
            steps["wide"] = {
                "version": wide.version,
                "update": _update_both(engines, wide.version),
                "after": {tp: _snapshot(e) for tp, e in engines.items()},
            }
            steps["mixed"] = _mixed_content(engines[2], ckpts, tmp_path_factory)
            # 7. a trainer process publishes v2's tensors from its memory; both update
            steps["memory"] = _from_memory(engines, admin, ckpts, tmp_path_factory)
        finally:
            for e in engines.values():
                e.close()
            admin.close()
        rec["daemon_log"] = daemon.log()
    # 6. fresh engines on v2, from disk
    fresh = _engines(vllm_python, ckpts["v2"], logs, None)
    try:
        steps["fresh_v2"] = {tp: _snapshot(e) for tp, e in fresh.items()}
    finally:
        for e in fresh.values():
            e.close()
    yield rec


def _holds(metrics: str, version: int) -> float:
    prefix = f'weightd_model_version_holds{{model="m",version="{version}"}} '
    line = next(x for x in metrics.splitlines() if x.startswith(prefix))
    return float(line[len(prefix) :])


def _same_weights(a: list[dict[str, str]], b: list[dict[str, str]]) -> list[str]:
    """Keys whose digests differ, on any rank."""
    assert len(a) == len(b)
    return [
        f"rank {r}: {k}"
        for r, (x, y) in enumerate(zip(a, b, strict=True))
        for k in x.keys() | y.keys()
        if x.get(k) != y.get(k)
    ]


@pytest.mark.parametrize("tp", TPS)
def test_update_generates_and_holds_exactly_what_a_fresh_engine_on_v2_does(
    scenario: Record, tp: int
) -> None:
    steps = scenario["steps"]
    got, fresh = steps["concurrent"]["after"][tp], steps["fresh_v2"][tp]
    assert steps["concurrent"]["update"][tp].get("ok"), steps["concurrent"]["update"][tp]
    assert got["tokens"] == fresh["tokens"]
    assert got["logprobs"] == fresh["logprobs"]
    assert _same_weights(got["state"], fresh["state"]) == []
    # and the weights moved: every GEMM and every weight parameter differs from v1's
    start = steps["start"][tp]["state"]
    for rank, digests in enumerate(got["state"]):
        moved = [k for k in digests if not k.startswith("buffer:") and digests[k] != start[rank][k]]
        weights = [k for k in digests if not k.startswith("buffer:")]
        assert moved == weights
        assert any(k.startswith("gemm:") for k in weights)
    assert got["tokens"] != steps["start"][tp]["tokens"]
    # the engine's reported version is the daemon's
    assert got["version"] == str(steps["cut"]["published"])


def test_engines_that_loaded_from_disk_find_their_packs_built_at_a_publish(
    scenario: Record,
) -> None:
    """The engines started with vLLM's own loader; their backend's init made their
    layouts known, so the first publish that followed built each rank's pack before it
    said ready, and an update found them: none is built on an update's way."""
    published = scenario["steps"]["tampered"]["publish_log"]
    for label in ("tp1:r0", "tp2:r0:v64", "tp2:r1:v64"):
        assert re.search(f'pack_built model=m layout="?{label}"? ', published), (label, published)
    step = scenario["steps"]["v3"]
    for tp in TPS:
        update = step["update"][tp]
        assert update.get("ok"), update
        assert [r["transport"] for r in update["reports"]] == ["shm"] * tp, update
    assert "pack_built" not in step["update_log"], step["update_log"]
    assert "pack_pending" not in step["update_log"], step["update_log"]


@pytest.mark.parametrize("tp", TPS)
def test_a_tampered_shard_fails_the_update_and_every_parameter_stays_v1(
    scenario: Record, tp: int
) -> None:
    step = scenario["steps"]["tampered"]
    update = step["update"][tp]
    error = update.get("error", "")
    assert f"update to model 'm' version {step['published']} failed on" in error
    assert "no rank applied it" in error
    assert "DATA_LOSS" in error
    assert "rank 0 (tp 0/" in error
    start = scenario["steps"]["start"][tp]
    after = step["after"][tp]
    assert _same_weights(after["state"], start["state"]) == []
    assert after["tokens"] == start["tokens"] and after["logprobs"] == start["logprobs"]
    assert all(not r["ok"] for r in update["reports"])


@pytest.mark.parametrize("tp", TPS)
def test_a_rank_cut_off_mid_fetch_fails_the_update_and_every_parameter_stays_v1(
    scenario: Record, tp: int
) -> None:
    step = scenario["steps"]["cut"]
    error = step["update"][tp].get("error", "")
    last = tp - 1  # the proxied rank
    assert f"update to model 'm' version {step['published']} failed on 1 of {tp} rank(s)" in error
    assert f"rank {last} (tp {last}/{tp}" in error
    assert "no rank applied it" in error
    assert "UNAVAILABLE" in error
    assert step["bytes_before_cut"] >= MID_STREAM  # cut mid-stream, not before it
    start = scenario["steps"]["start"][tp]
    after = step["after"][tp]
    assert _same_weights(after["state"], start["state"]) == []
    assert after["tokens"] == start["tokens"]
    if tp == 2:  # the other rank had staged its whole share, and applied none of it
        reports = step["update"][tp]["reports"]
        # Its whole share: as many bytes as the same rank's later update to v2 took. No
        # layout had a pack yet (the tampered version's builds failed), so it may come
        # over gRPC while its pack builds (``transport="auto"`` does not wait).
        later = scenario["steps"]["concurrent"]["update"][tp]["reports"]
        assert reports[0]["bytes"] == later[0]["bytes"] > 0
        assert reports[0]["transport"] in ("shm", "grpc")


def test_two_engines_with_a_reload_mid_update_end_on_v2_then_both_move_to_v3(
    scenario: Record,
) -> None:
    steps = scenario["steps"]
    v2 = steps["cut"]["published"]
    step = steps["concurrent"]
    for tp in TPS:
        assert step["update"][tp].get("ok"), step["update"][tp]
        assert step["update"][tp]["version"] == str(v2)
        assert {r["version"] for r in step["update"][tp]["reports"]} == {v2}
    # while both were mid-fetch: v2 held by both engines' ranks (1 + 2 holds), v3 current
    # beside it; after, those holds were released. (Two more holds on v2 are the cut
    # fetches' of step 2: their release could not reach the daemon through the cut
    # proxy, so they end with their TTL.)
    during, after = step["held_during"], step["held_after"]
    assert f'weightd_model_version_engines{{model="m",version="{v2}"}} 2.0' in during
    assert 'weightd_model_versions_held{model="m"} 2.0' in during
    assert f'weightd_model_version{{model="m"}} {float(v2 + 1)}' in during
    assert _holds(during, v2) - _holds(after, v2) == 3
    assert _holds(step["held_before"], v2) == _holds(during, v2)
    v3 = steps["v3"]
    assert v3["version"] == v2 + 1
    for tp in TPS:
        assert v3["update"][tp].get("ok"), v3["update"][tp]
        assert v3["after"][tp]["version"] == str(v3["version"])
        assert v3["after"][tp]["tokens"] != step["after"][tp]["tokens"]
        assert _same_weights(v3["after"][tp]["state"], step["after"][tp]["state"]) != []


@pytest.mark.parametrize("tp", TPS)
def test_moving_back_to_v1_is_bit_identical_to_the_engine_that_started_on_it(
    scenario: Record, tp: int
) -> None:
    steps = scenario["steps"]
    back = steps["back"]
    assert back["update"][tp].get("ok"), back["update"][tp]
    assert _same_weights(back["after"][tp]["state"], steps["start"][tp]["state"]) == []
    assert back["after"][tp]["tokens"] == steps["start"][tp]["tokens"]
    assert back["after"][tp]["logprobs"] == steps["start"][tp]["logprobs"]


@pytest.mark.parametrize("tp", TPS)
def test_a_version_no_longer_held_or_with_other_shapes_is_refused_before_any_byte(
    scenario: Record, tp: int
) -> None:
    steps = scenario["steps"]
    gone = steps["not_held"]["update"][tp].get("error", "")
    assert "refused before any rank fetched a byte" in gone
    assert "version 1 is not held" in gone
    wide = steps["wide"]
    error = wide["update"][tp].get("error", "")
    assert "refused before any rank fetched a byte" in error
    assert "shapes differ from the engine's checkpoint" in error
    assert "mlp.gate_proj.weight" in error
    for r in wide["update"][tp]["reports"]:
        assert r["bytes"] == 0 and r["stage_seconds"] == 0
    assert _same_weights(wide["after"][tp]["state"], steps["back"]["after"][tp]["state"]) == []


def test_the_reference_is_what_real_fresh_engines_hold(scenario: Record) -> None:
    """The in-worker reference (``transfer_engine.reference_state``) proven twice per TP
    size: built from v2 it equals the fresh engines started on v2, built from v1 the
    engines that started on v1."""
    steps = scenario["steps"]
    for tp in TPS:
        assert (
            _same_weights(
                steps["concurrent"]["after"][tp]["reference"], steps["fresh_v2"][tp]["state"]
            )
            == []
        )
        assert (
            _same_weights(steps["back"]["after"][tp]["reference"], steps["start"][tp]["state"])
            == []
        )


@pytest.mark.parametrize("tp", TPS)
def test_v1_v2_v3_v2_each_update_equals_a_fresh_engine_on_that_version(
    scenario: Record, tp: int
) -> None:
    steps = scenario["steps"]
    names = ("concurrent", "v3", "again", "back")
    for name in names:
        step = steps[name]
        assert step["update"][tp].get("ok"), (name, step["update"][tp])
        after = step["after"][tp]
        assert _same_weights(after["state"], after["reference"]) == [], name
    # v2, v3, v2 again: other numbers, the same content as the first time
    assert steps["again"]["version"] > steps["v3"]["version"]
    assert steps["again"]["after"][tp]["version"] == str(steps["again"]["version"])
    first, again = steps["concurrent"]["after"][tp], steps["again"]["after"][tp]
    assert _same_weights(again["state"], first["state"]) == []
    assert again["tokens"] == first["tokens"]


def test_ranks_sent_to_other_content_are_refused_and_the_same_content_from_two_daemons_is_not(
    scenario: Record,
) -> None:
    mixed = scenario["steps"]["mixed"]
    before = mixed["before"]
    t = mixed["targets"]
    # another version number on rank 1 (both held by daemon B)
    error = mixed["version"].get("error", "")
    assert error.startswith(
        "WeightdUpdateError: weightd: update refused on every rank: the ranks"
    ), error
    assert "refused before any rank fetched a byte" in error
    assert f"rank 0 (tp 0/2, vocab_pad 64, weightd at {t['b']}) takes model 'm' version 1" in error
    assert f"rank 1 (tp 1/2, vocab_pad 64, weightd at {t['b']}) takes model 'm' version 2" in error
    # version 1 on both ranks, but daemon C's version 1 is other bytes than B's
    error = mixed["daemons"].get("error", "")
    assert "the ranks would take different content" in error
    assert f"weightd at {t['b']}) takes model 'm' version 1 (content " in error
    assert f"weightd at {t['c']}) takes model 'm' version 1 (content " in error
    for name in ("version", "daemons"):
        step = mixed[name]
        assert _same_weights(step["after"]["state"], before["state"]) == []
        assert step["after"]["version"] == before["version"]
        assert all(r["bytes"] == 0 and not r["ok"] for r in step["reports"])
        # one line per rank, no traceback
        log = step["log"]
        assert "Traceback" not in log
        for rank in (0, 1):
            lines = [
                x for x in log.splitlines() if f"TP{rank}" in x and "weightd: update refused" in x
            ]
            assert len(lines) == 1, log
    # the same version, the same bytes, from two daemons: updated
    same = mixed["same"]
    assert same.get("ok"), same
    assert _same_weights(same["after"]["state"], same["after"]["reference"]) == []


@pytest.mark.parametrize("tp", TPS)
def test_a_trainer_publishing_from_memory_moves_engines_to_a_fresh_engines_weights(
    scenario: Record, tp: int
) -> None:
    """Every parameter equals a fresh model's built from a directory holding the
    trainer's tensors, and tokens and parameters equal the fresh engine's on v2 (the
    same tensors on disk)."""
    steps = scenario["steps"]
    memory = steps["memory"]
    assert memory["update"][tp].get("ok"), memory["update"][tp]
    after = memory["after"][tp]
    assert after["version"] == str(memory["version"])
    assert _same_weights(after["state"], after["reference"]) == []
    fresh = steps["fresh_v2"][tp]
    assert _same_weights(after["state"], fresh["state"]) == []
    assert after["tokens"] == fresh["tokens"]
    assert after["logprobs"] == fresh["logprobs"]
