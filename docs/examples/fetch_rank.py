"""Fetch one tensor-parallel rank's share from a running daemon, as a worker does.

    python docs/examples/fetch_rank.py unix:///run/weightd/weightd.sock --rank 0 --world-size 2

Prints how the share arrived (shared memory on the daemon's host, gRPC elsewhere) and
its tensors. Every slice was checked against the digest the daemon verified.
"""

from __future__ import annotations

import argparse

from weightd.client import WeightClient


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "target", help="the daemon's address, e.g. unix:///run/weightd/weightd.sock"
    )
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--model", default=None, help="default: the daemon's only model")
    args = parser.parse_args()

    with WeightClient(args.target, timeout=120) as client:
        state, info = client.fetch_with_info(args.rank, args.world_size, model=args.model)
        total = sum(t.numel() * t.element_size() for t in state.values())
        print(
            f"rank {args.rank} of {args.world_size}: {len(state)} tensors, {total:,} bytes "
            f"over {info.transport}"
        )
        for name, tensor in list(state.items())[:5]:
            print(f"  {name}: {tuple(tensor.shape)} {tensor.dtype}")
        if len(state) > 5:
            print(f"  ... and {len(state) - 5} more")


if __name__ == "__main__":
    main()
