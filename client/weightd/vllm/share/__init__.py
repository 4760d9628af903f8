"""Fetching one vLLM worker's share of a served model, shared by the loader and the
weight-transfer backend: where the worker sits, the vocabulary cut, the presharded
marks that keep vLLM from cutting again, and whether the served model is the local one.
"""
