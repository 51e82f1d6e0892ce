"""The planner's solvers: pure functions over plain lists (layer 1: no torch).

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
    >>> from remat.planner._solve import Problem, solve
    >>> p = Problem(kept=[[8, 2, 4, 0]] * 3, time=[[0, 3, 1, 4]] * 3, rebuilt=[8] * 3,
    ...             fixed=[0] * 3, output=[2] * 3, end=0)
    >>> solve(p, 20).choices
    ('keep', 'selective', 'keep')
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import itertools
import math
import time as _time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

#: the options that mark a whole block: the first four columns of every `Problem`
BLOCK_OPTIONS = ("keep", "recompute", "selective", "output")
KEEP, RECOMPUTE, SELECTIVE, OUTPUT = range(4)
#: the family of options that mark children of a block, named ``"children:<child>+<child>"``
CHILDREN = "children"
#: the family of per-operator options: the block marked with a policy keeping the outputs of
#: the operator calls named, ``"ops:aten::addmm#3+aten::bmm#0"`` (NOTE [Options per operator])
OPS = "ops"
#: the option families a plan may use (``remat.plan(options=...)``)
OPTIONS = (*BLOCK_OPTIONS, CHILDREN, OPS)


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


def solve_brute_force(problem: Problem, budget: float) -> Solution:
    """The reference: try every combination (tiny problems only); least time, then least peak."""
    start = _time.perf_counter()
    best: tuple[float, float, tuple] | None = None
    for choice in itertools.product(*(problem.allowed(i) for i in range(problem.blocks))):
        peak, total = evaluate(problem, choice)
        if peak <= budget and (best is None or (total, peak) < best[:2]):
            best = (total, peak, choice)
    if best is None:
        raise _infeasible(problem, budget)
    return _solution(problem, best[2], "brute force", start)


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
        raise _infeasible(problem, budget)
    return _solution(problem, choice, "dynamic program", start)


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
    q = max(resolution, 1e-12)

    def up(x: float) -> int:
        return rounding(x / q - 1e-9)

    limit = budget / q + 1e-9
    if problem.base > budget:
        return None
    # state: (prefix, held, last_is_output) -> (time, back pointer)
    states: dict[tuple[int, int, bool], tuple[float, tuple | None]] = {(0, 0, False): (0.0, None)}
    for i in range(problem.blocks):
        # per option: (option, memory moment without the prefix, bytes kept, seconds)
        moves = [(o, up(problem.fixed[i] + problem.rebuilt_of(i, o)), up(problem.kept[i][o]),
                  problem.time[i][o]) for o in _undominated(problem, i)]
        held_last = up(problem.held_last(i - 1)) if i else 0
        carried = up(problem.output[i - 1]) if i else 0
        extra = problem.extra_time(i - 1) if i else 0.0
        # rounded to nearest, i + 2 terms may each be half a step low or high: let such
        # states through (the exact check at the end decides)
        room = limit if rounding is math.ceil else limit + (i + 2) / 2
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
        states = _pareto(nxt)
        if not states:
            return None
    end = up(problem.end)
    after = end if problem.tail is None else up(problem.tail)
    tail = up(problem.held_last(problem.blocks - 1)) if problem.blocks else 0
    slack = 0 if rounding is math.ceil else (problem.blocks + 2) / 2
    finals = [(t, key, back) for key, (t, back) in states.items()
              if end + key[0] <= limit + slack
              and after + key[0] + (key[1] + tail if key[2] else 0) <= limit + slack]
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


def solve_milp(problem: Problem, budget: float, *, time_limit: float = 10.0) -> Solution:
    """Mixed-integer program (``scipy.optimize.milp``, HiGHS) over the same cost model.

    Variables: ``x[i][o]`` (block ``i`` takes option ``o``), ``z[i]`` (``output`` blocks
    ``i`` and ``i + 1``: the extra run) and ``u[j][i]`` (blocks ``j..i-1`` all ``output``:
    their outputs are held in block ``i``'s backward).

    Raises:
        ImportError: scipy is not installed (``pip install 'remat[plan]'``).
    """
    try:
        import numpy as np
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import lil_matrix
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "remat.plan: the MILP solver for non-chain models needs scipy; "
            "pip install scipy (or remat[plan])"
        ) from err
    start = _time.perf_counter()
    n, k = problem.blocks, len(problem.options)
    x = {(i, o): i * k + o for i in range(n) for o in range(k)}
    nvar = n * k
    z = {}
    for i in range(n - 1):
        if problem.kept[i][OUTPUT] is not None and problem.kept[i + 1][OUTPUT] is not None:
            z[i] = nvar
            nvar += 1
    u = {}
    for i in range(1, n + 1):
        for j in range(i - 1, -1, -1):
            if problem.kept[j][OUTPUT] is None:
                break
            u[(j, i)] = nvar
            nvar += 1
    cost = np.zeros(nvar)
    upper = np.ones(nvar)
    for (i, o), v in x.items():
        if problem.kept[i][o] is None:
            upper[v] = 0
        else:
            cost[v] = problem.time[i][o]
    for i, v in z.items():
        cost[v] = problem.extra_time(i)
    rows = n + n + 2 + len(z) + len(u)
    a = lil_matrix((rows, nvar))
    lo, hi = np.full(rows, -np.inf), np.zeros(rows)
    r = 0
    for i in range(n):  # one option each
        for o in range(k):
            a[r, x[i, o]] = 1
        lo[r] = hi[r] = 1
        r += 1
    # the memory moments: each block's backward, the end of forward, the backward after
    # the last block (without a tail, the last two are one)
    moments = [*range(n + 1)] + ([n + 1] if problem.tail is not None else [])
    for m in moments:
        i = min(m, n)
        for j in range(i):
            for o in range(k):
                if problem.kept[j][o] is not None:
                    a[r, x[j, o]] = problem.kept[j][o]
        if m != n or problem.tail is None:
            for j in range(i):
                if (j, i) in u:
                    a[r, u[j, i]] = problem.held_last(j) if j == i - 1 else problem.output[j]
        if i < n:
            for o in problem.allowed(i):
                a[r, x[i, o]] += problem.rebuilt_of(i, o)
        hi[r] = budget - (problem.fixed[i] if m < n else problem.end if m == n else problem.tail)
        r += 1
    for i, v in z.items():  # z >= x_i + x_{i+1} - 1
        a[r, x[i, OUTPUT]] = a[r, x[i + 1, OUTPUT]] = 1
        a[r, v] = -1
        hi[r] = 1
        r += 1
    for (j, i), v in u.items():  # u >= sum x_{j..i-1} - (i-j-1)
        for m in range(j, i):
            a[r, x[m, OUTPUT]] = 1
        a[r, v] = -1
        hi[r] = i - j - 1
        r += 1
    if problem.base > budget:
        raise _infeasible(problem, budget)
    result = milp(cost, constraints=LinearConstraint(a.tocsr()[:r], lo[:r], hi[:r]),
                  integrality=np.ones(nvar), bounds=Bounds(np.zeros(nvar), upper),
                  options={"time_limit": time_limit})
    if result.x is None:
        raise _infeasible(problem, budget)
    choice = tuple(max(range(k), key=lambda o, i=i: result.x[x[i, o]]) for i in range(n))
    return _solution(problem, choice, "MILP (HiGHS)", start)


def is_chain(problem: Problem) -> bool:
    """True when every block allows ``output`` but perhaps the last (a plain chain)."""
    return all(problem.kept[i][OUTPUT] is not None for i in range(problem.blocks - 1))


def solve(problem: Problem, budget: float, *, resolution: float = 1.0,
          solver: str = "auto") -> Solution:
    """Least extra time with a predicted peak within ``budget``.

    Args:
        problem: the costs.
        budget: peak bytes allowed.
        resolution: memory granularity of the dynamic program, in bytes.
        solver: ``"auto"`` (the dynamic program for chains, the MILP for other graphs),
            ``"dp"`` (also exact on graphs: the cost model orders blocks), ``"milp"`` or ``"brute"``.

    Raises:
        BudgetError: no plan fits; ``floor_bytes`` is the smallest peak reachable.
    """
    if solver == "dp" or (solver == "auto" and is_chain(problem)):
        return solve_chain(problem, budget, resolution=resolution)
    if solver in ("auto", "milp"):
        return solve_milp(problem, budget)
    if solver == "brute":
        return solve_brute_force(problem, budget)
    raise ValueError(f"remat.plan: solver must be 'auto', 'dp', 'milp' or 'brute', got {solver!r}")


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


def _infeasible(problem: Problem, budget: float) -> BudgetError:
    least = floor(problem)
    return BudgetError(
        f"remat.plan: no plan fits a budget of {budget:,.0f} bytes; the smallest reachable "
        f"predicted peak is {least:,.0f} bytes; raise the budget to at least that (or shrink the batch)",
        budget_bytes=budget, floor_bytes=least,
    )


def _solution(problem: Problem, choice: Sequence[int], solver: str, start: float) -> Solution:
    peak, total = evaluate(problem, choice)
    return Solution(tuple(problem.options[c] for c in choice), peak, total, solver,
                    _time.perf_counter() - start)


def solve_savings(saving: Sequence[Sequence[float | None]], time: Sequence[Sequence[float]],
                  need: float, *, resolution: float | None = None,
                  exclude: Sequence[Sequence[int]] = ()) -> tuple[int, ...] | None:
    """The choice of least total time whose savings add up to at least ``need`` bytes: the
    separable cost model of a compiled step (NOTE [Planning a compiled step] in ``_compiled.py``).

    Block ``i`` under option ``o`` saves ``saving[i][o]`` bytes of the step's peak (None: not
    allowed) for ``time[i][o]`` seconds. A multiple-choice knapsack, solved exactly by a dynamic
    program over the savings rounded down to ``resolution`` (so a choice it returns saves at
    least ``need`` exactly); ties go to the choice with the lower option numbers (``keep``
    first), so equal costs give one plan. ``exclude``: choices not to return (those measured
    over their budget).

    Returns:
        One option number per block, or None when no choice saves ``need``.

    Examples:
        >>> solve_savings([[0, 4, 6], [0, 4, 6]], [[0, 1, 3], [0, 1, 3]], need=8)
        (1, 1)
        >>> solve_savings([[0, 4, 6], [0, 4, 6]], [[0, 1, 3], [0, 1, 3]], need=10)
        (1, 2)
        >>> solve_savings([[0, 4]], [[0, 1]], need=5) is None
        True
    """
    n = len(saving)
    if need <= 0:
        choice = tuple(0 for _ in range(n))
        if choice not in set(map(tuple, exclude)):
            return choice
    banned = {tuple(c) for c in exclude}
    unit = resolution or max(1.0, need / 4096)
    cap = max(0, math.ceil(need / unit))
    # states[c]: the best few (time, choice) reaching at least c units (c clamped at cap);
    # several per state, so a banned choice leaves the next best
    keep_best = len(banned) + 1
    states: dict[int, list[tuple[float, tuple[int, ...]]]] = {0: [(0.0, ())]}
    for i in range(n):
        nxt: dict[int, list[tuple[float, tuple[int, ...]]]] = {}
        for c, entries in states.items():
            for o, s in enumerate(saving[i]):
                if s is None:
                    continue
                units = math.floor(s / unit) if s >= 0 else -math.ceil(-s / unit)
                k = min(cap, c + units)
                bucket = nxt.setdefault(k, [])
                for t, choice in entries:
                    bucket.append((t + time[i][o], (*choice, o)))
        states = {k: sorted(v)[:keep_best] for k, v in nxt.items()}
    reached = sorted(e for k, v in states.items() if k >= cap for e in v)
    for _, choice in reached:
        if choice not in banned:
            return choice
    return None


def min_cut_keep(weights: Sequence[int], inputs: Sequence[Sequence[int]], required: Sequence[int],
                 banned: Sequence[int]) -> list[int]:
    """The operator outputs a region keeps so that backward can rebuild the rest by
    re-running only operators it may re-run, with the fewest bytes kept (NOTE [Options cut
    by min-cut] in ``_options.py``).

    Node ``i`` is one operator call of the region, in forward order: ``weights[i]`` the bytes
    of its output, ``inputs[i]`` the earlier nodes whose outputs it reads (values made outside
    the region are always at hand: the region keeps its inputs). ``required`` are the nodes
    whose outputs backward reads; ``banned`` those backward may not re-run (a matrix product,
    a reduction): needed, they are kept. Each node is split in two joined by an edge of its
    weight; the source feeds the banned, the required feed the sink, and each read is an
    edge of unbounded capacity. A minimum cut's split edges are the nodes kept; of the
    minimum cuts, the one nearest the sink (the least re-run when two cost the same bytes).

    Args:
        weights: bytes of each node's output.
        inputs: per node, the indices of the nodes it reads (each smaller than its own).
        required: nodes whose outputs backward reads.
        banned: nodes backward may not re-run.

    Returns:
        The indices of the kept nodes, ascending.

    Examples:
        >>> # a matrix product (0) feeds a cheap operator (1) whose output backward reads,
        >>> # and so does another product's (2): keep 0 (4 bytes), not 1 (8 bytes); keep 2
        >>> min_cut_keep([4, 8, 2], [[], [0], [1]], required=[1, 2], banned=[0, 2])
        [0, 2]
    """
    n = len(weights)
    if len(inputs) != n:
        raise ValueError(f"min_cut_keep: {n} weights but {len(inputs)} input lists")
    for i, reads in enumerate(inputs):
        if any(not 0 <= j < i for j in reads):
            raise ValueError(f"min_cut_keep: node {i} reads {list(reads)}; a node reads earlier ones only")
    infinite = sum(int(w) for w in weights) + 1
    source, sink = 2 * n, 2 * n + 1
    capacity: list[dict[int, int]] = [{} for _ in range(2 * n + 2)]

    def edge(a: int, b: int, c: int) -> None:
        capacity[a][b] = capacity[a].get(b, 0) + c
        capacity[b].setdefault(a, 0)

    for i in range(n):
        edge(2 * i, 2 * i + 1, int(weights[i]))  # in(i) -> out(i): keeping i
        for j in inputs[i]:
            edge(2 * j + 1, 2 * i, infinite)
    for i in set(banned):
        edge(source, 2 * i, infinite)
    for i in set(required):
        edge(2 * i + 1, sink, infinite)
    while True:  # Edmonds-Karp: shortest augmenting paths
        parent = {source: source}
        frontier = [source]
        while frontier and sink not in parent:
            following = []
            for a in frontier:
                for b, c in capacity[a].items():
                    if c > 0 and b not in parent:
                        parent[b] = a
                        following.append(b)
            frontier = following
        if sink not in parent:
            break
        path, b = [], sink
        while b != source:
            path.append((parent[b], b))
            b = parent[b]
        pushed = min(capacity[a][b] for a, b in path)
        for a, b in path:
            capacity[a][b] -= pushed
            capacity[b][a] += pushed
    # the sink's side: every vertex with a residual path to the sink
    reaches = {sink}
    frontier = [sink]
    while frontier:
        following = []
        for b in frontier:
            for a in capacity[b]:  # a -> b has residual capacity
                if a not in reaches and capacity[a].get(b, 0) > 0:
                    reaches.add(a)
                    following.append(a)
        frontier = following
    return [i for i in range(n) if 2 * i not in reaches and 2 * i + 1 in reaches]
