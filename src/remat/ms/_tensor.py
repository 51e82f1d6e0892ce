"""``Tensor`` and the dtype names of the MindSpore-style surface.

``remat.ms.Tensor(data, dtype=...)`` builds a ``torch.Tensor``. The object is of
a thin subclass that only changes how it prints: ``print(t)`` shows the values
as numpy does (as MindSpore's ``print`` does) and ``repr(t)`` reads
``Tensor(shape=[2], dtype=Float32, value=[...])``. Like ``torch.nn.Parameter``,
the subclass does not propagate: any torch operation on it returns a plain
``torch.Tensor``. Gradients returned by ``remat.ms.grad`` and
``remat.ms.value_and_grad`` are of the same subclass, so they print as MindSpore's
documentation shows.

Examples:
    >>> import numpy as np
    >>> from remat.ms import Tensor, float32
    >>> t = Tensor(np.ones([2]), dtype=float32)
    >>> print(t)
    [1. 1.]
    >>> isinstance(t * 2, Tensor)
    False
"""

from __future__ import annotations

from typing import Any

import torch

float16 = torch.float16
float32 = torch.float32
float64 = torch.float64
bfloat16 = torch.bfloat16
int8 = torch.int8
int16 = torch.int16
int32 = torch.int32
int64 = torch.int64
uint8 = torch.uint8
bool_ = torch.bool
complex64 = torch.complex64
complex128 = torch.complex128
float_ = float32
half = float16
single = float32
double = float64

DTYPES = {
    "float16": float16,
    "float32": float32,
    "float64": float64,
    "bfloat16": bfloat16,
    "int8": int8,
    "int16": int16,
    "int32": int32,
    "int64": int64,
    "uint8": uint8,
    "bool_": bool_,
    "complex64": complex64,
    "complex128": complex128,
}

# MindSpore prints dtypes capitalised: Float32, Int64, Bool.
_DTYPE_NAMES = {dt: name.rstrip("_").capitalize() for name, dt in DTYPES.items()}


def check_dtype(api: str, dtype: Any) -> torch.dtype | None:
    """Return ``dtype`` if it is None or a ``torch.dtype``, else raise a ``TypeError`` naming ``api``."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    raise TypeError(
        f"{api}: 'dtype' must be a dtype such as remat.ms.float32, got "
        f"{type(dtype).__name__} {dtype!r}; accepted names: {', '.join(DTYPES)}"
    )


class Tensor(torch.Tensor):
    """A ``torch.Tensor`` built MindSpore's way, that prints as MindSpore prints.

    Args:
        input_data: a numpy array, a (nested) list, a number or a tensor.
        dtype: the element type, e.g. ``remat.ms.float32``; None keeps the
            input's (Python floats become float32, as in MindSpore).

    Returns:
        A tensor of this class; torch operations on it return plain tensors.

    Raises:
        TypeError: ``input_data`` is None or ``dtype`` is not a dtype.

    Examples:
        >>> from remat.ms import Tensor, int32
        >>> Tensor([1, 2], dtype=int32)
        Tensor(shape=[2], dtype=Int32, value= [1 2])
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __new__(cls, input_data: Any = None, dtype: Any = None, **kwargs: Any) -> torch.Tensor:
        api = "remat.ms.Tensor"
        dtype = check_dtype(api, dtype)
        shape = kwargs.pop("shape", None)
        kwargs.pop("const_arg", None)
        if kwargs:
            raise TypeError(
                f"{api}: unknown keyword argument(s) {', '.join(map(repr, kwargs))}; "
                f"accepted: input_data, dtype, shape, const_arg"
            )
        if input_data is None:
            if shape is None:
                raise TypeError(f"{api}: pass input_data (a numpy array, list or number)")
            data = torch.zeros(tuple(shape), dtype=dtype or float32)
        elif torch.is_tensor(input_data):
            data = input_data.detach().to(dtype=dtype or input_data.dtype)
        else:
            data = torch.as_tensor(input_data, dtype=dtype)
        return data.as_subclass(cls)

    def asnumpy(self) -> Any:
        """Return the values as a numpy array (MindSpore's ``Tensor.asnumpy``)."""
        data = self.detach().cpu().as_subclass(torch.Tensor)
        if data.dtype == torch.bfloat16:
            data = data.float()
        return data.numpy()

    def __str__(self) -> str:
        try:
            return str(self.asnumpy())
        except ImportError:  # numpy missing: torch's own form
            return torch.Tensor.__repr__(self.as_subclass(torch.Tensor))

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        name = _DTYPE_NAMES.get(self.dtype, str(self.dtype).replace("torch.", ""))
        sep = "\n" if self.dim() > 1 else " "
        return f"Tensor(shape={list(self.shape)}, dtype={name}, value={sep}{self})"

    def __format__(self, spec: str) -> str:
        return format(self.item(), spec) if self.dim() == 0 else str(self)


def as_ms_tensor(value: Any) -> Any:
    """Return a tensor as a `Tensor` sharing its storage, detached; other values unchanged."""
    if torch.is_tensor(value):
        return value.detach().as_subclass(Tensor)
    if isinstance(value, (tuple, list)):
        return type(value)(as_ms_tensor(v) for v in value)
    return value


def as_plain(value: Any) -> Any:
    """Return a `Tensor` as a plain ``torch.Tensor`` (same storage and graph)."""
    return value.as_subclass(torch.Tensor) if isinstance(value, Tensor) else value
