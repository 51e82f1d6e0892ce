"""``remat.parallel``: recompute marks under ``torch.distributed`` (front end).

``mp_comm_recompute`` (DTensor tensor parallelism) is honoured by the engine
(NOTE [Kept collectives] in ``remat/_engine/collectives.py``);
``parallel_optimizer_comm_recompute`` by FSDP2 units under a mark
(``_fsdp.py``). This package also counts collectives per phase.
"""

from remat.parallel import _fsdp  # noqa: F401  (registers its run context with the marks)
from remat.parallel._count import CollectiveCounter, count_collectives

__all__ = ["CollectiveCounter", "count_collectives"]
