"""``python -m attngeom ...``: the same as the ``attngeom`` command."""

import sys

from attngeom.cli import main

sys.exit(main())
