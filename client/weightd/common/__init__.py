"""Pure, dependency-free pieces shared by the daemon and the client.

Nothing here imports torch, numpy or grpc, so both sides can use it and it can be
tested exhaustively without I/O.
"""
