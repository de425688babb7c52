"""``python -m fxshard``: the command line (see fxshard.cli)."""

import sys

from .cli import main

sys.exit(main())
