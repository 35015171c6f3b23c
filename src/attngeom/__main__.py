"""``python -m attngeom ...``: the same as the ``attngeom`` command."""

import sys

from .cli import main

sys.exit(main())
