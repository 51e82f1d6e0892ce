"""The exact dynamic program over blocks in order, and the floor bisected on it (layer 1).

The cost model is NOTE [Plan cost model] in ``_problem.py``. `solve_chain` keeps, after each
block, the least time of every state (bytes kept, bytes of the ``output`` chain ending
there, whether the block is ``output``) that no other state beats; `floor`, the smallest
peak any plan reaches, bisects on the same program with every time zero, and `infeasible`
is the `BudgetError` every solver raises below it.

Examples:
    >>> from remat.planner._solve import Problem, floor, solve_chain
    >>> p = Problem(kept=[[8, 2, 4, 0]] * 3, time=[[0, 3, 1, 4]] * 3, rebuilt=[8] * 3,
    ...             fixed=[0] * 3, output=[2] * 3, end=0)
    >>> solve_chain(p, 20).choices, floor(p)
    (('keep', 'selective', 'keep'), 10.5)
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import math
import time as _time
from collections.abc import Callable, Iterator
from dataclasses import replace

from remat.planner._solve._problem import (
    KEEP,
    OUTPUT,
    BudgetError,
    Problem,
    Solution,
    evaluate,
    solution,
)


def solve_chain(problem: Problem, budget: float, *, resolution: float = 1.0) -> Solution:
    """Exact dynamic program over blocks in order, on memory rounded up to ``resolution`` bytes.

    The state after block ``i`` is (bytes kept so far, bytes of the ``output`` chain
    ending at ``i``, whether ``i`` is ``output``); for each state the least time is
    kept, and states another beats on all three counts are dropped. Rounding up makes
    every plan found fit the budget exactly; with ``resolution=1`` and integer bytes
    the answer is the optimum of the cost model.
    """
    start = _time.perf_counter()
    choice = _dp(problem, budget, resolution)
    if choice is None:
        raise infeasible(problem, budget)
    return solution(problem, choice, "dynamic program", start)


def _dp(problem: Problem, budget: float, resolution: float) -> tuple[int, ...] | None:
    with _no_collection():
        if resolution <= 1:
            return _dp_rounded(problem, budget, 1.0, math.ceil)
        # Bytes rounded to the nearest step keep the plans at the budget's edge (an exact
        # check of the peak follows); rounded up, every plan found fits (the fallback).
        return (_dp_rounded(problem, budget, resolution, round)
                or _dp_rounded(problem, budget, resolution, math.ceil))


@contextlib.contextmanager
def _no_collection() -> Iterator[None]:
    """The dynamic program makes many small tuples and no cycles: the garbage collector,
    which would walk every object of the process (a traced model's too), waits."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _dp_rounded(problem: Problem, budget: float, resolution: float,
                rounding: Callable[[float], int]) -> tuple[int, ...] | None:
    """The dynamic program on bytes rounded by ``rounding`` to steps of ``resolution``: the
    choice of least time whose exact peak fits ``budget``, or None."""
    q = max(resolution, 1e-12)

    def up(x: float) -> int:
        return rounding(x / q - 1e-9)

    limit = budget / q + 1e-9
    if problem.base > budget:
        return None
    # state: (prefix, held, last_is_output) -> (time, back pointer)
    states: dict[tuple[int, int, bool], tuple[float, tuple | None]] = {(0, 0, False): (0.0, None)}
    for i in range(problem.blocks):
        # rounded to nearest, i + 2 terms may each be half a step low or high: let such
        # states through (the exact check at the end decides)
        room = limit if rounding is math.ceil else limit + (i + 2) / 2
        states = _pareto(_advance(problem, i, states, up, room))
        if not states:
            return None
    slack = 0 if rounding is math.ceil else (problem.blocks + 2) / 2
    return _best_final(problem, states, budget, up, limit + slack)


def _advance(problem: Problem, i: int, states: dict, up: Callable[[float], int], room: float) -> dict:
    """The states after block ``i`` from those before it: each state under each option of
    ``i`` whose memory moment stays within ``room``, at the least time per new state."""
    # per option: (option, memory moment without the prefix, bytes kept, seconds)
    moves = [(o, up(problem.fixed[i] + problem.rebuilt_of(i, o)), up(problem.kept[i][o]),
              problem.time[i][o]) for o in _undominated(problem, i)]
    held_last = up(problem.held_last(i - 1)) if i else 0
    carried = up(problem.output[i - 1]) if i else 0
    extra = problem.extra_time(i - 1) if i else 0.0
    nxt: dict[tuple[int, int, bool], tuple[float, tuple | None]] = {}
    for state, (spent, back) in states.items():
        prefix, held, last = state
        used = prefix + (held + held_last if last else 0)
        for o, moment, kept, seconds in moves:
            if moment + used > room:
                continue
            if o == OUTPUT:
                key = (prefix + kept, held + carried if last else 0, True)
                cost = spent + seconds + (extra if last else 0.0)
            else:
                key = (prefix + kept, 0, False)
                cost = spent + seconds
            old = nxt.get(key)
            if old is None or cost < old[0]:
                nxt[key] = (cost, (o, state, back))
    return nxt


