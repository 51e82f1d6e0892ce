"""What a region reaches and writes: modules, parameters, state (engine).

Used to decide, per region, whether its re-run needs the state guard (NOTE [Guard
only when needed]), which batch norms to put back (NOTE [Quiet batch norms]), and
which tensors a reentrant region takes as inputs.
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any

import torch
from torch.utils import _pytree as pytree


def reachable(fn: Any, args: Any, limit: int = 2000) -> tuple[list, list] | None:
    """The modules and tensors ``fn`` can reach, or None when ``fn`` is opaque.

    NOTE [What a region reaches]: followed are ``fn`` itself, a bound method's
    ``__self__``, a function's closure, defaults and the globals it names,
    ``functools.partial`` arguments, and lists, tuples and dicts of those. The
    state guard (NOTE [Guard only when needed]) and the reentrant region's
    extra inputs (NOTE [Reentrant gradients]) use it. A callable object that is not a module, or a walk
    longer than ``limit``, is opaque.
    """
    modules, tensors, seen = [], [], set()
    todo = [fn, *pytree.tree_leaves(args)]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if len(seen) > limit:
            return None
        if isinstance(obj, torch.nn.Module):
            modules.append(obj)
        elif isinstance(obj, torch.Tensor):
            tensors.append(obj)
        elif isinstance(obj, (list, tuple)):
            todo.extend(obj)
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, functools.partial):
            todo.extend([obj.func, *obj.args, *obj.keywords.values()])
        elif isinstance(obj, types.MethodType):
            todo.extend([obj.__self__, obj.__func__])
        elif isinstance(obj, types.FunctionType):
            todo.extend(c.cell_contents for c in obj.__closure__ or () if _filled(c))
            todo.extend(obj.__defaults__ or ())
            todo.extend((obj.__kwdefaults__ or {}).values())
            names = obj.__code__.co_names
            todo.extend(obj.__globals__[n] for n in names if n in obj.__globals__)
        elif obj is fn:
            return None
    return modules, tensors


def _filled(cell: Any) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:
        return False
    return True


def state_tensors(reached: tuple[list, list], inputs: list) -> list:
    """Buffers of the reached modules, reached tensors and inputs, with their versions.

    NOTE [Guard only when needed]: the state guard (NOTE [No double state
    updates]) costs a Python dispatch per operator of the re-run; it is needed
    only when the forward wrote to a tensor it did not create. Comparing these
    version counters before and after the forward tells. Parameters are left
    out: autograd refuses in-place writes to them under grad.
    """
    modules, tensors = reached
    found, todo = list(tensors) + inputs, list(modules)
    while todo:
        module = todo.pop()
        found.extend(b for b in module._buffers.values() if b is not None)
        todo.extend(m for m in module._modules.values() if m is not None)
    return [(t, t._version) for t in found]


def differentiable(reached: tuple[list, list] | None) -> list:
    """The tensors requiring grad that a region reaches besides its arguments.

    Parameters of the reached modules, tensors they hold as plain attributes, and
    tensors read through a closure (leaves or not, an argument too when the closure
    also reads it), each once. A
    reentrant region takes them as inputs of its ``autograd.Function`` (NOTE
    [Reentrant gradients]).
    """
    if reached is None:
        return []
    modules, tensors = reached
    taken: set[int] = set()
    out = []
    for t in [p for m in modules for p in m.parameters()] + tensor_attributes(modules) + tensors:
        if t.requires_grad and id(t) not in taken:
            taken.add(id(t))
            out.append(t)
    return out


def tensor_attributes(modules: list) -> list:
    """Tensors the modules (and their submodules) hold as plain attributes (``self.memo = h``)."""
    out, seen, todo = [], set(), list(modules)
    while todo:
        module = todo.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        out += [v for v in module.__dict__.values() if isinstance(v, torch.Tensor)]
        todo.extend(m for m in module._modules.values() if m is not None)
    return out


def norms_writing_only(modules: list, written: list) -> list:
    """The batch norms in ``modules`` if their running statistics are all that was written.

    NOTE [Quiet batch norms]: BatchNorm in training mode normalizes with the
    batch's statistics; its running statistics are only written, never read.
    If they are the only state the forward wrote, the re-run writes them as
    usual and their values are put back afterwards (a copy of a few numbers
    per channel), instead of running every operator under the state guard.

    The copy-back writes through ``.data``, which does not bump the buffers'
    version counters: batch norm's own kernel updates its running statistics
    without a bump, and an earlier call of the same batch norm outside the
    region saved them for backward at that version (autograd would otherwise
    refuse them). It runs outside every dispatch mode of the recomputation (a
    ``context_fn``'s, the state guard): snapshot and copy-back are the engine's,
    not the region's operators.
    """
    if not written:
        return []
    norms, todo = [], list(modules)
    while todo:
        module = todo.pop()
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            norms.append(module)
        todo.extend(m for m in module._modules.values() if m is not None)
    stats = {id(b) for m in norms if m.training and m.track_running_stats
             for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None}
    if not all(id(t) in stats for t in written):
        return []
    return [m for m in norms if m.training and m.track_running_stats]


@contextlib.contextmanager
def quiet(norms: list) -> Any:
    """Put the running statistics of ``norms`` back as they were. See NOTE [Quiet batch norms]."""
    stats = [b for m in norms for b in (m.running_mean, m.running_var, m.num_batches_tracked)
             if b is not None]
    before = [b.detach().clone() for b in stats]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in zip(stats, before):
                b.data.copy_(value)  # no version bump: see the docstring
