"""Why the daemon believes the bytes: digests, the hash cache, manifests and signatures.

``verify`` decides whether a scanned checkpoint may be served; ``integrity`` anchors the
per-slice digests the transports hand out to the verified tensor digests.
"""
