"""``remat.memory``: measure what autograd keeps and what a step allocates.

Example:
    >>> import torch, remat
    >>> fc = torch.nn.Linear(64, 64)
    >>> x = torch.randn(32, 64)
    >>> remat.memory.saved_bytes(lambda: torch.relu(fc(x)).sum()) > 0
    True
"""

from remat.memory._saved import saved_bytes

__all__ = ["saved_bytes"]
