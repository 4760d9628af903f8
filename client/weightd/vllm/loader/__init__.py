"""vLLM's model loader ``--load-format weightd``: an engine's weights fetched from the daemon
instead of read from disk (``model_loader.py``), with its options (``options.py``).
"""
