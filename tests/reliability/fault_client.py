"""A client process that misbehaves on purpose, for ``test_client_faults.py``.

    python -m tests.reliability.fault_client TARGET --clients N --threads T
        N clients, T at a time: each opens its own channel (its own connection),
        starts a Fetch and, part-way through the stream, goes away in one of four
        ways: cancels the call, closes the channel without cancelling, lets a short
        deadline expire while not reading, or (on the side socket) takes a pack
        lease and closes the connection. Prints one JSON line of counts at the end.
    python -m tests.reliability.fault_client TARGET --hold N
        opens N Fetch streams (reads the first message of each) and N pack leases,
        prints "holding" and waits to be killed with SIGKILL.

Only grpc, the generated stubs and the frame codec are imported (no torch): these
processes start in a fraction of a second.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator

import grpc

from weightd.common.frames import recv_frame, send_frame
from weightd.v1 import local_pb2 as lpb
from weightd.v1 import weightd_pb2 as pb
from weightd.v1 import weightd_pb2_grpc as pb_grpc

#: Small messages and no BDP probing: the stream really is mid-way (the daemon blocked
#: on flow control) when the client goes away, not already buffered whole here.
CHUNK = 16 << 10
OPTIONS = [("grpc.http2.bdp_probe", 0)]
MODES = ("cancel", "close", "deadline", "lease")


#: The model every request names (the test's daemon serves two).
MODEL = "demo"


def _request(rank: int = 0, world_size: int = 1) -> pb.FetchRequest:
    return pb.FetchRequest(
        model=MODEL, layout=pb.Layout(tp_size=world_size, tp_rank=rank), max_chunk_bytes=CHUNK
    )


def _lease(target: str, rank: int) -> tuple[socket.socket, list[int]]:
    """A side-socket connection holding a lease on rank ``rank``'s pack of 2."""
    path = target.removeprefix("unix://") + ".local"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(60)
    sock.connect(path)
    recv_frame(sock)  # hello
    acquire = lpb.AcquirePack(
        model=MODEL, layout=pb.Layout(tp_size=2, tp_rank=rank), placement=lpb.PLACEMENT_HOST
    )
    send_frame(sock, lpb.LocalRequest(acquire=acquire).SerializeToString())
    got = recv_frame(sock, 4)
    assert got is not None, "the daemon closed the side socket"
    payload, fds = got
    response = lpb.LocalResponse.FromString(payload)
    if response.WhichOneof("response") != "grant":
        raise RuntimeError(f"no grant: {response}")
    return sock, fds


def one_client(target: str, index: int, counts: Counter[str]) -> None:
    mode = MODES[index % len(MODES)]
    reads = 1 + index % 3
    if mode == "lease":
        sock, fds = _lease(target, index % 2)
        for fd in fds:
            socket.close(fd)
        sock.close()  # ends the lease
        counts["lease"] += 1
        return
    channel = grpc.insecure_channel(target, options=OPTIONS)
    try:
        stub = pb_grpc.WeightsStub(channel)
        timeout = 0.5 if mode == "deadline" else 60
        call = stub.Fetch(_request(), timeout=timeout)
        stream: Iterator[pb.FetchResponse] = call
        for _ in range(reads):
            next(stream)
        if mode == "cancel":
            call.cancel()
        elif mode == "deadline":
            time.sleep(0.6)  # not reading: the deadline passes mid-stream
            try:
                for _ in stream:
                    pass
                counts["deadline-completed"] += 1  # would mean the stream was not mid-way
            except grpc.RpcError as exc:
                counts[f"deadline-{exc.code().name}"] += 1
        counts[mode] += 1
    finally:
        channel.close()


def run_clients(target: str, clients: int, threads: int) -> Counter[str]:
    counts: Counter[str] = Counter()
    lock = threading.Lock()
    next_index = iter(range(clients))

    def worker() -> None:
        mine: Counter[str] = Counter()
        while True:
            with lock:
                index = next(next_index, None)
            if index is None:
                break
            try:
                one_client(target, index, mine)
            except Exception as exc:  # counted, reported, and failed on by the test
                mine[f"error {type(exc).__name__}: {str(exc)[:120]}"] += 1
        with lock:
            counts.update(mine)

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return counts


def hold(target: str, n: int) -> None:
    channels = [grpc.insecure_channel(target, options=OPTIONS) for _ in range(n)]
    calls = [
        pb_grpc.WeightsStub(c).Fetch(_request(i % 2, 2), timeout=600)
        for i, c in enumerate(channels)
    ]
    for call in calls:
        next(call)
    leases = [_lease(target, i % 2) for i in range(n)]
    print(json.dumps({"holding": len(calls), "leases": len(leases)}), flush=True)
    time.sleep(600)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("target")
    p.add_argument("--clients", type=int, default=0)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--hold", type=int, default=0)
    args = p.parse_args()
    if args.hold:
        hold(args.target, args.hold)
        return
    counts = run_clients(args.target, args.clients, args.threads)
    print(json.dumps(dict(counts)), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
