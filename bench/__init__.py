"""weightd benchmarks: peers side by side in one run, reported as ratios."""
