"""What every layer of the client shares: the typed errors (one class per situation,
the REASONS table), the retry policy, and the worker's parallel ``Layout``.
"""
