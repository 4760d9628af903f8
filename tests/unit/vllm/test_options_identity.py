"""The vLLM loader's pure parts: its extra-config options and the DIR identity check.

These need no vLLM (the package imports vLLM only inside functions that run in a
worker); the engine itself is exercised in tests/vllm/.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from weightd.client import FileDigest, ModelDescription
from weightd.common.sockets import default_target
from weightd.vllm.errors import WeightdLoadError
from weightd.vllm.loader.options import parse_options
from weightd.vllm.share.identity import compare


def test_defaults_are_the_default_socket_and_the_only_model() -> None:
    opts = parse_options(None)
    assert (opts.target, opts.model, opts.fallback, opts.transport) == (
        default_target(),
        None,
        "none",
        "auto",
    )
    assert opts.model_label == "(the daemon's only model)"


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"taget": "unix:///x"}, "unknown key(s) ['taget']"),
        ({"fallback": "yes"}, "expected one of ['none', 'disk']"),
        ({"transport": "cuda_ipc"}, "expected one of ['auto', 'grpc', 'shm']"),
        ({"model": 3}, "must be a non-empty string, got 3"),
        ({"target": ""}, "must be a non-empty string"),
        ({"timeout": 0}, "must be a positive, finite number"),
        ({"timeout": True}, "must be a positive, finite number"),
        ({"timeout": float("nan")}, "must be a positive, finite number of seconds"),
        ({"timeout": float("inf")}, "must be a positive, finite number of seconds"),
        ({"timeout": float("-inf")}, "must be a positive, finite number of seconds"),
        ({"timeout": 1e300}, "at most 86400"),
        ({"target": "localhost"}, "neither a socket path nor HOST:PORT"),
        ({"target": "http://h:1"}, "scheme 'http' is not one weightd uses"),
    ],
)
def test_bad_options_are_refused_by_name(extra: dict[str, object], needle: str) -> None:
    with pytest.raises(WeightdLoadError) as err:
        parse_options(extra)
    assert needle in str(err.value)


def _dir(tmp: Path, config: dict[str, object]) -> Path:
    tmp.mkdir()
    (tmp / "config.json").write_text(json.dumps(config))
    (tmp / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (tmp / "a.safetensors").write_bytes(b"x" * 10)
    return tmp


def _served(d: Path, **changes: object) -> ModelDescription:
    files = []
    for name in ("config.json", "model.safetensors.index.json", "a.safetensors"):
        data = (d / name).read_bytes()
        sha = hashlib.sha256(data).hexdigest() if name.endswith(".json") else ""
        files.append(FileDigest(name, len(data), sha))
    desc = ModelDescription(
        "m", "LlamaForCausalLM", (d / "config.json").read_text(), 10, (), tuple(files)
    )
    return desc if not changes else ModelDescription(**{**desc.__dict__, **changes})


def test_the_same_directory_has_no_difference(tmp_path: Path) -> None:
    d = _dir(tmp_path / "m", {"a": 1})
    assert compare(d, _served(d)) == []


def test_another_config_and_shard_size_are_named_with_both_sides(tmp_path: Path) -> None:
    d = _dir(tmp_path / "m", {"a": 1})
    served = _served(d)
    (d / "config.json").write_text(json.dumps({"a": 2}))
    (d / "a.safetensors").write_bytes(b"x" * 11)
    (d / "b.safetensors").write_bytes(b"y")
    got = [str(x) for x in compare(d, served)]
    mine = hashlib.sha256((d / "config.json").read_bytes()).hexdigest()[:16]
    theirs = served.files[0].sha256[:16]
    assert got == [
        f"config.json: sha256 {mine} in the model directory, sha256 {theirs} in the daemon",
        "a.safetensors: 11 bytes in the model directory, 10 bytes in the daemon",
        "b.safetensors: present in the model directory, not served in the daemon",
    ]


def test_a_config_only_directory_is_accepted_but_not_a_missing_config(tmp_path: Path) -> None:
    d = _dir(tmp_path / "m", {"a": 1})
    served = _served(d)
    (d / "a.safetensors").unlink()
    assert compare(d, served) == []
    (d / "config.json").unlink()
    assert [str(x) for x in compare(d, served)] == [
        "config.json: missing in the model directory, present in the daemon"
    ]


def test_an_older_daemon_is_compared_on_its_verbatim_config(tmp_path: Path) -> None:
    d = _dir(tmp_path / "m", {"a": 1})
    old = _served(d, files=())
    assert compare(d, old) == []
    (d / "config.json").write_text(json.dumps({"a": 2}))
    assert [x.file for x in compare(d, old)] == ["config.json"]


@pytest.mark.parametrize("target", ["./w.sock", "/run/w.sock", "unix:///run/w.sock", "h:7070"])
def test_every_address_form_is_a_target(target: str) -> None:
    """The loader takes the one address rule every weightd entry point takes."""
    assert parse_options({"target": target}).target == target


def test_the_loader_says_why_by_the_errors_type_not_its_code() -> None:
    """A NOT_FOUND is "model not served" only when the daemon said ModelNotFound: a
    TensorNotFound (also NOT_FOUND) says so; an old daemon's bare code says its class."""
    from weightd.client.base import errors as ce
    from weightd.vllm.loader.model_loader import _why

    def sent(code: int, reason: str) -> ce.WeightdError:
        return ce.error_for(code, "d", reason=reason)

    assert _why(sent(5, "ModelNotFound")) == "model not served"
    assert _why(sent(5, "TensorNotFound")) == "tensor not in the daemon's model"
    assert _why(sent(14, "ModelNotReady")).startswith("model not serving yet")
    assert _why(sent(12, "WorkerOnly")).startswith("the target is the daemon's admin socket")
    assert _why(sent(3, "ShardingError")) == "layout refused"
    assert _why(sent(9, "HeaderSyntaxError")) == "HeaderSyntaxError"
    assert _why(sent(5, "")) == "NotFoundError"  # a daemon from before reasons
    assert _why(ce.DaemonUnreachable("no daemon")) == "no daemon at the target"
