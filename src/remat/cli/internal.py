"""What the benchmarks (``benchmarks/``) use from the command line's runners.

Not public API. A name here is a deliberate promise between packages, so that no module
reaches into another package's private modules (``tests/test_layers.py`` fails on such an
import).
"""

from remat.cli._demo import kept_bytes, peak_bytes
from remat.cli.plan import _fits as fits

__all__ = ["fits", "kept_bytes", "peak_bytes"]
