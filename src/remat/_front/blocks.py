"""Find the repeated block of a model: what ``remat.apply(model, where="blocks")`` marks (front end).

NOTE [Finding blocks]
1. Hugging Face transformers: the layers that Hugging Face's own gradient
   checkpointing wraps (subclasses of ``GradientCheckpointingLayer``: GPT-2's
   ``GPT2Block``, Llama's ``LlamaDecoderLayer``, BERT's ``BertLayer``, T5's ``T5Block``).
2. Otherwise, the children of every ``nn.ModuleList``, ``nn.Sequential`` or
   ``nn.ModuleDict`` whose children (two or more) are all of one class: a model's
   ``blocks``/``layers`` list, a torchvision ResNet's stage of ``BasicBlock``s, a
   timm ViT's ``blocks``, a DenseNet's dense block; and the children of the class
   that makes more than half of a container, if it is not a torch layer (a
   MobileNet's ``InvertedResidual``s between its first and last convolutions).
3. Only the outermost are kept (blocks inside blocks, such as a mixture of experts'
   expert list inside a decoder layer, are not marked twice); when the outermost
   are stages (containers, or classes named ``*Stage*``: timm's ConvNeXt), the
   blocks repeated inside them are taken instead.

Examples:
    >>> import torch
    >>> from remat._front.blocks import find_blocks
    >>> block = lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.ModuleList([block() for _ in range(3)]))
    >>> [name for name, _ in find_blocks(net)]
    ['1.0', '1.1', '1.2']
"""

from __future__ import annotations

import sys

import torch

CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)


def _is_hf_layer(module: torch.nn.Module) -> bool:
    """A ``transformers.modeling_layers.GradientCheckpointingLayer`` (looked up, never imported)."""
    layer = getattr(sys.modules.get("transformers.modeling_layers"), "GradientCheckpointingLayer", None)
    return isinstance(layer, type) and isinstance(module, layer)


def _outermost(found: list[tuple[str, torch.nn.Module]]) -> list[tuple[str, torch.nn.Module]]:
    names = [n for n, _ in found]
    return [(n, m) for n, m in found if not any(n != o and n.startswith(o + ".") for o in names if o)]


def _repeated(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, CONTAINERS):
            continue
        children = list(module.named_children())
        kinds = [type(c) for _, c in children]
        if len(children) < 2:
            continue
        if len(set(kinds)) == 1:
            chosen = kinds[0]
        else:
            chosen = max(set(kinds), key=kinds.count)
            if not (kinds.count(chosen) >= 2 and 2 * kinds.count(chosen) > len(kinds)) or (
                    chosen.__module__.startswith("torch.nn.")):
                continue
        found += [(f"{name}.{n}" if name else n, c) for n, c in children if type(c) is chosen]
    return found


def _is_stage(module: torch.nn.Module) -> bool:
    return isinstance(module, CONTAINERS) or "stage" in type(module).__name__.lower()


def find_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Return ``(qualified name, module)`` of the model's repeated blocks (NOTE [Finding blocks]).

    Args:
        model: the model to search.

    Returns:
        The blocks in ``named_modules`` order; empty when the model has none.
    """
    hf = [(n, m) for n, m in model.named_modules() if _is_hf_layer(m)]
    if hf:
        return _outermost(hf)
    candidates = _repeated(model)
    outer = _outermost(candidates)
    while outer and all(_is_stage(m) for _, m in outer):
        inside = [(n, m) for n, m in candidates
                  if any(n.startswith(o + ".") if o else True for o, _ in outer) and (n, m) not in outer]
        inner = _outermost(inside)
        if not inner:
            break
        outer = inner
    return outer
