"""What the CLI and the benchmarks use from ``remat.planner`` beyond its public names.

Not public API: users import `remat.planner`. A name here is a deliberate promise
between packages, so that no module reaches into another package's private modules
(``tests/test_layers.py`` fails on such an import).
"""

from remat.memory.internal import identical_container
from remat.planner._cost import composed_costs, measure_costs
from remat.planner._fitting import _fit as fit
from remat.planner._measure import measure_peak
from remat.planner._pipeline_rank import replayed_peaks
from remat.planner._settings import Machine, Settings, Solving
from remat.planner._trace import find_blocks

__all__ = ["Machine", "Settings", "Solving", "composed_costs", "find_blocks", "fit", "identical_container",
           "measure_costs", "measure_peak", "replayed_peaks"]
