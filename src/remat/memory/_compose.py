"""A step's memory composed from short models of identical blocks (layer 3: tools).

NOTE [Composing an estimate]
A model whose blocks are the identical children of one container (``identical_container``:
one class, one set of parameter shapes, and here one set of marks) runs, on fake tensors,
the same operators block after block. ``remat.estimate(..., compose=True)`` then runs the
step of the model cut to 3 and to 4 blocks (``truncated``) instead of all ``n``, and
composes the whole step's figures from the two, exactly:

* every footprint of the step is reached in the segment of one block (its forward, its
  re-run, its backward; what runs outside the blocks belongs to the last block seen) or
  before the first; grouped by phase and by the block's role (first, interior, last), each
  group's largest footprint is affine in the number of interior blocks (NOTE [Verifying
  by composition] in ``remat/planner/_verify.py`` gives the argument), so it is
  ``g4 + (n - 4) * (g4 - g3)``, and the peak is the largest group's; each short model's
  groups must hold its whole peak, else the whole model is traced;
* the bytes that grow with the blocks (parameters, gradients, optimizer state, what the
  step keeps) are affine in ``n`` the same way, and so are the rows of the modules outside
  the blocks; a block's row is the 4-block model's first, interior or last block's;
* the timeline (one point per allocation) and the bytes by module and by phase at the
  peak are not composed: a composed report has none (``report.composed`` says it was).

The composed figures are checked against the whole model's, to the byte, in
``tests/test_estimate.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

from remat._front.marks import mark_of

#: the short models' lengths: a first block, interior ones, a last block
SHORT, LONG = 3, 4


def identical_container(model: torch.nn.Module, blocks: list, *, marks: bool = False) -> torch.nn.Module | None:
    """The container holding ``blocks`` when they are all its children, of one class and one set
    of parameter shapes (so a shorter container runs a shorter model), with ``marks`` also
    one set of recompute marks; else None."""
    parents = {name.rpartition(".")[0] for name, _ in blocks}
    if len(parents) != 1 or len(blocks) < 4:
        return None
    container = dict(model.named_modules()).get(parents.pop())
    if not isinstance(container, (torch.nn.ModuleList, torch.nn.Sequential)):
        return None
    if [id(m) for m in container.children()] != [id(m) for _, m in blocks]:
        return None
    first = signature(blocks[0][1], marks=marks)
    return container if all(signature(m, marks=marks) == first for _, m in blocks[1:]) else None


def signature(module: torch.nn.Module, *, marks: bool = False) -> tuple:
    """What makes two blocks identical: class, parameter names, shapes and dtypes (and with
    ``marks``, each submodule's recompute mark)."""
    shapes = tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters())
    if not marks:
        return (type(module), shapes)
    return (type(module), shapes, tuple((n, repr(mark_of(m))) for n, m in module.named_modules()))


@contextlib.contextmanager
def truncated(container: torch.nn.Module, count: int) -> Iterator[None]:
    """``container`` cut to its first ``count`` children while the context lasts."""
    saved = container._modules
    container._modules = type(saved)(list(saved.items())[:count])
    try:
        yield
    finally:
        container._modules = saved


