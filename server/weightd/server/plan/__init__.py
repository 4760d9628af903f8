"""Which bytes each worker gets: layouts, architecture rules, TP cuts, quantization, plans.

Pure: plans are computed from descriptions and rules with no I/O, so the tests can walk
every case. ``rules_file`` parses an operator-supplied rules file from bytes.
"""
