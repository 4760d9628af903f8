"""The foundation every stage stands on: the one error hierarchy, confined paths, atomic writes.

Imports nothing else of the daemon's; pure standard library.
"""
