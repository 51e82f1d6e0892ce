"""``remat.ms.nn``: torch layers with MindSpore's names, arguments and defaults.

Every layer is both the ``torch.nn`` layer it wraps (``Dense`` is a
``torch.nn.Linear``, ``Conv2d`` a ``torch.nn.Conv2d``, ...) and a
`remat.nn.Cell`, so it has ``.recompute()``. Parameter names stay
PyTorch's (``weight``, ``bias``), and layers return ``torch.Tensor``.

Examples:
    >>> import torch
    >>> import remat.ms.nn as nn
    >>> fc = nn.Dense(4, 2, weight_init="ones", bias_init="zeros")
    >>> fc.recompute()
    >>> fc(torch.ones(1, 4))
    tensor([[4., 4.]], grad_fn=<...>)
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

import torch
import torch.nn.functional as F

from remat.ms._init import initialize
from remat.ms._tensor import check_dtype
from remat.nn import Cell

__all__ = [
    "GELU",
    "BatchNorm2d",
    "Cell",
    "CellList",
    "Conv2d",
    "Dense",
    "Dropout",
    "Flatten",
    "ReLU",
    "SequentialCell",
    "Sigmoid",
    "Softmax",
    "Tanh",
]

PAD_MODES = ("same", "valid", "pad")


class CellList(torch.nn.ModuleList, Cell):
    """A list of cells (``torch.nn.ModuleList``), as ``mindspore.nn.CellList``."""


class SequentialCell(torch.nn.Sequential, Cell):
    """Cells run in order (``torch.nn.Sequential``), as ``mindspore.nn.SequentialCell``.

    Args:
        *args: cells, or one list of cells, or one ``OrderedDict`` of named cells.

    Examples:
        >>> import torch, remat.ms.nn as nn
        >>> seq = nn.SequentialCell([nn.Dense(2, 2), nn.ReLU()])
        >>> seq(torch.ones(1, 2)).shape
        torch.Size([1, 2])
    """

    def __init__(self, *args: Any) -> None:
        if len(args) == 1 and isinstance(args[0], list):
            args = tuple(args[0])
        if len(args) == 1 and isinstance(args[0], dict) and not isinstance(args[0], OrderedDict):
            args = (OrderedDict(args[0]),)
        super().__init__(*args)


def _activation(api: str, activation: Any) -> torch.nn.Module | None:
    if activation is None or isinstance(activation, torch.nn.Module):
        return activation
    table = {"relu": ReLU, "gelu": GELU, "sigmoid": Sigmoid, "tanh": Tanh, "softmax": Softmax}
    if isinstance(activation, str) and activation.lower() in table:
        return table[activation.lower()]()
    raise ValueError(
        f"{api}: unknown activation {activation!r}; pass one of {', '.join(table)}, "
        f"a Cell, or None"
    )


class Dense(torch.nn.Linear, Cell):
    """Fully connected layer ``activation(x @ weight.T + bias)``, as ``mindspore.nn.Dense``.

    Args:
        in_channels: input features.
        out_channels: output features.
        weight_init: initializer name (e.g. 'normal', 'he_uniform'), number or
            Tensor of shape ``[out_channels, in_channels]``; None keeps the
            default (HeUniform with slope sqrt(5), as MindSpore and torch).
        bias_init: the same for the bias; None keeps the default.
        has_bias: whether the layer adds a bias.
        activation: None, a name ('relu', 'gelu', 'sigmoid', 'tanh', 'softmax')
            or a Cell applied to the output.
        dtype: parameter dtype (default float32).

    Raises:
        ValueError: an unknown initializer or activation name.

    Examples:
        >>> import torch, remat.ms.nn as nn
        >>> nn.Dense(12, 24, activation="relu")(torch.randn(2, 12)).shape
        torch.Size([2, 24])
    """

    def __init__(
        self, in_channels: int, out_channels: int, weight_init: Any = None,
        bias_init: Any = None, has_bias: bool = True, activation: Any = None,
        dtype: Any = None,
    ) -> None:  # fmt: skip
        api = "remat.ms.nn.Dense"
        super().__init__(in_channels, out_channels, bias=has_bias, dtype=check_dtype(api, dtype))
        self.in_channels, self.out_channels, self.has_bias = in_channels, out_channels, has_bias
        if weight_init is not None:
            initialize(api, "weight_init", self.weight, weight_init)
        if bias_init is not None and has_bias:
            initialize(api, "bias_init", self.bias, bias_init)
        self.activation = _activation(api, activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return y if self.activation is None else self.activation(y)


def _pair(api: str, name: str, value: Any) -> tuple[int, int]:
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in pair):
        raise ValueError(f"{api}: '{name}' must be a positive int or a pair of them, got {value!r}")
    return pair  # type: ignore[return-value]


def same_padding(size: int, kernel: int, stride: int, dilation: int) -> tuple[int, int]:
    """MindSpore's 'same' padding of one spatial dim: ``(before, after)``, the smaller before.

    Examples:
        >>> from remat.ms.nn import same_padding
        >>> same_padding(2, 2, 1, 1), same_padding(7, 3, 2, 1)
        ((0, 1), (1, 1))
    """
    total = max((math.ceil(size / stride) - 1) * stride + (kernel - 1) * dilation + 1 - size, 0)
    return total // 2, total - total // 2


class Conv2d(torch.nn.Conv2d, Cell):
    """2-D convolution with MindSpore's arguments and defaults, as ``mindspore.nn.Conv2d``.

    Args:
        in_channels, out_channels, kernel_size, stride, dilation: as in torch.
        pad_mode: 'same' (default; output size ``ceil(in / stride)``, the odd
            pixel of padding at the bottom/right), 'valid' (no padding) or
            'pad' (``padding`` pixels: an int, or ``(top, bottom, left, right)``).
        padding: used only with ``pad_mode='pad'``.
        group: groups of channels.
        has_bias: whether to add a bias (MindSpore's default: False).
        weight_init, bias_init: initializer name, number or Tensor; None keeps
            the default (HeUniform with slope sqrt(5)).
        data_format: only 'NCHW'.

    Raises:
        ValueError: a bad ``pad_mode``, ``padding`` without ``pad_mode='pad'``,
            an unknown initializer, or ``data_format`` other than 'NCHW'.

    Examples:
        >>> import torch, remat.ms.nn as nn
        >>> conv = nn.Conv2d(2, 2, 2, has_bias=False, weight_init="ones")
        >>> conv(torch.ones(1, 2, 2, 2)).shape
        torch.Size([1, 2, 2, 2])
    """

    def __init__(
        self, in_channels: int, out_channels: int, kernel_size: Any, stride: Any = 1,
        pad_mode: str = "same", padding: Any = 0, dilation: Any = 1, group: int = 1,
        has_bias: bool = False, weight_init: Any = None, bias_init: Any = None,
        data_format: str = "NCHW", dtype: Any = None,
    ) -> None:  # fmt: skip
        api = "remat.ms.nn.Conv2d"
        if pad_mode not in PAD_MODES:
            raise ValueError(f"{api}: 'pad_mode' must be one of {PAD_MODES}, got {pad_mode!r}")
        pads = (padding,) * 4 if isinstance(padding, int) else tuple(padding)
        if len(pads) != 4 or any(not isinstance(p, int) or p < 0 for p in pads):
            raise ValueError(
                f"{api}: 'padding' must be a non-negative int or (top, bottom, left, right), "
                f"got {padding!r}"
            )
        if pad_mode != "pad" and any(pads):
            raise ValueError(
                f"{api}: 'padding' is {padding!r} but pad_mode is {pad_mode!r}; "
                f"pass pad_mode='pad' to pad explicitly"
            )
        if data_format != "NCHW":
            raise ValueError(f"{api}: only data_format='NCHW' is supported, got {data_format!r}")
        kernel, strides = _pair(api, "kernel_size", kernel_size), _pair(api, "stride", stride)
        dilations = _pair(api, "dilation", dilation)
        super().__init__(
            in_channels, out_channels, kernel, stride=strides, padding=0, dilation=dilations,
            groups=group, bias=has_bias, dtype=check_dtype(api, dtype),
        )  # fmt: skip
        self.pad_mode, self.pads, self.has_bias, self.group = pad_mode, pads, has_bias, group
        if weight_init is not None:
            initialize(api, "weight_init", self.weight, weight_init)
        if bias_init is not None and has_bias:
            initialize(api, "bias_init", self.bias, bias_init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pad_mode == "same":
            top, bottom = same_padding(x.shape[-2], self.kernel_size[0], self.stride[0], self.dilation[0])
            left, right = same_padding(x.shape[-1], self.kernel_size[1], self.stride[1], self.dilation[1])
            x = F.pad(x, (left, right, top, bottom))
        elif self.pad_mode == "pad" and any(self.pads):
            top, bottom, left, right = self.pads
            x = F.pad(x, (left, right, top, bottom))
        return self._conv_forward(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, pad_mode={self.pad_mode!r}"


class BatchNorm2d(torch.nn.BatchNorm2d, Cell):
    """Batch normalization over NCHW inputs, as ``mindspore.nn.BatchNorm2d``.

    MindSpore's ``momentum`` weighs the *old* running statistics
    (``moving = momentum * moving + (1 - momentum) * batch``), the opposite of
    torch's, so this layer passes ``1 - momentum`` to torch.

    Args:
        num_features: channels.
        eps: added to the variance.
        momentum: MindSpore's momentum, in [0, 1] (default 0.9 = torch's 0.1).
        affine: learn ``gamma`` (``weight``) and ``beta`` (``bias``).
        gamma_init, beta_init, moving_mean_init, moving_var_init: initializer
            names, numbers or Tensors.
        use_batch_statistics: None follows ``train()``/``eval()``; True always
            uses the batch's statistics; False always the moving ones.

    The moving statistics are updated once per training step: remat's engine
    drops the running-statistics writes of a recomputation in backward.

    Raises:
        ValueError: ``momentum`` outside [0, 1], an unknown initializer.

    Examples:
        >>> import torch, remat.ms.nn as nn
        >>> bn = nn.BatchNorm2d(3)
        >>> bn.momentum  # torch's
        0.1
    """

    def __init__(
        self, num_features: int, eps: float = 1e-5, momentum: float = 0.9, affine: bool = True,
        gamma_init: Any = "ones", beta_init: Any = "zeros", moving_mean_init: Any = "zeros",
        moving_var_init: Any = "ones", use_batch_statistics: bool | None = None,
        data_format: str = "NCHW", dtype: Any = None,
    ) -> None:  # fmt: skip
        api = "remat.ms.nn.BatchNorm2d"
        if not isinstance(momentum, (int, float)) or not 0.0 <= momentum <= 1.0:
            raise ValueError(
                f"{api}: 'momentum' must be in [0, 1] (MindSpore's meaning: weight of the old "
                f"moving statistics), got {momentum!r}"
            )
        if data_format != "NCHW":
            raise ValueError(f"{api}: only data_format='NCHW' is supported, got {data_format!r}")
        super().__init__(num_features, eps=eps, momentum=round(1.0 - momentum, 12), affine=affine,
                         dtype=check_dtype(api, dtype))  # fmt: skip
        self.use_batch_statistics = use_batch_statistics
        for arg, tensor, spec in (
            ("gamma_init", self.weight, gamma_init), ("beta_init", self.bias, beta_init),
            ("moving_mean_init", self.running_mean, moving_mean_init),
            ("moving_var_init", self.running_var, moving_var_init),
        ):  # fmt: skip
            if tensor is not None:
                initialize(api, arg, tensor, spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        use_batch = self.training if self.use_batch_statistics is None else self.use_batch_statistics
        update = use_batch and self.training
        if update and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        return F.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, training=use_batch,
            momentum=self.momentum if update else 0.0, eps=self.eps,
        )  # fmt: skip


class Dropout(torch.nn.Dropout, Cell):
    """Zero elements at random in training, as ``mindspore.nn.Dropout``.

    Args:
        keep_prob: probability of keeping an element (MindSpore before 2.0).
        p: probability of dropping an element; wins over ``keep_prob``.

    Raises:
        ValueError: a probability outside its range.

    Examples:
        >>> import remat.ms.nn as nn
        >>> nn.Dropout(keep_prob=0.9).p, nn.Dropout(p=0.25).p
        (0.1, 0.25)
    """

    def __init__(self, keep_prob: float = 0.5, p: float | None = None, dtype: Any = None) -> None:
        api = "remat.ms.nn.Dropout"
        if p is None:
            if not isinstance(keep_prob, (int, float)) or not 0.0 < keep_prob <= 1.0:
                raise ValueError(f"{api}: 'keep_prob' must be in (0, 1], got {keep_prob!r}")
            p = round(1.0 - keep_prob, 12)
        elif not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
            raise ValueError(f"{api}: 'p' must be in [0, 1), got {p!r}")
        super().__init__(p=p)
        self.keep_prob = round(1.0 - p, 12)


class Flatten(torch.nn.Flatten, Cell):
    """Flatten dims ``start_dim..end_dim`` (default: all but the batch dim), as ``mindspore.nn.Flatten``."""

    def __init__(self, start_dim: int = 1, end_dim: int = -1) -> None:
        super().__init__(start_dim, end_dim)


class ReLU(torch.nn.ReLU, Cell):
    """``max(x, 0)`` as a Cell (``mindspore.nn.ReLU``)."""

    def __init__(self) -> None:
        super().__init__()


class GELU(torch.nn.GELU, Cell):
    """GELU as a Cell (``mindspore.nn.GELU``); ``approximate=True`` uses the tanh form."""

    def __init__(self, approximate: bool = True) -> None:
        super().__init__(approximate="tanh" if approximate else "none")


class Sigmoid(torch.nn.Sigmoid, Cell):
    """Sigmoid as a Cell (``mindspore.nn.Sigmoid``)."""


class Tanh(torch.nn.Tanh, Cell):
    """Tanh as a Cell (``mindspore.nn.Tanh``)."""


class Softmax(torch.nn.Softmax, Cell):
    """Softmax along ``axis`` as a Cell (``mindspore.nn.Softmax``)."""

    def __init__(self, axis: int = -1) -> None:
        super().__init__(dim=axis)
