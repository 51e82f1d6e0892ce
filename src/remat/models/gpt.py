"""A GPT-2-style decoder written with `remat.nn.Cell` (layer 4: tools).

Pre-LayerNorm blocks, causal self-attention through
``torch.nn.functional.scaled_dot_product_attention``, a GELU MLP of four times
the width, tied input and output embeddings. The recompute recipe for a
transformer marks every decoder block; `GPT.mark_blocks` applies it and
`GPT.recompute_blocks` lists the blocks.

Examples:
    >>> import torch
    >>> from remat.models import GPT, GPTConfig
    >>> model = GPT(GPTConfig(layers=2, width=32, heads=4, seq_len=16, vocab=64))
    >>> model(torch.zeros(2, 16, dtype=torch.long)).shape
    torch.Size([2, 16, 64])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from remat.models._split import stage_share
from remat.nn import Cell

__all__ = ["GPT", "DecoderBlock", "GPTConfig", "GPTStage", "gpt"]


@dataclass(frozen=True)
class GPTConfig:
    """Size of a `GPT`.

    Args:
        layers: number of decoder blocks.
        width: model width (embedding size).
        heads: attention heads; must divide ``width``.
        seq_len: longest sequence (size of the position table).
        vocab: vocabulary size.

    Examples:
        >>> from remat.models import GPTConfig
        >>> GPTConfig(layers=2, width=32, heads=4).head_dim
        8
    """

    layers: int = 6
    width: int = 384
    heads: int = 6
    seq_len: int = 256
    vocab: int = 8192

    def __post_init__(self) -> None:
        if self.width % self.heads:
            raise ValueError(
                f"remat.models.GPTConfig: heads must divide width, got width={self.width} "
                f"and heads={self.heads}"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.width // self.heads


class CausalSelfAttention(Cell):
    """Multi-head causal self-attention with one fused q/k/v projection."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.proj = nn.Linear(config.width, config.width)

    def construct(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class DecoderBlock(Cell):
    """Pre-LN decoder block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``.

    Examples:
        >>> import torch
        >>> from remat.models import DecoderBlock, GPTConfig
        >>> DecoderBlock(GPTConfig(width=16, heads=2))(torch.randn(1, 4, 16)).shape
        torch.Size([1, 4, 16])
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.width)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.width)
        self.fc = nn.Linear(config.width, 4 * config.width)
        self.gelu = nn.GELU()
        self.proj = nn.Linear(4 * config.width, config.width)

    def construct(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.proj(self.gelu(self.fc(self.ln2(x))))


class GPT(Cell):
    """GPT-2-style language model: token and position embeddings, decoder blocks, LM head.

    Args:
        config: the sizes.

    Examples:
        >>> import torch
        >>> from remat.models import GPT, GPTConfig
        >>> net = GPT(GPTConfig(layers=1, width=16, heads=2, seq_len=8, vocab=32))
        >>> net(torch.zeros(1, 8, dtype=torch.long)).shape
        torch.Size([1, 8, 32])
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab, config.width)
        self.position_embedding = nn.Embedding(config.seq_len, config.width)
        self.blocks = nn.ModuleList(DecoderBlock(config) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab, bias=False)
        self.head.weight = self.token_embedding.weight

    def construct(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        if seq > self.config.seq_len:
            raise ValueError(
                f"remat.models.GPT: sequence of {seq} tokens is longer than "
                f"seq_len={self.config.seq_len}; build the model with a larger seq_len"
            )
        positions = torch.arange(seq, device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def recompute_blocks(self) -> list[nn.Module]:
        """Return the blocks the transformer recipe recomputes: every decoder block."""
        return list(self.blocks)

    def mark_blocks(self, **options: Any) -> list[nn.Module]:
        """Mark every decoder block with ``block.recompute(**options)``; return them.

        Examples:
            >>> import remat
            >>> from remat.models import gpt
            >>> net = gpt(layers=2, width=16, heads=2, seq_len=8, vocab=32)
            >>> len(net.mark_blocks(output_recompute=True))
            2
        """
        blocks = self.recompute_blocks()
        for block in blocks:
            block.recompute(**options)
        return blocks


class GPTStage(Cell):
    """Stage ``index`` of a `GPT` split into ``n_stages`` pipeline stages: its share of the
    blocks, the token and position embeddings before them on the first stage, the final norm
    and the head after them on the last (untied: the two ends live on different ranks). Its
    only input and output is one tensor, as ``torch.distributed.pipelining`` passes them.

    Args:
        config: the whole model's sizes.
        index: this stage, from 0.
        n_stages: stages in all; the blocks are split as evenly as they go, the first stages
            taking one more where they do not divide.

    Examples:
        >>> import torch
        >>> from remat.models import GPTConfig, GPTStage
        >>> config = GPTConfig(layers=3, width=32, heads=4, seq_len=16, vocab=64)
        >>> first, last = GPTStage(config, 0, 2), GPTStage(config, 1, 2)
        >>> (len(first.blocks), len(last.blocks))
        (2, 1)
        >>> last(first(torch.zeros(2, 16, dtype=torch.long))).shape
        torch.Size([2, 16, 64])
    """

    def __init__(self, config: GPTConfig, index: int, n_stages: int) -> None:
        super().__init__()
        n, first, last = stage_share("remat.models.GPTStage", config.layers, index, n_stages)
        self.token_embedding = nn.Embedding(config.vocab, config.width) if first else None
        self.position_embedding = nn.Embedding(config.seq_len, config.width) if first else None
        self.blocks = nn.ModuleList(DecoderBlock(config) for _ in range(n))
        self.ln_f = nn.LayerNorm(config.width) if last else None
        self.head = nn.Linear(config.width, config.vocab, bias=False) if last else None

    def construct(self, x: torch.Tensor) -> torch.Tensor:
        if self.token_embedding is not None:
            x = self.token_embedding(x) + self.position_embedding(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) if self.head is not None else x


def gpt(*, recompute: bool = False, recompute_options: Any = None, **sizes: Any) -> GPT:
    """Build a `GPT` from keyword sizes (those of `GPTConfig`).

    Args:
        recompute: mark every decoder block.
        recompute_options: a dict of ``Cell.recompute`` keywords used when ``recompute`` is True.
        **sizes: ``layers``, ``width``, ``heads``, ``seq_len``, ``vocab``.

    Returns:
        The model.

    Examples:
        >>> from remat.models import gpt
        >>> gpt(layers=1, width=16, heads=2, seq_len=8, vocab=32).config.layers
        1
    """
    model = GPT(GPTConfig(**sizes))
    if recompute:
        model.mark_blocks(**dict(recompute_options or {}))
    return model
