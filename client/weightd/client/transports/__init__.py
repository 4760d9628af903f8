"""How a rank's bytes reach the worker: gRPC streams (resumable, several at once), and on
the daemon's host the side socket with shared-memory packs or CUDA IPC handles.

Which transport serves a fetch is chosen in ``selection.py``; the side channel's
messages are encoded by hand in ``localwire.py`` (a fresh worker's first fetch never
imports the generated protobuf classes).
"""
