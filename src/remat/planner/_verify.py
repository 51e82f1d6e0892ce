"""Verifying a plan of identical blocks on short models (layer 4).

NOTE [Verifying by composition]
A plan's peak is verified by running the step under the tracker. For a model whose
``n`` blocks are the identical children of one container (``identical_container``),
on fake tensors, the step of the whole model need not run: its peak is composed
exactly from a few short models, as the cost model composes its costs.

The plan's choices form runs of equal choices, of lengths ``L_1 .. L_r``. Every
footprint of the step is reached at some moment in the segment of one block (its
forward, its re-run, its backward; what runs outside the blocks belongs to the last
block seen) or before the first. At a moment in block ``i``'s segment the live bytes are
what the blocks before ``i`` keep, the gradients of the blocks after ``i``, and what
``i`` and its neighbours hold there; for identical blocks with the same choice and the
same neighbours' choices that last part is the same block after block. So within a run,
the footprint at the same moment of its interior blocks is affine in the block's
position, and its largest value (at the first or the last interior block, by the
slope's sign, which no length changes) is affine in every run's length; so is the
largest footprint at the run's first block and at its last. Grouping the moments by
phase and by the role of their block (run, first / interior / last), each group's
largest footprint is an affine function of ``(L_1 .. L_r)``, and the step's peak is
the largest of the groups'.

So the short model keeps every run of at most 4 blocks as it is and cuts a longer
one to 3 (first, one interior, last); one more short model per cut run has that run
one block longer. Each group's peak is then ``base + sum((L_k - 3) * slope_k)``, the
slope of run ``k`` being the difference the longer model made. The tracker reports
every footprint with the phase and the module running (``on_change``), and each
short model's groups must hold its whole peak, else the whole model is traced.

A rank's plan (NOTE [Planning a rank]) reaches two blocks out: FSDP2 gathers a unit's
neighbour ahead of it, in forward and in backward. There the roles are the first two
and the last two blocks of a run and its interior, a run is cut to 5 blocks when longer
than 6, and each short model is built, marked and sharded as the plan's runs are.

The composition is used when it runs fewer blocks than the whole model (a plan of
many short runs is traced whole), never on real tensors, and not for a step that runs
each block more than once (micro-batches: a block's moments recur once the gradients
exist, in the same groups); ``verify="full"``
always traces the whole model. ``tests/test_plan_compose.py`` holds the composed
peak equal to the whole model's to the byte on uniform and mixed plans, of one
process and of a rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from remat._front.marks import unmark_module
from remat.memory.internal import truncated
from remat.memory.profile import measure
from remat.planner._settings import Settings, mark_choices

API = "remat.plan"
#: blocks on each side whose choices a block's footprints depend on: one process, a rank
WINDOW = 1
RANK_WINDOW = 2


def runs_of(choices: Sequence[str]) -> list[tuple[str, int]]:
    """``choices`` as ``(choice, length)`` runs of equal choices, in order."""
    runs: list[tuple[str, int]] = []
    for choice in choices:
        if runs and runs[-1][0] == choice:
            runs[-1] = (choice, runs[-1][1] + 1)
        else:
            runs.append((choice, 1))
    return runs


def composed_peak(model: torch.nn.Module, names: Sequence[str], choices: Sequence[str],
                  container: torch.nn.Module, settings: Settings,
                  optimizer_peak: int | None, *, cheaper: bool = True) -> int | None:
    """The measured peak of the step with the blocks ``names`` (the children of ``container``,
    in order) marked as ``choices`` say, composed from short models (NOTE [Verifying by
    composition]); None when it cannot be composed or (with ``cheaper``) would run as many
    blocks as the whole model."""
    where = next((n for n, m in model.named_modules() if m is container), None)
    if where is None or not settings.machine.fake:
        return None
    window = WINDOW if settings.build is None else RANK_WINDOW
    cut_to = 2 * window + 1  # a run longer than cut_to + 1 is cut to cut_to blocks
    keys = list(container._modules)
    if list(names) != [f"{where}.{k}" if where else k for k in keys]:
        return None  # the blocks do not run in the container's order
    runs = runs_of(choices)
    base = [(c, n if n <= cut_to + 1 else cut_to) for c, n in runs]
    cut = [k for k, (_, n) in enumerate(runs) if n > cut_to + 1]
    shapes = [base] + [[(c, n + (k == j)) for k, (c, n) in enumerate(base)] for j in cut]
    if cheaper and sum(n for shape in shapes for _, n in shape) >= len(names):
        return None  # the whole model is no longer than the short ones together
    groups = []
    for shape in shapes:
        measured = _groups(model, container, where, shape, settings, optimizer_peak, window)
        if measured is None:
            return None
        groups.append(measured)
    first = groups[0]
    if any(g.keys() != first.keys() for g in groups[1:]):
        return None
    peak = max(value + sum((runs[k][1] - cut_to) * (g[key] - value) for k, g in zip(cut, groups[1:], strict=True))
               for key, value in first.items())
    return max(peak, optimizer_peak or 0)


def _groups(model: torch.nn.Module, container: torch.nn.Module, where: str,
            shape: list[tuple[str, int]], settings: Settings, optimizer_peak: int | None,
            window: int) -> dict | None:
    """One step of the model cut to ``shape`` (runs of ``(choice, length)``), marked so: the
    largest footprint (baseline included) per phase and role of the block whose segment it is in."""
    roles: list[tuple[int, Any]] = []
    chosen: list[str] = []
    for r, (choice, length) in enumerate(shape):
        roles += [(r, ("start", j) if j < window else ("end", length - 1 - j) if j >= length - window
                   else "interior") for j in range(length)]
        chosen += [choice] * length
    count = len(chosen)
    prefix = f"{where}." if where else ""
    blocks = [f"{prefix}{k}" for k in list(container._modules)[:count]]
    peaks: dict[Any, int] = {}
    cursor: list[Any] = [None]
    with contextlib.ExitStack() as stack:
        if settings.build is None:
            stack.enter_context(truncated(container, count))
            net = model
            marked = mark_choices(dict(model.named_modules()), dict(zip(blocks, chosen, strict=True)))
            stack.callback(lambda: [unmark_module(m) for m in marked])
        else:  # NOTE [Planning a rank]: a fresh model, cut, marked, then sharded
            net = settings.build.cut(where, count)(dict(zip(blocks, chosen, strict=True)))
        owner: dict[str, int] = {}
        for name, _ in net.named_modules():
            for i, block in enumerate(blocks):
                if name == block or name.startswith(block + "."):
                    owner[name] = i
                    break

        def watch(live: int, phase: str, module: str) -> None:
            i = owner.get(module)
            if i is not None:
                cursor[0] = roles[i]
            key = (phase, cursor[0])
            if key not in peaks or live > peaks[key]:
                peaks[key] = live

        report = measure(net, settings.step.inputs, step=settings.step, optimizer=settings.optimizer,
                         estimated=True, api=API, optimizer_step=optimizer_peak is None, watch=watch)
    if max(peaks.values(), default=0) != report.peak_increase:
        return None  # a footprint outside every group: trace the whole model
    return {key: report.baseline_bytes + live for key, live in peaks.items()}
