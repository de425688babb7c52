"""``python -m fxshard``: the command line (see fxshard.frontends.cli)."""

import sys

from .frontends.cli import main

sys.exit(main())
