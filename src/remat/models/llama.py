"""A Llama-style decoder for memory estimates (layer 4: tools).

RMSNorm, rotary position embeddings, causal attention through
``scaled_dot_product_attention`` with optional grouped key/value heads, a
SwiGLU MLP, untied output head. `llama_7b` gives the 7B configuration;
build it under ``FakeTensorMode`` (as [`remat.estimate`][remat.estimate] does) to measure a
step without allocating it.

Examples:
    >>> import torch
    >>> from remat.models.llama import Llama, LlamaConfig
    >>> net = Llama(LlamaConfig(layers=2, width=32, heads=4, hidden=64, vocab=64))
    >>> net(torch.zeros(1, 8, dtype=torch.long)).shape
    torch.Size([1, 8, 64])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from remat.models._split import stage_share
from remat.nn import Cell

__all__ = ["Llama", "LlamaBlock", "LlamaConfig", "LlamaStage", "llama", "llama_7b", "llama_70b", "llama_stages",
           "next_token_loss", "tensor_parallel"]


@dataclass(frozen=True)
class LlamaConfig:
    """Size of a `Llama`.

    Args:
        layers: decoder blocks.
        width: model width.
        heads: query heads; must divide ``width``.
        kv_heads: key/value heads (None: ``heads``); must divide ``heads``.
        hidden: width of the SwiGLU MLP.
        vocab: vocabulary size.
        norm_eps: RMSNorm epsilon.
        rope_theta: base of the rotary frequencies.

    Examples:
        >>> from remat.models.llama import llama_7b
        >>> llama_7b().hidden
        11008
    """

    layers: int = 4
    width: int = 256
    heads: int = 4
    kv_heads: int | None = None
    hidden: int = 688
    vocab: int = 1024
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        kv = self.kv_heads or self.heads
        if self.width % self.heads or self.heads % kv:
            raise ValueError(
                f"remat.models.llama.LlamaConfig: heads must divide width and kv_heads must divide "
                f"heads, got width={self.width}, heads={self.heads}, kv_heads={self.kv_heads}"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.width // self.heads


def llama_7b() -> LlamaConfig:
    """The Llama-2 7B sizes: 32 layers, width 4096, 32 heads, MLP 11008, vocabulary 32000."""
    return LlamaConfig(layers=32, width=4096, heads=32, hidden=11008, vocab=32000)


def llama_70b() -> LlamaConfig:
    """The Llama-2 70B sizes: 80 layers, width 8192, 64 query and 8 key/value heads, MLP 28672,
    vocabulary 32000."""
    return LlamaConfig(layers=80, width=8192, heads=64, kv_heads=8, hidden=28672, vocab=32000)


class RMSNorm(nn.Module):
    """Root-mean-square normalization with a learned scale."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply rotary embeddings to ``x`` of shape (batch, heads, seq, head_dim)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class Attention(Cell):
    """Causal self-attention with rotary embeddings and grouped key/value heads."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads = config.heads, config.kv_heads or config.heads
        self.head_dim = config.head_dim
        self.q = nn.Linear(config.width, config.heads * self.head_dim, bias=False)
        self.k = nn.Linear(config.width, self.kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(config.width, self.kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(config.heads * self.head_dim, config.width, bias=False)

    def construct(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism (`tensor_parallel`) a rank holds a share of them
        q = self.q(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(batch, seq, -1))


class MLP(Cell):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(config.width, config.hidden, bias=False)
        self.up = nn.Linear(config.width, config.hidden, bias=False)
        self.down = nn.Linear(config.hidden, config.width, bias=False)

    def construct(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(Cell):
    """Pre-norm decoder block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.width, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.width, config.norm_eps)
        self.mlp = MLP(config)

    def construct(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(Cell):
    """Llama-style language model: embedding, decoder blocks, final norm, output head.

    Args:
        config: the sizes.

    Examples:
        >>> import torch
        >>> from remat.models.llama import Llama, LlamaConfig
        >>> net = Llama(LlamaConfig(layers=1, width=16, heads=2, hidden=32, vocab=32))
        >>> net.mark_blocks()[0].__class__.__name__
        'LlamaBlock'
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab, config.width)
        self.blocks = nn.ModuleList(LlamaBlock(config) for _ in range(config.layers))
        self.norm = RMSNorm(config.width, config.norm_eps)
        self.head = nn.Linear(config.width, config.vocab, bias=False)

    def rotary(self, seq: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cosines and sines of the rotary embedding for ``seq`` positions, like ``like``."""
        return _rotary(self.config, seq, like)

    def construct(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        cos, sin = self.rotary(tokens.shape[1], x)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))

    def mark_blocks(self, **options: Any) -> list[nn.Module]:
        """Mark every decoder block with ``block.recompute(**options)``; return them."""
        for block in self.blocks:
            block.recompute(**options)
        return list(self.blocks)


