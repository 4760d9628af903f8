"""Same-host transports: shared-memory rank packs, pinned staging and CUDA IPC handles.

The gRPC stream (``weightd.server.rpc.weights``) serves any host; these serve processes on
the daemon's own host through a Unix side socket that can pass file descriptors.
"""
