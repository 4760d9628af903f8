"""The documentation site's build tooling (a package, so ``docs.refgen`` is this one).

A regular package, not a namespace: a ``docs`` package some dependency installs into
site-packages could otherwise take its place on import.
"""
