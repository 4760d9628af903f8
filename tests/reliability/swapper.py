"""A racer process: swaps a directory for a symlink to another one, over and over.

``python -m tests.reliability.swapper PATH OUTSIDE SECONDS [DWELL]`` renames the
directory ``PATH`` aside, puts a symlink to ``OUTSIDE`` in its place, takes the link
away and puts the directory back, in a loop, until SIGTERM or SECONDS pass (a bound,
so a forgotten racer ends by itself). Each round ends with the real directory at
PATH, so it is there when the racer exits. Prints how many rounds it made.

``DWELL`` (seconds, default 0: a tight loop) leaves the real directory in place for
a random time up to it after each round. A caller whose operation opens the
directory several times (a reload opens each shard) needs such gaps to win the race
at all on a loaded machine; the swaps still land at random points inside it, so the
lost calls keep meeting the link at every step.

It runs as its own process so that its renames interleave with the daemon's opens as
an attacker's would: the daemon's threads, GIL and scheduling are not shared with it.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time


def main(argv: list[str]) -> int:
    path, outside, seconds = argv[1], argv[2], float(argv[3])
    dwell = float(argv[4]) if len(argv) > 4 else 0.0
    parent, base = os.path.split(path)
    stash = os.path.join(parent, f".{base}.real")
    link = os.path.join(parent, f".{base}.link")
    os.symlink(outside, link)
    stop = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    print("ready", flush=True)
    deadline = time.monotonic() + seconds
    rounds = 0
    while not stop and time.monotonic() < deadline:
        os.rename(path, stash)  # the real directory aside
        os.rename(link, path)  # the link to the outside in its place
        os.rename(path, link)  # the link aside again
        os.rename(stash, path)  # the real directory back
        rounds += 1
        if dwell:
            time.sleep(random.uniform(0, dwell))
    os.unlink(link)
    print(rounds, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