def _rotary(config: LlamaConfig, seq: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = config.head_dim // 2
    freqs = config.rope_theta ** (-torch.arange(half, device=like.device) / half)
    angles = torch.outer(torch.arange(seq, device=like.device), freqs).repeat(1, 2)
    return angles.cos().to(like.dtype), angles.sin().to(like.dtype)


class LlamaStage(Cell):
    """Stage ``index`` of a `Llama` split into ``n_stages`` pipeline stages: its share of the
    blocks, the embedding before them on the first stage, the final norm and head after them
    on the last. It takes token ids (first stage) or hidden states and computes its rotary
    tables itself, so a stage's only input and output is one tensor, as
    ``torch.distributed.pipelining`` passes them.

    Args:
        config: the whole model's sizes.
        index: this stage, from 0.
        n_stages: stages in all; the blocks are split as evenly as they go, the first stages
            taking one more where they do not divide.

    Examples:
        >>> import torch
        >>> from remat.models.llama import LlamaConfig, LlamaStage
        >>> config = LlamaConfig(layers=3, width=32, heads=4, hidden=64, vocab=64)
        >>> first, last = LlamaStage(config, 0, 2), LlamaStage(config, 1, 2)
        >>> (len(first.blocks), len(last.blocks))
        (2, 1)
        >>> last(first(torch.zeros(1, 8, dtype=torch.long))).shape
        torch.Size([1, 8, 64])
    """

    def __init__(self, config: LlamaConfig, index: int, n_stages: int) -> None:
        super().__init__()
        n, self.first, self.last = stage_share("remat.models.llama.LlamaStage", config.layers, index, n_stages)
        self.config = config
        self.embedding = nn.Embedding(config.vocab, config.width) if self.first else None
        self.blocks = nn.ModuleList(LlamaBlock(config) for _ in range(n))
        self.norm = RMSNorm(config.width, config.norm_eps) if self.last else None
        self.head = nn.Linear(config.width, config.vocab, bias=False) if self.last else None

    def construct(self, x: torch.Tensor) -> torch.Tensor:
        if self.embedding is not None:
            x = self.embedding(x)
        cos, sin = _rotary(self.config, x.shape[1], x)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x)) if self.head is not None else x


def llama_stages(config: LlamaConfig, n_stages: int) -> list[Any]:
    """One factory per pipeline stage of a `Llama` (`LlamaStage`), for
    [`remat.plan_pipeline`][remat.plan_pipeline] on fake tensors or to build a rank's stages.

    Examples:
        >>> from remat.models.llama import LlamaConfig, llama_stages
        >>> makers = llama_stages(LlamaConfig(layers=4, width=32, heads=4, hidden=64, vocab=64), 2)
        >>> [len(make().blocks) for make in makers]
        [2, 2]
    """
    import functools

    return [functools.partial(LlamaStage, config, i, n_stages) for i in range(n_stages)]


def llama(config: LlamaConfig | None = None, *, dtype: torch.dtype = torch.float32,
          recompute: bool = False, **sizes: Any) -> Llama:
    """Build a `Llama` from a config or keyword sizes, in ``dtype``.

    Examples:
        >>> from remat.models.llama import llama
        >>> llama(layers=1, width=16, heads=2, hidden=32, vocab=32).config.layers
        1
    """
    model = Llama(config or LlamaConfig(**sizes))
    if dtype != torch.get_default_dtype():  # (fake parameters cannot be converted in place)
        model = model.to(dtype)
    if recompute:
        model.mark_blocks()
    return model


def tensor_parallel(model: Llama, mesh: Any) -> Llama:
    """Shard every block of ``model`` over ``mesh`` (Megatron-style tensor parallelism).

    Attention's q, k, v and the MLP's gate and up projections are split column-wise (each
    rank holds a share of the heads and of the hidden units), the o and down projections
    row-wise, so each block issues one all-reduce after attention and one after the MLP.
    The embedding, the norms and the head are replicated. Mark blocks before calling it.

    Args:
        model: a `Llama` whose heads and key/value heads the mesh's size divides.
        mesh: a 1-D ``DeviceMesh``.

    Returns:
        ``model``, sharded in place.

    Raises:
        TypeError: ``model`` is not a `Llama`.
        ValueError: the mesh's size does not divide the heads, key/value heads or hidden width.

    Examples:
        >>> import torch, remat
        >>> from remat.models.llama import LlamaConfig, tensor_parallel
        >>> config = LlamaConfig(layers=2, width=32, heads=4, hidden=64, vocab=64)
        >>> one = remat.estimate(config, torch.zeros(1, 8, dtype=torch.long), optimizer=None)
        >>> rank = remat.estimate(config, torch.zeros(1, 8, dtype=torch.long), optimizer=None,
        ...                       world_size=2, parallelize=tensor_parallel)
        >>> rank.param_bytes < one.param_bytes
        True
    """
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    api = "remat.models.llama.tensor_parallel"
    if not isinstance(model, Llama):
        raise TypeError(f"{api}: expects a Llama, got {type(model).__name__}; write a "
                        f"parallelize_module plan for it")
    config, size = model.config, mesh.size()
    for name, value in (("heads", config.heads), ("kv_heads", config.kv_heads or config.heads),
                        ("hidden", config.hidden)):
        if value % size:
            raise ValueError(f"{api}: {size} ranks do not divide {name}={value}; choose a mesh "
                             f"whose size divides heads, kv_heads and hidden")
    plan = {f"attn.{n}": ColwiseParallel() for n in "qkv"}
    plan.update({"mlp.gate": ColwiseParallel(), "mlp.up": ColwiseParallel(),
                 "attn.o": RowwiseParallel(), "mlp.down": RowwiseParallel()})
    for block in model.blocks:
        parallelize_module(block, mesh, plan)
    return model


def next_token_loss(logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each position against a stand-in next token (0), in float32.

    Memory-wise this is the training loss of a language model (the float32
    logits and their log-softmax are kept for backward); the targets are dummies.
    """
    targets = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())
