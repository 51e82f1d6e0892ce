"""The one error a failed recomputation raises (engine).

`RecomputeError` is ``remat.RecomputeError`` (and ``remat.CheckpointError``,
the same class under torch's name) and a subclass of
``torch.utils.checkpoint.CheckpointError``, itself a ``RuntimeError``: code written
against torch's checkpoint, ``except CheckpointError`` included, catches remat's failures
unchanged. It lives here, not in the vocabulary, because being torch's class needs a
torch import, which the vocabulary layer does not make (see the design notes, Layout).
"""

from __future__ import annotations

import torch.utils.checkpoint as _torch_checkpoint


class RecomputeError(_torch_checkpoint.CheckpointError):
    """A tensor rebuilt in backward differs from the one saved in forward.

    Raised when recomputation of a region saves a different number of tensors,
    or a tensor of another shape, dtype or device, than the original forward, or
    when a saved tensor cannot be rebuilt. The message names the region and the
    tensor; pass ``debug=True`` to print the operators run in forward and in
    recomputation side by side.

    Examples:
        >>> import torch, remat
        >>> issubclass(remat.RecomputeError, torch.utils.checkpoint.CheckpointError)
        True
        >>> issubclass(remat.RecomputeError, RuntimeError)
        True
    """

    __module__ = "remat"  # printed by its public name, remat.RecomputeError


#: ``torch.utils.checkpoint`` calls the same failure ``CheckpointError``.
CheckpointError = RecomputeError
