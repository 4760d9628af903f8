"""``python -m weightd.server.cli``: the same as the ``weightd`` command."""

import sys

from .main import main

sys.exit(main())