def compose_report(model: torch.nn.Module, container: torch.nn.Module,
                   run: Callable[[Callable[[int, str, str], None]], Any]) -> Any | None:
    """The report of ``run`` on the whole model, composed from its runs with the container cut
    to `SHORT` and `LONG` blocks (NOTE [Composing an estimate]); ``run(watch)``
    runs one step under the tracker with ``watch`` as its ``on_change`` and returns the
    `ProfileReport`. None when the composition does not hold."""
    where = next(name for name, m in model.named_modules() if m is container)
    prefix = f"{where}." if where else ""
    keys = list(container._modules)
    n = len(keys)
    if n <= LONG + 1:
        return None
    reports, groups = {}, {}
    for count in (SHORT, LONG):
        blocks = [f"{prefix}{k}" for k in keys[:count]]
        roles = ["first", *["interior"] * (count - 2), "last"]
        peaks: dict[tuple, int] = {}
        cursor: list[Any] = [None]

        def watch(live: int, phase: str, module: str, blocks: list = blocks, roles: list = roles,
                  peaks: dict = peaks, cursor: list = cursor) -> None:
            for i, block in enumerate(blocks):
                if module == block or module.startswith(block + "."):
                    cursor[0] = roles[i]
                    break
            key = (phase, cursor[0])
            if key not in peaks or live > peaks[key]:
                peaks[key] = live

        with truncated(container, count):
            report = run(watch)
        if max(peaks.values(), default=0) != report.peak_increase:
            return None  # a footprint outside every group: trace the whole model
        reports[count] = report
        groups[count] = {key: report.baseline_bytes + live for key, live in peaks.items()}
    short, long = reports[SHORT], reports[LONG]
    if groups[SHORT].keys() != groups[LONG].keys():
        return None

    def grow(a: float, b: float) -> Any:
        return b + (n - LONG) * (b - a)

    composed = {key: grow(groups[SHORT][key], value) for key, value in groups[LONG].items()}
    peak_key = max(composed, key=composed.get)
    baseline = grow(short.baseline_bytes, long.baseline_bytes)
    phase_peaks: dict[str, int] = {}
    for (phase, _), value in composed.items():
        phase_peaks[phase] = max(phase_peaks.get(phase, value), value)
    return dataclasses.replace(
        long, rows=_rows(model, short, long, prefix, keys), total_kept=grow(short.total_kept, long.total_kept),
        outside_kept=grow(short.outside_kept, long.outside_kept), peak_bytes=composed[peak_key],
        peak_increase=composed[peak_key] - baseline, peak_phase=peak_key[0], baseline_bytes=baseline,
        param_bytes=grow(short.param_bytes, long.param_bytes), grad_bytes=grow(short.grad_bytes, long.grad_bytes),
        optimizer_bytes=grow(short.optimizer_bytes, long.optimizer_bytes), peak_by_phase={}, peak_by_module={},
        timeline=[], phase_peaks={phase: phase_peaks[phase] for phase in long.phase_peaks if phase in phase_peaks},
        composed=f"{n} identical blocks composed from runs with {SHORT} and {LONG}")


#: the fields of a module's row that grow with the number of blocks (a row outside them)
_GROWING = ("kept_self", "kept", "input_bytes", "output_bytes", "if_recomputed", "param_bytes")


def _rows(model: torch.nn.Module, short: Any, long: Any, prefix: str, keys: list) -> list:
    """The whole model's rows: a block's is the 4-block model's first, an interior, or its last
    block's, renamed; one outside the blocks grows with them."""
    n = len(keys)
    theirs = {row.name: row for row in short.rows}
    rows = []
    for row in long.rows:
        name = row.name
        block = next((i for i, k in enumerate(keys[:LONG]) if name == f"{prefix}{k}"
                      or name.startswith(f"{prefix}{k}.")), None)
        if block is None:
            if name not in theirs:
                return []  # not composable row by row: leave the rows out
            grown = {f: getattr(row, f) + (n - LONG) * (getattr(row, f) - getattr(theirs[name], f))
                     for f in _GROWING}
            rows.append(dataclasses.replace(row, **grown))
            continue
        if block == 1:  # the interior block stands for every interior one
            inside = name[len(f"{prefix}{keys[1]}"):]
            rows += [dataclasses.replace(row, name=f"{prefix}{keys[j]}{inside}") for j in range(1, n - 2)]
        elif block == 0:
            rows.append(row)
        elif block in (2, 3):
            inside = name[len(f"{prefix}{keys[block]}"):]
            rows.append(dataclasses.replace(row, name=f"{prefix}{keys[n - LONG + block]}{inside}"))
    return _in_model_order(model, rows)


def _in_model_order(model: torch.nn.Module, rows: list) -> list:
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    root = type(model).__name__
    return sorted(rows, key=lambda r: -1 if r.name == root else order.get(r.name, len(order)))
