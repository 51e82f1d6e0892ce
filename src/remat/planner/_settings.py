"""What a plan may choose and how it is measured: the marks of each option, and the
planner's settings as one frozen value (layer 4).

Examples:
    >>> import torch
    >>> from remat.planner._settings import marks_of
    >>> block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    >>> [(name, kwargs) for name, _, kwargs in marks_of("b", block, "children:1")]
    [('b.1', {'output_recompute': True})]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from remat._front.marks import recompute_module, unmark_module
from remat._vocab.policy import save_calls, save_compute_intensive
from remat.memory.internal import Step
from remat.memory.profile import OptimizerLike
from remat.planner._solve import OPS, OPTIONS, STAGED, STAGES, Choice

API = "remat.plan"
MARKS: dict[str, dict] = {
    "keep": {},
    "recompute": {},
    "selective": {"policy": save_compute_intensive},
    "output": {"output_recompute": True},
}


def child_mark(child: torch.nn.Module) -> dict:
    """The mark an option inside a block sets on ``child`` (NOTE [Options inside blocks]):
    a cell mark on a module with submodules, ``output_recompute`` on a single operator."""
    return {} if next(child.children(), None) is not None else {"output_recompute": True}


def marks_of(name: str, block: torch.nn.Module, choice: str | Choice,
             api: str = API) -> list[tuple[str, torch.nn.Module, dict]]:
    """``(module name, module, recompute_module options)`` that option ``choice`` of block
    ``name`` sets: none for ``keep``, the block for the block options, children for ``children:``."""
    parsed = choice if isinstance(choice, Choice) else Choice.parse(choice, api=api, block=name)
    if parsed.module:
        raise ValueError(f"{api}: option {str(parsed)!r} of block {name!r} names a module of its own; "
                         f"a block's option is {str(parsed.without_module())!r}")
    if parsed.family in MARKS:
        return [] if parsed.family == "keep" else [(name, block, MARKS[parsed.family])]
    if parsed.family == OPS:  # NOTE [Options per operator]: the kept calls, the rest rebuilt
        return [(name, block, {"policy": save_calls(*parsed.calls), "stages": "each"})]
    if parsed.family == STAGED:  # the same, re-run in stages (NOTE [Re-runs in stages])
        return [(name, block, {"policy": save_calls(*parsed.calls), "stages": STAGES})]
    kids = dict(block.named_children())
    missing = [c for c in parsed.children if c not in kids]
    if missing:
        raise ValueError(f"{api}: block {name!r} ({type(block).__name__}) has no child {missing[0]!r} "
                         f"(option {str(parsed)!r}); its children are {sorted(kids)}")
    return [(f"{name}.{c}", kids[c], child_mark(kids[c])) for c in parsed.children]


def mark_choices(named: Mapping[str, torch.nn.Module],
                 choices: Mapping[str, str | Choice]) -> list[torch.nn.Module]:
    """Mark the blocks ``{name: option}`` of a model (``named``: its ``named_modules()``);
    return the modules marked (none when an option cannot be set)."""
    marked = []
    try:
        for name, choice in choices.items():
            for _, module, kwargs in marks_of(name, named[name], choice):
                recompute_module(module, **kwargs)
                marked.append(module)
    except Exception:
        for module in marked:
            unmark_module(module)
        raise
    return marked


@dataclass(frozen=True)
class Builder:
    """Builds the model of one run of a rank's plan (NOTE [Planning a rank]).

    Args:
        make: builds the unsharded model (inside the fake mode).
        finish: shards the marked model (``parallelize`` with the job's mesh), returns it.
        lengths: ``(container name, count)``: containers cut to their first ``count`` children.
    """

    make: Callable[[], torch.nn.Module]
    finish: Callable[[torch.nn.Module], torch.nn.Module]
    lengths: tuple[tuple[str, int], ...] = ()

    def __call__(self, choices: Mapping[str, str]) -> torch.nn.Module:
        """A fresh model, its blocks ``{name: option}`` marked, then sharded."""
        model = self.make()
        named = dict(model.named_modules())
        for name, count in self.lengths:
            container = named[name]
            container._modules = type(container._modules)(list(container._modules.items())[:count])
        mark_choices(named, choices)
        model.train()
        return self.finish(model)

    def cut(self, name: str, count: int) -> Builder:
        """The same builder with container ``name`` cut to ``count`` children."""
        return dataclasses.replace(self, lengths=(*self.lengths, (name, count)))


@dataclass(frozen=True)
class Machine:
    """What a plan is measured on: fake tensors or real ones, and the device whose roofline
    costs the operators (every ranking, and a fake-tensor plan's times).

    Args:
        fake: the model and inputs are fake tensors (times from the roofline).
        device: the device whose roofline times a fake-tensor plan.
        throughput: FLOP/s of that device (None: `THROUGHPUT` of ``_trace``).
        bandwidth: bytes/s of that device (None: `BANDWIDTH` of ``_trace``).
    """

    fake: bool = False
    device: str = "cpu"
    throughput: float | None = None
    bandwidth: float | None = None


@dataclass(frozen=True)
class Solving:
    """How plans are solved and checked (the arguments of `remat.plan` of the same names).

    Args:
        solver: ``"auto"``, ``"dp"`` or ``"milp"``.
        verify: measure each plan and re-solve while it exceeds its budget (``"full"``: on the
            whole model, never composed from short ones).
        floors: a budget below the floor gives its ``BudgetError`` in the list, not raised.
    """

    solver: str = "auto"
    verify: bool | str = True
    floors: bool = False


@dataclass(frozen=True, eq=False)
class Settings:
    """How `remat.plan` measures and solves, as one value handed down (the
    arguments of `remat.plan` of the same names).

    Args:
        step: the training step measured (NOTE [The step users run]).
        optimizer: whose state counts, and whose step's peak.
        blocks: the modules to plan (names or types); None: `remat._front.blocks.find_blocks`.
        options: the option families allowed (``"keep"`` first).
        machine: fake tensors or real, and the device's roofline (`Machine`).
        solving: the solver, the verification, the floors (`Solving`).
        repeat: timed rounds of every option's step on real tensors (medians kept).
        progress: called with a short message at each stage.
        compose: on fake tensors, compose the costs of identical blocks from short models.
        build: a rank's plan builds each run's model (NOTE [Planning a rank]).
    """

    step: Step
    optimizer: OptimizerLike = "adam"
    blocks: Any = None
    options: tuple[str, ...] = OPTIONS
    machine: Machine = Machine()
    solving: Solving = Solving()
    repeat: int = 3
    progress: Callable[[str], None] | None = None
    compose: bool = True
    build: Builder | None = None

    def say(self, message: str) -> None:
        """Report a stage to ``progress``."""
        if self.progress is not None:
            self.progress(message)

    def replace(self, **changes: Any) -> Settings:
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)
