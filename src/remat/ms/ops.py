"""``remat.ms.ops``: MindSpore's operator namespace on torch.

The primitives of `remat.ops` (``ReLU()``, ``Softmax(axis)``, ``MatMul()``,
... each with ``.recompute()``) and the differentiation functions ``grad`` and
``value_and_grad``.

Examples:
    >>> import torch
    >>> from remat.ms import ops
    >>> relu = ops.ReLU()
    >>> relu.recompute()
    >>> print(ops.grad(lambda x: (2 * x).sum())(torch.ones(2)))
    [2. 2.]
"""

from remat.ms._grad import grad, value_and_grad
from remat.ops import Add, BiasAdd, GeLU, MatMul, Mul, Primitive, ReLU, Sigmoid, Softmax, Tanh

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
    "grad",
    "value_and_grad",
]
