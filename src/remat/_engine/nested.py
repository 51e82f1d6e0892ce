"""The nested backward of a reentrant region's re-run, called at the engine's cost (engine).

NOTE [The nested backward called directly]
A ``use_reentrant=True`` region's backward differentiates its re-run by a nested backward
(NOTE [Reentrant gradients] in ``reentrant.py``). ``torch.autograd.grad`` first handles
what a user may pass it: a single tensor or a dict for ``inputs``, gradient edges, tensor
subclasses (``__torch_function__``), missing or batched output gradients, each output's
gradient checked against its shape in Python. On a launch-bound block that took about
15 microseconds a call (out of the call's 23 over the engine's own entry, in a tight
loop), and two to three times that inside a step: 3 to 4 hundredths of a block's
step against torch's reentrant checkpoint, whose nested ``backward`` pays the same
handling for one input where remat's pays it for every parameter (NOTE [Reentrant
gradients]). What the region hands over is none of that: plain tensors only, every output
with the gradient autograd computed for it (the engine checks its shape, dtype and device
again, ``validate_outputs``, before it runs the graph). So for plain tensors `grad` calls
the function ``torch.autograd.grad`` ends in, ``torch.autograd.graph._engine_run_backward``
(the engine's entry with torch's debug-logging hooks and its context for device threads),
with the arguments ``grad`` would pass; anything else (a subclass, a gradient edge, an
output without a gradient, a ``TorchFunctionMode`` that would see the call, such as
``with torch.device(...)``), and every call on a torch without that function, goes through
``torch.autograd.grad`` itself.
"""

from __future__ import annotations

import torch

try:
    from torch.autograd.graph import _engine_run_backward
except ImportError:  # a torch without it: its public call, always
    _engine_run_backward = None

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_function_modes = torch._C._len_torch_function_stack  # a mode sees ``torch.autograd.grad`` called


def grad(outs: list, wrt: list, out_grads: list, create_graph: bool = False) -> tuple:
    """``torch.autograd.grad(outs, wrt, out_grads, allow_unused=True, create_graph=...)``
    (NOTE [The nested backward called directly])."""
    if (_engine_run_backward is not None and len(out_grads) == len(outs) and not _function_modes()
            and all(type(t) in _PLAIN for t in (*outs, *wrt, *out_grads))):
        return _engine_run_backward(tuple(outs), tuple(out_grads), create_graph, create_graph, tuple(wrt),
                                    True, accumulate_grad=False)
    return torch.autograd.grad(outs, wrt, out_grads, allow_unused=True, create_graph=create_graph)
