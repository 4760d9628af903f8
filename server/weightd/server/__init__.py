"""The weightd daemon: verifies checkpoints, plans per-rank slices and serves them."""
