"""``python -m remat``: the command line."""

import sys

from remat.cli import main

sys.exit(main())
