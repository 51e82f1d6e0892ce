"""``remat.ops``: single operators in MindSpore's style, each with ``.recompute()``.

A *primitive* is one operator packaged as an object: ``relu = ReLU()`` then
``relu(x)``. Calling ``relu.recompute()`` marks it: its output is not kept for
backward and is rebuilt from its inputs when backward needs it. A primitive
marked right after a recomputed cell (``fc2.recompute(); relu2.recompute()``) is
rebuilt from the cell's kept output, as MindSpore does.

Primitives are ``torch.nn.Module`` objects without parameters, so assigning one
to a model attribute changes no parameter name and no ``state_dict`` key.

Examples:
    >>> import torch
    >>> from remat import ops
    >>> relu = ops.ReLU()
    >>> relu.recompute()
    >>> relu(torch.tensor([-1.0, 2.0]))
    tensor([0., 2.])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from remat._front.marks import mark_of, set_mark, unmark_module
from remat._vocab.spec import RegionSpec

__all__ = [
    "Add",
    "BiasAdd",
    "GeLU",
    "MatMul",
    "Mul",
    "Primitive",
    "ReLU",
    "Sigmoid",
    "Softmax",
    "Tanh",
]

Operand = torch.Tensor | float | int


def _as_tensor(value: Operand) -> torch.Tensor:
    return value if torch.is_tensor(value) else torch.as_tensor(value)


class Primitive(torch.nn.Module):
    """Base of the operator objects: a parameterless module with ``recompute``.

    Subclasses define ``forward``. A primitive holds no parameters and no
    buffers, so it never changes a model's parameter names or ``state_dict``.

    Examples:
        >>> import torch
        >>> from remat.ops import Primitive
        >>> class Square(Primitive):
        ...     def forward(self, x):
        ...         return x * x
        >>> Square()(torch.tensor([3.0]))
        tensor([9.])
    """

    @property
    def name(self) -> str:
        """The operator's name, as MindSpore's ``Primitive.name``."""
        return type(self).__name__

    def recompute(self, mode: bool = True) -> None:
        """Do not keep this operator's output for backward; rebuild it from its inputs.

        Args:
            mode: True marks the operator, False removes the mark.

        Raises:
            TypeError: ``mode`` is not a bool.

        Examples:
            >>> import remat
            >>> from remat import ops
            >>> gelu = ops.GeLU()
            >>> gelu.recompute()
            >>> remat.mark_of(gelu).output_recompute
            True
            >>> gelu.recompute(False)
            >>> remat.mark_of(gelu) is None
            True
        """
        api = f"{self.name}.recompute"
        if not isinstance(mode, bool):
            raise TypeError(
                f"{api}: 'mode' must be a bool, got {type(mode).__name__} {mode!r}; "
                f"pass True to recompute the operator or False to keep its output"
            )
        if mode:
            set_mark(self, RegionSpec(output_recompute=True), api=api)
        else:
            unmark_module(self)

    @property
    def recomputed(self) -> bool:
        """Whether this operator is marked for recomputation."""
        return mark_of(self) is not None

    def extra_repr(self) -> str:
        return "recompute=True" if self.recomputed else ""


class ReLU(Primitive):
    """``max(x, 0)`` elementwise.

    Examples:
        >>> import torch
        >>> from remat import ops
        >>> ops.ReLU()(torch.tensor([-1.0, 3.0]))
        tensor([0., 3.])
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)


class GeLU(Primitive):
    """Gaussian error linear unit, MindSpore's primitive: the tanh approximation.

    ``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3)))``, as
    ``mindspore.ops.GeLU`` computes it (``torch.nn.functional.gelu(x,
    approximate="tanh")``); the erf form differs by up to about 3e-4 on a small MLP.

    Examples:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from remat import ops
        >>> x = torch.tensor([-1.0, 0.0, 2.0])
        >>> torch.equal(ops.GeLU()(x), F.gelu(x, approximate="tanh"))
        True
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh")


class Sigmoid(Primitive):
    """``1 / (1 + exp(-x))`` elementwise.

    Examples:
        >>> import torch
        >>> from remat import ops
        >>> ops.Sigmoid()(torch.tensor([0.0]))
        tensor([0.5000])
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x)


