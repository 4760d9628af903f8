"""What the daemon says about itself: structured logs, progress lines and metric families.

Metric *families* live here; the collectors that read the store, registry, packs and
transports on scrape are wired in :mod:`weightd.server.daemon`, the only stage that sees
them all.
"""
