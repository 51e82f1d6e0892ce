"""The ResNet-50 of MindSpore's recompute tutorial, with `remat.nn.Cell` (layer 4: tools).

The layout is torchvision's (7x7 stem, max pool, bottleneck blocks with the
stride on the 3x3 convolution, a projection shortcut on the first block of each
stage, average pool, one linear layer), so ``resnet50(class_num=10)`` has
23,528,522 parameters. The tutorial's recompute recipe marks every residual block
but the first of each stage with ``Cell.recompute()``; `ResNet.mark_blocks`
applies it and `ResNet.recompute_blocks` lists those blocks, so that a
benchmark can wrap the very same blocks with another tool.

Examples:
    >>> import torch
    >>> from remat.models import resnet50
    >>> model = resnet50(class_num=10, recompute=True)
    >>> model(torch.randn(2, 3, 32, 32)).shape
    torch.Size([2, 10])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from remat.nn import Cell

__all__ = ["ResNet", "ResidualBlock", "resnet", "resnet50"]

EXPANSION = 4


def _conv(cin: int, cout: int, kernel: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False)


class ResidualBlock(Cell):
    """Bottleneck block: 1x1 reduce, 3x3 (carrying the stride), 1x1 expand, plus a shortcut.

    Args:
        in_channel: channels of the input.
        out_channel: channels of the output (four times the bottleneck width).
        stride: stride of the 3x3 convolution and of the projection shortcut.

    Examples:
        >>> import torch
        >>> from remat.models import ResidualBlock
        >>> ResidualBlock(64, 256)(torch.randn(1, 64, 8, 8)).shape
        torch.Size([1, 256, 8, 8])
    """

    def __init__(self, in_channel: int, out_channel: int, stride: int = 1) -> None:
        super().__init__()
        width = out_channel // EXPANSION
        self.conv1 = _conv(in_channel, width, 1)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv(width, width, 3, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = _conv(width, out_channel, 1)
        self.bn3 = nn.BatchNorm2d(out_channel)
        self.relu = nn.ReLU()
        self.down_sample = None
        if stride != 1 or in_channel != out_channel:
            self.down_sample = nn.Sequential(
                _conv(in_channel, out_channel, 1, stride), nn.BatchNorm2d(out_channel)
            )

    def construct(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.down_sample is None else self.down_sample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(Cell):
    """ResNet of bottleneck blocks, constructed as in MindSpore's recompute tutorial.

    Args:
        block: the residual block class (``ResidualBlock``).
        layer_nums: blocks per stage, e.g. ``[3, 4, 6, 3]``.
        in_channels: input channels of each stage, e.g. ``[64, 256, 512, 1024]``.
        out_channels: output channels of each stage, e.g. ``[256, 512, 1024, 2048]``.
        strides: stride of each stage, e.g. ``[1, 2, 2, 2]``.
        num_classes: size of the last linear layer.

    Examples:
        >>> import torch
        >>> from remat.models import ResNet, ResidualBlock
        >>> net = ResNet(ResidualBlock, [1, 1], [8, 32], [32, 64], [1, 2], 10)
        >>> net(torch.randn(1, 3, 32, 32)).shape
        torch.Size([1, 10])
    """

    def __init__(
        self,
        block: type,
        layer_nums: Sequence[int],
        in_channels: Sequence[int],
        out_channels: Sequence[int],
        strides: Sequence[int],
        num_classes: int,
    ) -> None:
        super().__init__()
        if not len(layer_nums) == len(in_channels) == len(out_channels) == len(strides):
            raise ValueError(
                "remat.models.ResNet: layer_nums, in_channels, out_channels and strides must "
                f"have one entry per stage, got lengths {len(layer_nums)}, {len(in_channels)}, "
                f"{len(out_channels)}, {len(strides)}"
            )
        self.conv1 = _conv(3, in_channels[0], 7, 2)
        self.bn1 = nn.BatchNorm2d(in_channels[0])
        self.relu = nn.ReLU()
        self.max_pool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layers = nn.ModuleList(
            self._make_layer(block, n, cin, cout, s)
            for n, cin, cout, s in zip(layer_nums, in_channels, out_channels, strides)
        )
        self.avg_pool = nn.AdaptiveAvgPool2d(1)
        self.end_point = nn.Linear(out_channels[-1], num_classes)

    @staticmethod
    def _make_layer(
        block: type, layer_num: int, in_channel: int, out_channel: int, stride: int
    ) -> nn.Sequential:
        blocks = [block(in_channel, out_channel, stride=stride)]
        blocks += [block(out_channel, out_channel, stride=1) for _ in range(1, layer_num)]
        return nn.Sequential(*blocks)

    def construct(self, x: torch.Tensor) -> torch.Tensor:
        x = self.max_pool(self.relu(self.bn1(self.conv1(x))))
        for layer in self.layers:
            x = layer(x)
        return self.end_point(torch.flatten(self.avg_pool(x), 1))

    def recompute_blocks(self) -> list[nn.Module]:
        """Return the blocks the recompute tutorial marks: every block but the first of each stage.

        Examples:
            >>> from remat.models import resnet50
            >>> len(resnet50().recompute_blocks())
            12
        """
        return [block for layer in self.layers for block in list(layer)[1:]]

    def mark_blocks(self, **options: Any) -> list[nn.Module]:
        """Apply the tutorial's marks: ``block.recompute(**options)`` on `recompute_blocks`.

        Args:
            **options: keywords of ``Cell.recompute`` (``output_recompute``,
                ``policy``, ``use_reentrant``, ...).

        Returns:
            The blocks marked.

        Examples:
            >>> import remat
            >>> from remat.models import resnet50
            >>> net = resnet50()
            >>> _ = net.mark_blocks(output_recompute=True)
            >>> len(remat.marked_modules(net))
            12
        """
        blocks = self.recompute_blocks()
        for block in blocks:
            block.recompute(**options)
        return blocks


def resnet(
    layer_nums: Sequence[int] = (3, 4, 6, 3),
    width: int = 64,
    class_num: int = 10,
    *,
    recompute: bool = False,
    **options: Any,
) -> ResNet:
    """Build a bottleneck ResNet whose stage ``i`` has ``width * 2**i`` bottleneck channels.

    ``resnet((3, 4, 6, 3), 64)`` is ResNet-50; smaller ``layer_nums`` and
    ``width`` give the tiny nets the tests use.

    Args:
        layer_nums: blocks per stage (four stages are customary, any number works).
        width: stem channels and bottleneck width of the first stage.
        class_num: number of classes.
        recompute: apply the recompute tutorial's marks (see `ResNet.mark_blocks`).
        **options: keywords of ``Cell.recompute`` used when ``recompute`` is True.

    Returns:
        The network (in training mode, freshly initialised from torch's RNG).

    Examples:
        >>> from remat.models import resnet
        >>> tiny = resnet((1, 2), width=4, class_num=3)
        >>> len(tiny.recompute_blocks())
        1
    """
    stages = len(layer_nums)
    out_channels = [width * EXPANSION * 2**i for i in range(stages)]
    in_channels = [width] + out_channels[:-1]
    strides = [1] + [2] * (stages - 1)
    net = ResNet(ResidualBlock, layer_nums, in_channels, out_channels, strides, class_num)
    return _marked(net, recompute, options, api="remat.models.resnet")


def resnet50(class_num: int = 10, *, recompute: bool = False, **options: Any) -> ResNet:
    """ResNet-50 of MindSpore's recompute tutorial: stages of 3, 4, 6 and 3 blocks.

    Channels [64, 256, 512, 1024] -> [256, 512, 1024, 2048], as the tutorial's ``resnet50``.

    Args:
        class_num: number of classes (10 for CIFAR-10: 23,528,522 parameters).
        recompute: mark every residual block but the first of each stage.
        **options: keywords of ``Cell.recompute`` used when ``recompute`` is True.

    Returns:
        The network; it takes 32x32 (CIFAR-10) or 224x224 (ImageNet) images alike.

    Examples:
        >>> from remat.models import resnet50
        >>> sum(p.numel() for p in resnet50(10).parameters())
        23528522
    """
    net = ResNet(
        ResidualBlock, [3, 4, 6, 3], [64, 256, 512, 1024], [256, 512, 1024, 2048], [1, 2, 2, 2],
        class_num,
    )
    return _marked(net, recompute, options, api="remat.models.resnet50")


def _marked(net: ResNet, recompute: bool, options: dict, *, api: str) -> ResNet:
    if recompute:
        net.mark_blocks(**options)
    elif options:
        raise TypeError(
            f"{api}: recompute options {sorted(options)} were given with recompute=False; "
            f"pass recompute=True to apply them"
        )
    return net
