"""A one-time warning when plain ``torch.compile`` traces a marked module (front end).

The marks' hooks step aside while Dynamo traces (hooks cannot drop saved tensors
inside a graph); only ``remat.compile``'s backend reads the marks back from the
modules and applies them on the joint graph. Any other backend would silently
keep every activation the marks were meant to drop, so the first such trace
warns and points to ``remat.compile``.

Examples:
    >>> from remat._front.compile_check import note_traced
    >>> note_traced()  # outside a trace: nothing to check
    True
"""

from __future__ import annotations

import warnings

_warned = False

MESSAGE = (
    "remat: torch.compile is tracing a module marked for recomputation with a backend that "
    "ignores remat's marks, so the compiled model keeps every activation the marks drop; "
    "compile it with remat.compile(model) (backend='aot_eager' or 'inductor'), or remove "
    "the marks with remat.unmark(model)"
)


def _backend_honours_marks() -> bool | None:
    """Whether the backend of the frame Dynamo is tracing applies remat's marks (None: no frame)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except Exception:  # noqa: BLE001 - not under Dynamo (torch.export, make_fx, ...)
        return None
    fn = getattr(getattr(tx, "output", None), "compiler_fn", None)
    for _ in range(16):  # the backend is wrapped (debug wrappers, callbacks)
        if fn is None:
            return False
        if getattr(fn, "honours_remat_marks", False):
            return True
        fn = getattr(fn, "compiler_fn", None) or getattr(fn, "__wrapped__", None)
    return False


def note_traced() -> bool:
    """Called by a mark's hook while tracing: warn once if the backend ignores the marks.

    Evaluated by Dynamo as a constant (it runs once per trace, outside the graph).

    Returns:
        True (a constant for the trace).
    """
    global _warned
    if not _warned and _backend_honours_marks() is False:
        _warned = True
        warnings.warn(MESSAGE, UserWarning, stacklevel=2)
    return True


note_traced._dynamo_marked_constant = True  # torch._dynamo.assume_constant_result, without importing Dynamo