class Tanh(Primitive):
    """Hyperbolic tangent elementwise.

    Examples:
        >>> import torch
        >>> from remat import ops
        >>> ops.Tanh()(torch.tensor([0.0]))
        tensor([0.])
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x)


class Softmax(Primitive):
    """Softmax along ``axis``.

    Args:
        axis: the dimension that sums to one (an int, or a one-element tuple as
            MindSpore also accepts).

    Raises:
        TypeError: ``axis`` is not an int.

    Examples:
        >>> import torch
        >>> from remat import ops
        >>> ops.Softmax(axis=-1)(torch.zeros(1, 2))
        tensor([[0.5000, 0.5000]])
    """

    def __init__(self, axis: int | tuple[int] = -1) -> None:
        super().__init__()
        if isinstance(axis, tuple) and len(axis) == 1:
            axis = axis[0]
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise TypeError(
                f"Softmax: 'axis' must be an int, got {type(axis).__name__} {axis!r}; "
                f"pass the dimension to normalise, e.g. Softmax(axis=-1)"
            )
        self.axis = axis

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=self.axis)

    def extra_repr(self) -> str:
        return ", ".join(filter(None, [f"axis={self.axis}", super().extra_repr()]))


class Add(Primitive):
    """``x + y`` with broadcasting; either side may be a Python number.

    Examples:
        >>> import torch
        >>> from remat import ops
        >>> ops.Add()(torch.tensor([1.0]), 2.0)
        tensor([3.])
    """

    def forward(self, x: Operand, y: Operand) -> torch.Tensor:
        return _as_tensor(x + y)


class Mul(Primitive):
    """``x * y`` with broadcasting; either side may be a Python number.

    Examples:
        >>> import torch
        >>> from remat import ops
        >>> ops.Mul()(torch.tensor([2.0]), torch.tensor([3.0]))
        tensor([6.])
    """

    def forward(self, x: Operand, y: Operand) -> torch.Tensor:
        return _as_tensor(x * y)


class MatMul(Primitive):
    """Matrix product ``op(x) @ op(y)``, where ``op`` transposes the last two dims if asked.

    Args:
        transpose_a: transpose ``x`` before the product.
        transpose_b: transpose ``y`` before the product.

    Raises:
        TypeError: a flag is not a bool.

    Examples:
        >>> import torch
        >>> from remat import ops
        >>> ops.MatMul(transpose_b=True)(torch.ones(2, 3), torch.ones(4, 3)).shape
        torch.Size([2, 4])
    """

    def __init__(self, transpose_a: bool = False, transpose_b: bool = False) -> None:
        super().__init__()
        for key, value in (("transpose_a", transpose_a), ("transpose_b", transpose_b)):
            if not isinstance(value, bool):
                raise TypeError(
                    f"MatMul: '{key}' must be a bool, got {type(value).__name__} {value!r}; "
                    f"pass True or False"
                )
        self.transpose_a = transpose_a
        self.transpose_b = transpose_b

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.transpose_a:
            x = x.transpose(-1, -2)
        if self.transpose_b:
            y = y.transpose(-1, -2)
        return torch.matmul(x, y)

    def extra_repr(self) -> str:
        flags = f"transpose_a={self.transpose_a}, transpose_b={self.transpose_b}"
        return ", ".join(filter(None, [flags, super().extra_repr()]))


class BiasAdd(Primitive):
    """Add a 1-D ``bias`` along the channel axis of ``x`` (axis 1, or the last for NHWC).

    Args:
        data_format: ``"NCHW"`` (channels at axis 1, also for 2-D inputs) or
            ``"NHWC"`` (channels last).

    Raises:
        ValueError: an unknown ``data_format``, or a bias whose length is not
            the number of channels.

    Examples:
        >>> import torch
        >>> from remat import ops
        >>> ops.BiasAdd()(torch.zeros(1, 2, 1, 1), torch.tensor([1.0, 2.0])).flatten()
        tensor([1., 2.])
    """

    def __init__(self, data_format: str = "NCHW") -> None:
        super().__init__()
        if data_format not in ("NCHW", "NHWC", "NCDHW"):
            raise ValueError(
                f"BiasAdd: 'data_format' must be 'NCHW', 'NHWC' or 'NCDHW', got {data_format!r}"
            )
        self.data_format = data_format

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        axis = x.dim() - 1 if self.data_format == "NHWC" else 1
        if bias.dim() != 1 or x.dim() < 2 or bias.shape[0] != x.shape[axis]:
            raise ValueError(
                f"BiasAdd: bias must be 1-D with one value per channel (axis {axis} of x, "
                f"size {x.shape[axis] if x.dim() > axis else '?'}), got bias of shape "
                f"{tuple(bias.shape)} for x of shape {tuple(x.shape)}"
            )
        shape = [1] * x.dim()
        shape[axis] = bias.shape[0]
        return x + bias.reshape(shape)
