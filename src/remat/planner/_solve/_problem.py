"""The planner's cost model: blocks, options and the peak they make (layer 1: no torch).

NOTE [Plan cost model]
Blocks ``0..n-1`` run in forward order; each takes one option: ``keep`` (no
mark), ``recompute`` (a cell mark: inputs and output kept, internals rebuilt),
``selective`` (a cell mark with ``save_compute_intensive``) or ``output``
(``output_recompute``: not even the output kept; adjacent ones merge into a chain).

A step's peak is the largest of these moments (bytes):

* block ``i``'s backward: ``fixed[i] + sum(kept[j][c_j] for j < i) + rebuilt[i] + held(i)``;
  ``fixed[i]`` is what no block choice changes (parameters, optimizer state,
  gradients already made), ``rebuilt[i]`` what the block's own backward holds
  (its activations, rebuilt or kept, and its gradient temporaries), ``held(i)``
  the outputs of the ``output`` chain that ends just before ``i``, rebuilt together;
* the end of forward: ``end + sum(kept[j][c_j])``;
* the backward of what follows the last block (a head, a loss): ``tail + sum(kept[j][c_j])
  + held(n)``, ``held(n)`` the outputs of an ``output`` chain ending at the last block,
  rebuilt there (``tail`` None: the end of forward holds them, ``end + ... + held(n)``).

The extra time is ``sum(time[i][c_i])`` plus ``chain_time[i]`` for each ``output``
block followed by another ``output`` block (it runs once more to hand its output on).
An option that is not allowed has ``kept`` None (``output`` where a block's output
feeds more than the next block).

Options past the first four recompute parts of a block (the ``children`` family,
``"children:attn"``, ``"children:fc+gelu"``: NOTE [Options inside blocks] in ``_options.py``)
or keep some of its operators' outputs (the ``ops`` family, ``"ops:aten::addmm#3"``: NOTE
[Options per operator]);
to the solvers they are columns like ``recompute``: bytes kept, bytes held in the
block's backward, extra time. ``Problem.options`` names the columns; a block without
the children of a column has ``kept`` None there.

Examples:
    >>> from remat.planner._solve import Problem, evaluate
    >>> p = Problem(kept=[[8, 2, 4, 0]] * 3, time=[[0, 3, 1, 4]] * 3, rebuilt=[8] * 3,
    ...             fixed=[0] * 3, output=[2] * 3, end=0)
    >>> evaluate(p, [0, 2, 0])
    (20.0, 1.0)
"""

from __future__ import annotations

import math
import time as _time
from collections.abc import Sequence
from dataclasses import dataclass

from remat.planner._solve._choice import BLOCK_OPTIONS

KEEP, RECOMPUTE, SELECTIVE, OUTPUT = range(4)  #: the columns of `BLOCK_OPTIONS`


class BudgetError(ValueError):
    """No plan fits the memory budget: it is below the smallest reachable peak.

    Attributes:
        budget_bytes: the budget asked for.
        floor_bytes: the smallest peak any plan reaches.

    Examples:
        >>> import remat
        >>> err = remat.BudgetError("too small", budget_bytes=10, floor_bytes=20)
        >>> isinstance(err, ValueError), err.floor_bytes
        (True, 20)
    """

    __module__ = "remat"  # printed by its public name, remat.BudgetError

    def __init__(self, message: str, *, budget_bytes: float, floor_bytes: float) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.floor_bytes = floor_bytes


