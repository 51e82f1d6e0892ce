"""``python -m remat``: the command line."""

import sys

from remat.cli import main

if __name__ == "__main__":
    sys.exit(main())
