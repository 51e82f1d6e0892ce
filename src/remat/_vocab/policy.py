"""Selective recompute policies: which operator outputs a region keeps (layer 1).

A policy is a small frozen value that answers one question for each operator a
region runs: *save* its output (keep it for backward) or *recompute* it. Policies
look at the operator's name only (``"aten::mm"``, ``"aten::relu"``), so this
module imports no torch and a policy can be printed, hashed and compared.

Example:
    >>> from remat import save_compute_intensive
    >>> save_compute_intensive.saves("aten::mm"), save_compute_intensive.saves("aten::relu")
    (True, False)
"""

from __future__ import annotations

from dataclasses import dataclass

#: Operators whose outputs are expensive to rebuild: matrix products, convolutions, attention.
COMPUTE_INTENSIVE_OPS: frozenset[str] = frozenset(
    {
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::baddbmm",
        "aten::matmul",
        "aten::linear",
        "aten::_scaled_mm",
        "aten::convolution",
        "aten::_convolution",
        "aten::cudnn_convolution",
        "aten::mkldnn_convolution",
        "aten::convolution_overrideable",
        "aten::_scaled_dot_product_flash_attention",
        "aten::_scaled_dot_product_efficient_attention",
        "aten::_scaled_dot_product_cudnn_attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_flash_attention_forward",
        "aten::_efficient_attention_forward",
    }
)


def op_base_name(name: str) -> str:
    """Strip the overload: ``"aten::add.Tensor"`` -> ``"aten::add"``."""
    return name.split(".", 1)[0]


@dataclass(frozen=True)
class Policy:
    """Decide per operator whether a region keeps its output.

    Args:
        name: how the policy prints.
        save_ops: operator names (without overload) whose outputs are kept.
        save_everything: keep every operator's output (nothing is recomputed).

    Example:
        >>> from remat import Policy
        >>> p = Policy("keep_matmuls", save_ops=frozenset({"aten::mm"}))
        >>> p.saves("aten::mm.default"), p.saves("aten::gelu")
        (True, False)
    """

    name: str
    save_ops: frozenset[str] = frozenset()
    save_everything: bool = False

    def saves(self, op_name: str) -> bool:
        """Return True when the output of operator ``op_name`` is kept for backward."""
        return self.save_everything or op_base_name(op_name) in self.save_ops

    def __repr__(self) -> str:
        return self.name


def save_only(*op_names: str) -> Policy:
    """Return a policy that keeps the outputs of ``op_names`` and recomputes all else.

    Args:
        *op_names: aten operator names, e.g. ``"aten::mm"`` (an overload suffix is ignored).

    Returns:
        A :class:`Policy`.

    Example:
        >>> from remat import save_only
        >>> save_only("aten::mm", "aten::convolution")
        save_only('aten::mm', 'aten::convolution')
    """
    names = tuple(op_base_name(n) for n in op_names)
    bad = [n for n in names if "::" not in n]
    if bad:
        raise ValueError(
            f"remat.save_only: operator names must look like 'aten::mm', got {bad!r}"
        )
    shown = ", ".join(repr(n) for n in names)
    return Policy(f"save_only({shown})", save_ops=frozenset(names))


#: Keep every operator's output: the region behaves as if unmarked (a baseline).
save_all = Policy("save_all", save_everything=True)
#: Keep nothing inside the region: every saved tensor is rebuilt (plain recompute).
recompute_all = Policy("recompute_all")
#: Keep the outputs of matmuls, convolutions and attention; recompute pointwise ops.
save_compute_intensive = Policy("save_compute_intensive", save_ops=COMPUTE_INTENSIVE_OPS)
