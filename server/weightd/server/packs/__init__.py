"""Rank packs: one rank's slices materialised once in sealed shared memory, with leases."""
