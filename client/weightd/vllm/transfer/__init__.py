"""vLLM's weight-transfer backend ``weightd``: a running engine moved to a new version in
place (``engine.py``), registered without importing it (``backend.py``), with the
helpers a reinforcement-learning controller calls (``rl.py``).
"""
