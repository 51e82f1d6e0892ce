"""``grad`` and ``value_and_grad`` with MindSpore's arguments and return shapes.

MindSpore differentiates a function with respect to some of its positional
inputs (``grad_position``: an int, a tuple of ints, or None) and/or some
parameters (``weights``). A non-scalar output is differentiated as if summed
(its sensitivity is all ones). With ``has_aux=True`` only the first output is
differentiated and the others are returned as they are.

What is returned:

- ``grad_position`` int: one gradient; tuple: a tuple of gradients.
- ``weights`` one tensor: one gradient; a list/tuple: a tuple of gradients.
- both given: ``(input gradients, weight gradients)``; only one: that one.
- ``grad`` with ``has_aux``: ``(gradients, aux)`` where ``aux`` is a tuple.
- ``value_and_grad``: ``(value, gradients)``, ``value`` being the function's
  whole output (``(loss, aux...)`` with ``has_aux``).

Values and gradients are detached `remat.ms.Tensor` objects (they print
as MindSpore prints). A gradient that does not depend on the output is zeros.

Examples:
    >>> import torch
    >>> from remat.ms import Tensor, grad
    >>> print(grad(lambda x: (x * x).sum())(Tensor([1.0, 2.0])))
    [2. 4.]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from remat.ms._context import _prepare
from remat.ms._tensor import as_ms_tensor, as_plain

Positions = int | tuple[int, ...] | None


def _check_positions(api: str, grad_position: Any, weights: Any) -> tuple[int, ...]:
    if grad_position is None:
        if weights is None:
            raise ValueError(
                f"{api}: 'grad_position' and 'weights' cannot both be None; pass "
                f"grad_position=0 to differentiate the first input or weights=(param, ...)"
            )
        return ()
    items = grad_position if isinstance(grad_position, tuple) else (grad_position,)
    for i in items:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise TypeError(
                f"{api}: 'grad_position' must be a non-negative int, a tuple of them or None, "
                f"got {grad_position!r}"
            )
    return items


def _check_weights(api: str, weights: Any) -> tuple[torch.Tensor, ...]:
    if weights is None:
        return ()
    items = (weights,) if torch.is_tensor(weights) else tuple(weights)
    for w in items:
        if not torch.is_tensor(w) or not w.requires_grad:
            raise TypeError(
                f"{api}: 'weights' must be a parameter or a list/tuple of parameters that "
                f"require grad (e.g. (model.fc1.weight,)), got {type(w).__name__}"
            )
    return items


def _differentiate(
    api: str, fn: Callable, args: tuple, kwargs: dict, positions: tuple, weights: tuple,
    has_aux: bool,
) -> tuple[Any, list[torch.Tensor]]:  # fmt: skip
    """Run ``fn`` and return its output and the gradients of positions then weights."""
    args = [as_plain(a) for a in args]
    for i in positions:
        if i >= len(args):
            raise ValueError(f"{api}: grad_position {i} is out of range for {len(args)} inputs")
        if not torch.is_tensor(args[i]) or not args[i].is_floating_point():
            raise TypeError(
                f"{api}: input {i} must be a floating-point Tensor to be differentiated, got "
                f"{getattr(args[i], 'dtype', type(args[i]).__name__)}"
            )
        args[i] = args[i].detach().requires_grad_(True)
    with torch.enable_grad():
        out = _prepare(fn)(*args, **kwargs)
    outputs = out if isinstance(out, (tuple, list)) else (out,)
    if has_aux and not isinstance(out, (tuple, list)):
        raise TypeError(
            f"{api}: has_aux=True needs fn to return (output, aux, ...), got one "
            f"{type(out).__name__}; return a tuple or pass has_aux=False"
        )
    targets = [t for t in (outputs[:1] if has_aux else outputs)
               if torch.is_tensor(t) and t.requires_grad]  # fmt: skip
    inputs = [args[i] for i in positions] + list(weights)
    grads = _backward_to(targets, inputs) if targets else [None] * len(inputs)
    return out, [torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs)]


def _backward_to(targets: list[torch.Tensor], inputs: list[torch.Tensor]) -> list:
    """Gradients of ``sum(targets)`` with respect to ``inputs``; no ``.grad`` is touched.

    Works through ``use_reentrant=True`` regions too: remat's reentrant region
    takes the parameters it reaches as inputs (NOTE [Observed reads]).
    """
    ones = [torch.ones_like(t) for t in targets]
    return list(torch.autograd.grad(targets, inputs, ones, allow_unused=True))


def _pack(grads: list, grad_position: Positions, weights: Any, n: int) -> Any:
    by_input, by_weight = grads[:n], grads[n:]
    inputs_part = by_input[0] if isinstance(grad_position, int) else tuple(by_input)
    weights_part = by_weight[0] if torch.is_tensor(weights) else tuple(by_weight)
    if grad_position is None:
        return as_ms_tensor(weights_part)
    if weights is None:
        return as_ms_tensor(inputs_part)
    return as_ms_tensor(inputs_part), as_ms_tensor(weights_part)


def _build(api: str, fn: Callable, grad_position: Positions, weights: Any, has_aux: Any) -> tuple:
    if not callable(fn):
        raise TypeError(f"{api}: 'fn' must be callable (a function or a Cell), got {type(fn).__name__}")
    if not isinstance(has_aux, bool):
        raise TypeError(f"{api}: 'has_aux' must be a bool, got {type(has_aux).__name__} {has_aux!r}")
    return _check_positions(api, grad_position, weights), _check_weights(api, weights)


def grad(
    fn: Callable, grad_position: Positions = 0, weights: Any = None, has_aux: bool = False
) -> Callable:
    """Return a function that computes the gradients of ``fn``, as ``mindspore.grad``.

    Args:
        fn: the function or Cell to differentiate.
        grad_position: which positional inputs to differentiate (int, tuple, None).
        weights: a parameter or a list/tuple of parameters to differentiate.
        has_aux: differentiate only ``fn``'s first output; return the others as ``aux``.

    Returns:
        ``f(*args) -> gradients`` (``(gradients, aux)`` with ``has_aux``); see the
        module docstring for the shapes.

    Raises:
        TypeError: ``fn`` not callable, a bad ``grad_position``/``weights``/``has_aux``.
        ValueError: ``grad_position`` and ``weights`` both None.

    Examples:
        >>> import torch
        >>> from remat import ms
        >>> fc = torch.nn.Linear(2, 1)
        >>> g = ms.grad(lambda x: fc(x).sum(), None, fc.weight)(torch.ones(3, 2))
        >>> print(g)
        [[3. 3.]]
    """
    api = "remat.ms.grad"
    positions, weight_list = _build(api, fn, grad_position, weights, has_aux)

    def grad_fn(*args: Any, **kwargs: Any) -> Any:
        out, grads = _differentiate(api, fn, args, kwargs, positions, weight_list, has_aux)
        packed = _pack(grads, grad_position, weights, len(positions))
        return (packed, as_ms_tensor(tuple(out[1:]))) if has_aux else packed

    return grad_fn


def value_and_grad(
    fn: Callable, grad_position: Positions = 0, weights: Any = None, has_aux: bool = False
) -> Callable:
    """Return a function that computes ``fn``'s value and gradients, as ``mindspore.value_and_grad``.

    Args:
        fn: the function or Cell to differentiate.
        grad_position: which positional inputs to differentiate (int, tuple, None).
        weights: a parameter or a list/tuple of parameters to differentiate.
        has_aux: differentiate only ``fn``'s first output.

    Returns:
        ``f(*args) -> (value, gradients)``; ``value`` is ``fn``'s whole output.

    Raises:
        TypeError: ``fn`` not callable, a bad ``grad_position``/``weights``/``has_aux``.
        ValueError: ``grad_position`` and ``weights`` both None.

    Examples:
        >>> import torch
        >>> from remat import ms
        >>> loss, g = ms.value_and_grad(lambda x: (3 * x).sum())(torch.ones(2))
        >>> print(loss, g)
        6.0 [3. 3.]
    """
    api = "remat.ms.value_and_grad"
    positions, weight_list = _build(api, fn, grad_position, weights, has_aux)

    def value_and_grad_fn(*args: Any, **kwargs: Any) -> Any:
        out, grads = _differentiate(api, fn, args, kwargs, positions, weight_list, has_aux)
        return as_ms_tensor(out), _pack(grads, grad_position, weights, len(positions))

    return value_and_grad_fn