def _best_final(problem: Problem, states: dict, budget: float, up: Callable[[float], int],
                room: float) -> tuple[int, ...] | None:
    """Of the states after the last block whose end of forward and last backward fit
    ``room``, the choice of least time, then least peak, whose exact peak fits ``budget``."""
    end = up(problem.end)
    after = end if problem.tail is None else up(problem.tail)
    tail = up(problem.held_last(problem.blocks - 1)) if problem.blocks else 0
    finals = [(t, key, back) for key, (t, back) in states.items()
              if end + key[0] <= room
              and after + key[0] + (key[1] + tail if key[2] else 0) <= room]
    if not finals:
        return None
    best: tuple | None = None  # (time, peak, choice): least time, then least peak, that fits
    for t, _, back in sorted(finals, key=lambda f: f[0]):
        if best is not None and t > best[0] * (1 + 1e-12) + 1e-15:
            break
        choice = _unwind(back)
        peak, total = evaluate(problem, choice)
        if peak <= budget and (best is None or (total, peak) < best[:2]):
            best = (total, peak, choice)
    return None if best is None else best[2]


def _undominated(problem: Problem, i: int) -> list[int]:
    """Options of block ``i`` that no other option beats or ties on bytes kept, bytes held in
    its backward and time (``output`` aside: its chain holds more): a plan with a dominated
    option is no better than the same plan with the option that dominates it."""
    allowed = problem.allowed(i)

    def costs(o: int) -> tuple:
        return (problem.kept[i][o], problem.rebuilt_of(i, o), problem.time[i][o])

    def beats(a: int, b: int) -> bool:
        ca, cb = costs(a), costs(b)
        return all(x <= y for x, y in zip(ca, cb)) and (ca != cb or a < b)

    return [o for o in allowed
            if o == OUTPUT or not any(beats(p, o) for p in allowed if p != o and p != OUTPUT)]


def _pareto(states: dict) -> dict:
    """Drop states that another beats or ties on prefix, held bytes and time (same last flag)."""
    out = {}
    for last in (False, True):
        group = sorted(((t, key[0], key[1], key, back) for key, (t, back) in states.items()
                        if key[2] == last), key=lambda g: (g[0], g[1], g[2]))
        # staircase of (prefix, held) seen so far: prefixes ascending, held strictly descending
        prefixes: list[int] = []
        helds: list[int] = []
        for t, prefix, held, key, back in group:
            k = bisect.bisect_right(prefixes, prefix)
            if k and helds[k - 1] <= held:
                continue
            out[key] = (t, back)
            end = k
            while end < len(prefixes) and helds[end] >= held:
                end += 1
            prefixes[k:end] = [prefix]
            helds[k:end] = [held]
    return out


def _unwind(back: tuple | None) -> tuple[int, ...]:
    choice = []
    while back is not None:
        option, _, back = back
        choice.append(option)
    return tuple(reversed(choice))


def floor(problem: Problem) -> float:
    """The smallest predicted peak any plan reaches (bisection on the dynamic program).

    Whether a plan fits does not depend on time: the bisection runs the dynamic program
    on the problem with every time zero, where a state is dropped as soon as another
    keeps and holds no more bytes (no time to tell them apart), so few states remain."""
    n, k = problem.blocks, len(problem.options)
    untimed = replace(problem, time=[[0.0] * k for _ in range(n)], chain_time=[0.0] * n)
    return _floor(untimed)


def _floor(problem: Problem) -> float:
    keep = evaluate(problem, [KEEP] * problem.blocks)[0]
    high = max(keep, *(evaluate(problem, [o if problem.kept[i][o] is not None else KEEP
                                          for i in range(problem.blocks)])[0]
                       for o in range(len(problem.options))))
    low = 0.0
    resolution = max(1.0, high / 2 ** 20)
    while high - low > resolution:
        mid = (low + high) / 2
        if _dp(problem, mid, resolution) is None:
            low = mid
        else:
            high = mid
    return high


def infeasible(problem: Problem, budget: float) -> BudgetError:
    """The error of a ``budget`` below the problem's `floor`: what it is, and the fix."""
    least = floor(problem)
    return BudgetError(
        f"remat.plan: no plan fits a budget of {budget:,.0f} bytes; the smallest reachable "
        f"predicted peak is {least:,.0f} bytes; raise the budget to at least that (or shrink the batch)",
        budget_bytes=budget, floor_bytes=least,
    )
