"""What the MindSpore surface and the benchmarks use from the graph pass beyond ``remat.compile``.

Not public API. A name here is a deliberate promise between packages, so that no module
reaches into another package's private modules (``tests/test_layers.py`` fails on such an
import).
"""

from remat._graph._compare import allocation_peak, compile_configuration
from remat._graph._compile import compile_cached
from remat._graph._flops import flop_formulas

__all__ = ["allocation_peak", "compile_cached", "compile_configuration", "flop_formulas"]
