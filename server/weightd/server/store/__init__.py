"""Shard files by descriptor: one open file per shard, byte runs, page-cache residency.

The lowest stage that touches model files. Everything later reads tensor bytes through
here (never by path, never through a mapping), so a changed file is an error, not SIGBUS.
Verification reads through the same descriptors that serve, which is why the store comes
before the checkpoint scan and the trust stage.
"""
