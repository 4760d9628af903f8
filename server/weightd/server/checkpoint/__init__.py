"""A checkpoint as an immutable description: strict header and index parsing, config checks.

``header``, ``description`` and ``config_check`` are pure (bytes in, description out);
``scan`` is the one module that reads a checkpoint directory, through the store.
"""
