"""What the other packages of remat (the planner, the CLI) use from ``remat.memory``.

Not public API: users import `remat.memory`. A name here is a deliberate promise
between packages, so that no module reaches into another package's private modules
(``tests/test_layers.py`` fails on such an import).
"""

from remat.memory._collective_buffers import look_away_from_sharding_propagation
from remat.memory._compose import identical_container, signature, truncated
from remat.memory._step import Step, StepFn
from remat.memory._storages import local_nbytes, local_storages
from remat.memory.estimate import _build_in as build_in
from remat.memory.estimate import _fake_inputs as fake_inputs

__all__ = ["Step", "StepFn", "build_in", "fake_inputs", "identical_container", "local_nbytes",
           "local_storages", "look_away_from_sharding_propagation", "signature", "truncated"]
