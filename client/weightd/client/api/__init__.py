"""The public API: ``WeightClient``, ``AdminClient`` and the values their calls return.

The top layer of ``weightd.client``: it chooses a transport (``transports/``), which
receives and verifies the bytes (``receive/``), over the errors, retry policy and
layout every layer shares (``base/``). ``weightd.client`` re-exports its public names.
"""
