"""``remat.ms``: a thin MindSpore-style surface, so MindSpore programs run on PyTorch.

Replace ``import mindspore`` with ``import remat.ms as mindspore`` (and
``from mindspore import ...`` with ``from remat.ms import ...``,
``import mindspore.nn as nn`` with ``import remat.ms.nn as nn``) and the
program runs on torch: layers are ``torch.nn`` layers with MindSpore's argument
names and defaults, results are ``torch.Tensor`` objects, and the recompute
marks (``Cell.recompute()``, ``Primitive.recompute()``, ``recompute(block, x)``)
are remat's.

Examples:
    >>> import numpy as np
    >>> import remat.ms as mindspore
    >>> from remat.ms import nn, ops
    >>> fc = nn.Dense(3, 1, weight_init="ones", bias_init="zeros")
    >>> x = mindspore.Tensor(np.ones([2, 3]), dtype=mindspore.float32)
    >>> print(ops.grad(fc)(x))
    [[1. 1. 1.]
     [1. 1. 1.]]
"""

from remat._front.functional import recompute
from remat.ms import nn, ops
from remat.ms._context import (
    GRAPH_MODE,
    PYNATIVE_MODE,
    get_context,
    set_context,
    set_seed,
)
from remat.ms._grad import grad, value_and_grad
from remat.ms._tensor import (
    Tensor,
    bfloat16,
    bool_,
    complex64,
    complex128,
    double,
    float16,
    float32,
    float64,
    float_,
    half,
    int8,
    int16,
    int32,
    int64,
    single,
    uint8,
)

__all__ = [
    "GRAPH_MODE",
    "PYNATIVE_MODE",
    "Tensor",
    "bfloat16",
    "bool_",
    "complex64",
    "complex128",
    "double",
    "float16",
    "float32",
    "float64",
    "float_",
    "get_context",
    "grad",
    "half",
    "int8",
    "int16",
    "int32",
    "int64",
    "nn",
    "ops",
    "recompute",
    "set_context",
    "set_seed",
    "single",
    "uint8",
    "value_and_grad",
]
