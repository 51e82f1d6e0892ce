"""A small U-Net: a model that is not a chain (layer 4: tools).

Each encoder block's output is used twice: by the next encoder block (after
pooling) and, through a skip connection, by the decoder block of the same
resolution. The planner (`remat.plan`) sees that graph and solves it
with the MILP; the tests and the benchmark use it as their non-chain model.

Examples:
    >>> import torch
    >>> from remat.models.unet import unet
    >>> unet(channels=(4, 8))(torch.randn(1, 3, 16, 16)).shape
    torch.Size([1, 3, 16, 16])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["DecoderBlock", "EncoderBlock", "UNet", "unet"]


class EncoderBlock(nn.Module):
    """Two 3x3 convolutions with ReLU (and dropout when ``dropout`` > 0)."""

    def __init__(self, cin: int, cout: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.relu = nn.ReLU()
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.conv2(self.drop(self.relu(self.conv1(x)))))


class DecoderBlock(nn.Module):
    """Upsample by 2, concatenate the skip tensor, then an `EncoderBlock`'s convolutions."""

    def __init__(self, cin: int, skip: int, cout: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(cin, cout, 2, stride=2)
        self.convs = EncoderBlock(cout + skip, cout, dropout)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.convs(torch.cat([self.up(x), skip], dim=1))


class UNet(nn.Module):
    """U-Net with ``len(channels)`` resolutions; input sides must divide by ``2**len(channels)``.

    Args:
        channels: channels of the encoder blocks, finest first; the bottleneck has twice the last.
        in_channels: input channels.
        out_channels: output channels.
        dropout: dropout probability inside every block.
    """

    def __init__(self, channels: Sequence[int] = (16, 32, 64), in_channels: int = 3,
                 out_channels: int = 3, dropout: float = 0.0) -> None:
        super().__init__()
        ins = [in_channels, *channels[:-1]]
        self.down = nn.ModuleList(EncoderBlock(a, b, dropout) for a, b in zip(ins, channels))
        self.pool = nn.MaxPool2d(2)
        self.middle = EncoderBlock(channels[-1], 2 * channels[-1], dropout)
        ups = [2 * channels[-1], *reversed(channels[1:])]
        self.up = nn.ModuleList(DecoderBlock(a, c, c, dropout) for a, c in zip(ups, reversed(channels)))
        self.head = nn.Conv2d(channels[0], out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = self.pool(x)
        x = self.middle(x)
        for block, skip in zip(self.up, reversed(skips)):
            x = block(x, skip)
        return self.head(x)


def unet(channels: Sequence[int] = (16, 32, 64), *, in_channels: int = 3, out_channels: int = 3,
         dropout: float = 0.0) -> UNet:
    """Build a `UNet` (see its arguments).

    Examples:
        >>> from remat.models.unet import unet
        >>> len(unet(channels=(4, 8, 16)).down)
        3
    """
    return UNet(channels, in_channels, out_channels, dropout)
