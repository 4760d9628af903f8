"""The ``weightd`` command line: ``serve``, the client commands and the trust tools."""
