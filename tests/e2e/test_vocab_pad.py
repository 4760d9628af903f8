"""``Layout.vocab_pad`` end to end: a real daemon, gRPC and shared memory, old and new both ways.

A Llama checkpoint with a vocabulary of 1000 (not a multiple of 64): at TP=2, 3 and 4
each rank's ``embed_tokens`` / ``lm_head`` are exactly vLLM's rows of the file
(checked byte for byte against safetensors' own reading), over gRPC and over shared
memory, ranks past the vocabulary included (an empty slice); every other tensor is
what ``vocab_pad`` 0 gives. A pack for ``vocab_pad`` 64 is not the pack for 0. An old
client (the generated stub, no field 8) gets equal blocks and nothing new on its
stream; a new client talking to an old daemon (a real gRPC proxy that drops the field,
as such a daemon ignores it) refuses the stream before a tensor arrives. Bad values
are INVALID_ARGUMENT naming the field on both transports.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from tests.conftest import RunningDaemon, run_daemon
from tests.models import build_model, read_checkpoint
from tests.old_daemon import without_vocab_pad
from weightd.client import InvalidArgumentError, Layout, VocabPadUnsupportedError, WeightClient
from weightd.client.transports.local import LocalConnection, local_stats
from weightd.client.transports.selection import side_socket_path
from weightd.v1 import local_pb2 as lpb
from weightd.v1 import weightd_pb2 as pb
from weightd.v1 import weightd_pb2_grpc as pb_grpc

pytestmark = pytest.mark.e2e
VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
V = 1000


def vllm_rows(tp: int, rank: int, pad: int) -> tuple[int, int]:
    padded = -(-V // pad) * pad
    per = padded // tp
    return min(rank * per, V), min((rank + 1) * per, V)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    overrides = dict(
        vocab_size=V,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=12,
        num_key_value_heads=12,
        tie_word_embeddings=False,
    )
    directory = tmp_path_factory.mktemp("vocab1000") / "llama"
    build_model("llama", overrides).save_pretrained(directory, max_shard_size="100KB")
    return directory


@pytest.fixture(scope="module")
def daemon(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    extra = ["--chunk-bytes", "8192"]
    with run_daemon(tmp_path_factory.mktemp("vocab-pad"), [("llama", model_dir)], extra) as d:
        yield d


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("transport", ["grpc", "shm"])
@pytest.mark.parametrize(("tp", "pad"), [(2, 64), (3, 6), (4, 64), (4, 2048)])
def test_each_rank_receives_vllms_rows(
    daemon: RunningDaemon, model_dir: Path, transport: str, tp: int, pad: int
) -> None:
    """(3, 6): 1000 padded to 1002, 334 rows each but the last 332; (4, 2048): 512, 488, 0, 0."""
    original = read_checkpoint(model_dir)
    sizes = []
    with WeightClient(daemon.target, timeout=120) as client:
        for rank in range(tp):
            got = client.fetch_layout(
                Layout(tp_size=tp, tp_rank=rank, vocab_pad=pad), transport=transport
            )
            assert client.last_fetch is not None and client.last_fetch.transport == transport
            a, b = vllm_rows(tp, rank, pad)
            sizes.append(b - a)
            for name in VOCAB:
                want = original[name][a:b]
                assert got[name].shape == want.shape and got[name].dtype == want.dtype
                assert _bytes(got[name]) == _bytes(want), (name, rank)
            if V % tp == 0:
                even = client.fetch(rank, tp, transport=transport)
                assert set(even) == set(got)
                for name, t in even.items():
                    if name not in VOCAB:
                        assert _bytes(t) == _bytes(got[name]), name
    assert sum(sizes) == V
    if pad == 2048:
        assert sizes == [512, 488, 0, 0]


def test_a_vocab_pad_pack_is_not_the_equal_blocks_pack(daemon: RunningDaemon) -> None:
    with WeightClient(daemon.target, timeout=120) as client:
        padded = client.fetch_layout(Layout(tp_size=2, tp_rank=0, vocab_pad=64), transport="shm")
        even = client.fetch(0, 2, transport="shm")
    assert padded["lm_head.weight"].shape[0] == 512
    assert even["lm_head.weight"].shape[0] == 500
    path = side_socket_path(daemon.target)
    assert path is not None
    layouts = {
        (p.layout.tp_size, p.layout.tp_rank, p.layout.vocab_pad) for p in local_stats(path).packs
    }
    assert {(2, 0, 64), (2, 0, 0)} <= layouts


def _generated_fetch(target: str, layout: pb.Layout) -> list[pb.FetchResponse]:
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.WeightsStub(channel)
        return list(stub.Fetch(pb.FetchRequest(layout=layout), timeout=60))


def _rows_streamed(messages: list[pb.FetchResponse], name: str) -> int:
    for m in messages:
        for c in m.chunks:
            if c.HasField("header") and c.header.name == name:
                return int(c.header.shape[0])
    raise AssertionError(f"{name} not streamed")


def test_old_client_gets_equal_blocks_and_nothing_new(daemon: RunningDaemon) -> None:
    """The generated stub never sets field 8: equal blocks, no vocab_pad on the stream."""
    messages = _generated_fetch(daemon.target, pb.Layout(tp_size=2, tp_rank=0))
    assert all(m.vocab_pad == 0 for m in messages)
    assert _rows_streamed(messages, "lm_head.weight") == 500
    padded = _generated_fetch(daemon.target, pb.Layout(tp_size=2, tp_rank=0, vocab_pad=64))
    assert padded[0].vocab_pad == 64 and all(m.vocab_pad == 0 for m in padded[1:])
    assert _rows_streamed(padded, "lm_head.weight") == 512


def test_an_empty_slice_has_a_header_a_digest_and_no_bytes(daemon: RunningDaemon) -> None:
    messages = _generated_fetch(daemon.target, pb.Layout(tp_size=4, tp_rank=3, vocab_pad=2048))
    headers = [c for m in messages for c in m.chunks if c.HasField("header")]
    (head,) = [c for c in headers if c.header.name == "lm_head.weight"]
    assert list(head.header.shape) == [0, 48] and head.header.nbytes == 0
    assert (
        head.digest
        == "sha256:" + "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    )


def test_new_client_refuses_an_old_daemons_equal_blocks(
    daemon: RunningDaemon, model_dir: Path, tmp_path: Path
) -> None:
    old = without_vocab_pad(daemon.target, tmp_path / "old.sock")
    try:
        with WeightClient(old.target, timeout=60) as client:
            with pytest.raises(VocabPadUnsupportedError, match=r"predates Layout\.vocab_pad"):
                client.fetch_layout(Layout(tp_size=2, tp_rank=0, vocab_pad=64), transport="grpc")
            assert client.last_resume is not None and client.last_resume.received_bytes == 0
            # Without vocab_pad the old daemon serves as it always did.
            state = client.fetch_layout(Layout(tp_size=2, tp_rank=0), transport="grpc")
        assert old.requests[0].layout.vocab_pad == 64  # it did ask
    finally:
        old.close()
    assert _bytes(state["lm_head.weight"]) == _bytes(
        read_checkpoint(model_dir)["lm_head.weight"][:500]
    )


@pytest.mark.parametrize("pad", [65537, 2**31, 2**32 - 1])
def test_an_absurd_vocab_pad_is_invalid_argument_on_both_transports(
    daemon: RunningDaemon, pad: int
) -> None:
    want = f"vocab_pad {pad} is invalid: it must be between 0 (equal blocks) and 65536"
    with WeightClient(daemon.target, timeout=60) as client:
        for transport in ("grpc", "shm"):
            with pytest.raises(InvalidArgumentError) as err:
                client.fetch_layout(
                    Layout(tp_size=2, tp_rank=0, vocab_pad=pad), transport=transport
                )
            assert err.value.detail == want, transport
    path = side_socket_path(daemon.target)
    assert path is not None
    conn = LocalConnection(path, "shm", timeout=60)
    try:
        acquire = lpb.AcquirePack(layout=pb.Layout(tp_size=2, tp_rank=0, vocab_pad=pad))
        with pytest.raises(InvalidArgumentError, match="vocab_pad"):
            _, fds = conn.request(lpb.LocalRequest(acquire=acquire), max_fds=1)
            for fd in fds:
                os.close(fd)
    finally:
        conn.close()


def test_a_padded_vocabulary_tp_does_not_divide_is_refused(daemon: RunningDaemon) -> None:
    with WeightClient(daemon.target, timeout=60) as client:
        for transport in ("grpc", "shm"):
            with pytest.raises(InvalidArgumentError) as err:
                client.fetch_layout(Layout(tp_size=3, tp_rank=0, vocab_pad=64), transport=transport)
            assert err.value.detail == (
                "tensor 'model.embed_tokens.weight': dim 0 of size 1000: padded to a multiple "
                "of vocab_pad 64 it has 1024 rows, which is not divisible by tensor-parallel "
                "world_size 3"
            )


def test_the_client_refuses_a_negative_vocab_pad_before_sending() -> None:
    with (
        WeightClient("unix:///nonexistent.sock") as client,
        pytest.raises(InvalidArgumentError, match="vocab_pad -1 is invalid"),
    ):
        client.fetch_layout(Layout(tp_size=2, tp_rank=0, vocab_pad=-1))


def test_weightd_fetch_vocab_pad_writes_vllms_rows(
    daemon: RunningDaemon, model_dir: Path, tmp_path: Path
) -> None:
    import subprocess

    from safetensors import safe_open

    from tests.conftest import weightd_command

    out = tmp_path / "rank0.safetensors"
    done = subprocess.run(
        weightd_command(
            "fetch",
            daemon.target,
            "--rank",
            "0",
            "--world-size",
            "2",
            "--vocab-pad",
            "64",
            "--out",
            str(out),
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    with safe_open(str(out), "pt") as f:
        assert f.metadata()["weightd_vocab_pad"] == "64"
        head = f.get_tensor("lm_head.weight")
    assert _bytes(head) == _bytes(read_checkpoint(model_dir)["lm_head.weight"][:512])
