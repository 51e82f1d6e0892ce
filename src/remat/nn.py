"""``remat.nn.Cell``: a ``torch.nn.Module`` with MindSpore's ``recompute`` mark.

Examples:
    >>> import torch, remat
    >>> class Block(remat.nn.Cell):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.fc = torch.nn.Linear(4, 4)
    ...     def construct(self, x):
    ...         return torch.relu(self.fc(x))
    >>> block = Block()
    >>> block.recompute()
    >>> block(torch.randn(2, 4)).shape
    torch.Size([2, 4])
"""

from __future__ import annotations

from typing import Any

import torch

from remat._front.marks import mark_from_keywords, set_mark, unmark_module

__all__ = ["Cell"]


class Cell(torch.nn.Module):
    """A module that may define ``construct`` (MindSpore's name) or ``forward``.

    Args:
        auto_prefix: accepted for MindSpore compatibility; parameter names are
            always PyTorch's (the attribute path), whatever its value.
        flags: accepted for MindSpore compatibility and stored on ``self.flags``.

    Examples:
        >>> import torch, remat
        >>> class Double(remat.nn.Cell):
        ...     def construct(self, x):
        ...         return 2 * x
        >>> Double()(torch.ones(2))
        tensor([2., 2.])
    """

    def __init__(self, auto_prefix: bool = True, flags: dict | None = None) -> None:
        super().__init__()
        self.auto_prefix = auto_prefix
        self.flags = dict(flags or {})

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        construct = getattr(type(self), "construct", None)
        if construct is None:
            raise NotImplementedError(
                f"remat.nn.Cell: {type(self).__name__} defines neither construct() nor forward(); "
                f"define one of them"
            )
        return construct(self, *args, **kwargs)

    def recompute(self, mode: bool = True, *args: bool, **kwargs: Any) -> None:
        """Recompute every operator of this cell and its sub-cells in backward, but the output's.

        MindSpore's ``Cell.recompute``: the tensors the cell's operators save for
        backward are not kept; they are rebuilt from the cell's inputs when
        backward needs them. The result of the cell's output operator is kept
        (unless ``output_recompute=True``).

        Args:
            mode: True marks the cell, False removes the mark.
            *args: ``mp_comm_recompute`` and ``parallel_optimizer_comm_recompute``
                may also be passed by position, as in MindSpore before 2.x.
            **kwargs: ``use_reentrant`` (default False), ``output_recompute``
                (default False), ``early_stop`` (default True),
                ``mp_comm_recompute`` (default True: model-parallel
                communication inside the cell is recomputed too),
                ``parallel_optimizer_comm_recompute`` (True: FSDP2 units under
                the cell all-gather their parameters again for recomputation;
                False: they stay gathered from forward to backward; not passed:
                FSDP2's own ``reshard_after_forward`` decides), ``policy``,
                ``stages`` (default 1; with a ``policy``: backward rebuilds the cell
                that many parts at a time, holding one part's tensors at once; ``"each"``:
                each saved tensor on its own, from the operators that made it),
                ``preserve_rng_state``.

        Raises:
            TypeError: an unknown keyword, or a non-bool where a bool is expected.
            ValueError: the cell is already marked with other options.

        Examples:
            >>> import torch, remat
            >>> cell = remat.nn.Cell()
            >>> cell.recompute(output_recompute=True)
            >>> remat.mark_of(cell).output_recompute
            True
        """
        api = f"{type(self).__name__}.recompute"
        if len(args) > 2:
            raise TypeError(
                f"{api}: takes at most 3 positional arguments (mode, mp_comm_recompute, "
                f"parallel_optimizer_comm_recompute), got {1 + len(args)}"
            )
        for name, value in zip(("mp_comm_recompute", "parallel_optimizer_comm_recompute"), args):
            if name in kwargs:
                raise TypeError(f"{api}: got multiple values for argument '{name}'")
            kwargs[name] = value
        if not isinstance(mode, bool):
            raise TypeError(f"{api}: 'mode' must be a bool, got {type(mode).__name__} {mode!r}")
        if not mode:
            unmark_module(self)
            return
        spec = mark_from_keywords(api, kwargs, keep_outputs=True)
        set_mark(self, spec, api=api)
