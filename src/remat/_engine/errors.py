"""The error the engine raises: remat's and torch's at once (engine).

:class:`RecomputeError` here is a ``remat.RecomputeError`` (so also a
``remat.CheckpointError``) and a ``torch.utils.checkpoint.CheckpointError``: code
written against torch's checkpoint, ``except CheckpointError`` included, catches
remat's failures unchanged. The vocabulary layer (``_errors.py``) cannot import
torch, hence this subclass.
"""

from __future__ import annotations

import torch.utils.checkpoint as _torch_checkpoint

from remat import _errors


class RecomputeError(_errors.RecomputeError, _torch_checkpoint.CheckpointError):
    """A rebuilt tensor differs from the saved one, or a saved tensor cannot be rebuilt.

    Example:
        >>> import torch, remat
        >>> from remat._engine.errors import RecomputeError
        >>> issubclass(RecomputeError, (remat.CheckpointError,))
        True
        >>> issubclass(RecomputeError, torch.utils.checkpoint.CheckpointError)
        True
    """