@dataclass(frozen=True)
class Problem:
    """One planning problem (NOTE [Plan cost model]); lists indexed by block, then option.

    Args:
        kept: ``kept[i][o]`` bytes block ``i`` keeps under option ``o`` (None: not allowed).
        time: ``time[i][o]`` extra seconds option ``o`` costs block ``i``.
        rebuilt: bytes block ``i``'s backward holds on top of what earlier blocks keep
            (one number, or one per option: ``rebuilt[i][o]``).
        fixed: bytes alive during block ``i``'s backward that no choice changes.
        output: bytes of block ``i``'s output (held while an ``output`` chain is rebuilt).
        end: bytes alive at the end of forward besides what the blocks keep.
        chain_time: extra seconds of an ``output`` block followed by another (default: ``time[i][3]``).
        base: a peak no choice changes (e.g. the optimizer step's).
        last_held: bytes the last ``output`` block of a chain holds while the next block's
            backward rebuilds it: it is re-run whole (default: ``output[i]``).
        tail: bytes alive besides the blocks' in the backward of what follows the last
            block, where a chain ending at the last block is rebuilt (None: at the end of forward).
        options: the name of each column of ``kept`` and ``time``: `BLOCK_OPTIONS`, then
            options inside blocks (``"children:attn"``).
    """

    kept: Sequence[Sequence[float | None]]
    time: Sequence[Sequence[float]]
    rebuilt: Sequence[float | Sequence[float]]
    fixed: Sequence[float]
    output: Sequence[float]
    end: float
    chain_time: Sequence[float] | None = None
    base: float = 0.0
    last_held: Sequence[float] | None = None
    tail: float | None = None
    options: Sequence[str] = BLOCK_OPTIONS

    def __post_init__(self) -> None:
        n = len(self.kept)
        for name in ("time", "rebuilt", "fixed", "output"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"remat.plan: Problem.{name} has {len(getattr(self, name))} "
                                 f"entries for {n} blocks")
        if tuple(self.options[:len(BLOCK_OPTIONS)]) != BLOCK_OPTIONS:
            raise ValueError(f"remat.plan: Problem.options must start with {BLOCK_OPTIONS}, "
                             f"got {tuple(self.options)}")
        k = len(self.options)
        short = [i for i in range(n) if len(self.kept[i]) != k or len(self.time[i]) != k]
        if short:
            raise ValueError(f"remat.plan: block {short[0]} of the Problem has {len(self.kept[short[0]])} "
                             f"kept and {len(self.time[short[0]])} time entries for {k} options")
        if any(k[KEEP] is None for k in self.kept):
            raise ValueError("remat.plan: every block must allow 'keep'")

    @property
    def blocks(self) -> int:
        """Number of blocks."""
        return len(self.kept)

    def extra_time(self, i: int) -> float:
        """Seconds an ``output`` block ``i`` costs when the next block is ``output`` too."""
        return self.time[i][OUTPUT] if self.chain_time is None else self.chain_time[i]

    def held_last(self, i: int) -> float:
        """Bytes ``output`` block ``i`` holds while the block after it runs backward."""
        return self.output[i] if self.last_held is None else self.last_held[i]

    def rebuilt_of(self, i: int, o: int) -> float:
        """Bytes block ``i``'s backward holds under option ``o``."""
        r = self.rebuilt[i]
        return r if isinstance(r, (int, float)) else r[o]

    def allowed(self, i: int) -> list[int]:
        """Options block ``i`` may take."""
        return [o for o in range(len(self.options)) if self.kept[i][o] is not None]

    def last_moment(self, kept: float, chain: float) -> float:
        """The end of forward and the backward after the last block, with ``kept`` bytes
        kept by the blocks and ``chain`` bytes of a final ``output`` chain rebuilt."""
        if self.tail is None:
            return self.end + kept + chain
        return max(self.end + kept, self.tail + kept + chain)


@dataclass(frozen=True)
class Solution:
    """The options chosen, with their predicted peak and extra time."""

    choices: tuple[str, ...]
    peak: float
    time: float
    solver: str
    seconds: float = 0.0


def evaluate(problem: Problem, choice: Sequence[int]) -> tuple[float, float]:
    """Return ``(peak bytes, extra seconds)`` of option indices ``choice`` (NOTE [Plan cost model])."""
    prefix = held = 0.0  # held: outputs of the chain's blocks before the last
    peak = -math.inf
    total = 0.0
    for i, c in enumerate(choice):
        if problem.kept[i][c] is None:
            return math.inf, math.inf
        last = i > 0 and choice[i - 1] == OUTPUT
        chain = held + problem.held_last(i - 1) if last else 0.0
        peak = max(peak, problem.fixed[i] + prefix + problem.rebuilt_of(i, c) + chain)
        total += problem.time[i][c]
        if c == OUTPUT and last:
            total += problem.extra_time(i - 1)
        prefix += problem.kept[i][c]
        held = (held + problem.output[i - 1] if last else 0.0) if c == OUTPUT else 0.0
    n = len(choice)
    chain = held + problem.held_last(n - 1) if n and choice[-1] == OUTPUT else 0.0
    peak = max(peak, problem.last_moment(prefix, chain), problem.base)
    return peak, total


def solution(problem: Problem, choice: Sequence[int], solver: str, start: float) -> Solution:
    """The `Solution` of option indices ``choice``, timed from ``start`` (``perf_counter``)."""
    peak, total = evaluate(problem, choice)
    return Solution(tuple(problem.options[c] for c in choice), peak, total, solver,
                    _time.perf_counter() - start)
