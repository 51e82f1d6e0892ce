"""Ready-made models for the demo, the benchmark and users' experiments (layer 4: tools).

``resnet50`` is the ResNet-50 of MindSpore's recompute tutorial; ``GPT`` a GPT-2-style decoder. Each
model has ``recompute_blocks()`` (the blocks its recompute recipe marks) and
``mark_blocks(**options)`` (apply the recipe with ``Cell.recompute`` options).

Examples:
    >>> from remat.models import resnet50
    >>> len(resnet50(recompute=True).recompute_blocks())
    12
"""

from remat.models.gpt import GPT, DecoderBlock, GPTConfig, GPTStage, gpt
from remat.models.resnet import ResidualBlock, ResNet, resnet, resnet50

__all__ = [
    "GPT",
    "DecoderBlock",
    "GPTConfig",
    "GPTStage",
    "ResNet",
    "ResidualBlock",
    "gpt",
    "resnet",
    "resnet50",
]
