"""Solvers beyond the chain (layer 1): the MILP over blocks whose outputs feed more than the
next block, the knapsack of a compiled step's separable savings, and the minimum cut of the
operator outputs a region keeps.

Examples:
    >>> from remat.planner._solve import min_cut_keep, solve_savings
    >>> solve_savings([[0, 4, 6], [0, 4, 6]], [[0, 1, 3], [0, 1, 3]], need=10)
    (1, 2)
    >>> min_cut_keep([4, 8, 2], [[], [0], [1]], required=[1, 2], banned=[0, 2])
    [0, 2]
"""

from __future__ import annotations

import math
import time as _time
from collections.abc import Sequence
from typing import Any

from remat.planner._solve._chain import infeasible
from remat.planner._solve._problem import OUTPUT, Problem, Solution, solution


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
        from scipy.sparse import lil_matrix  # noqa: F401 - needed by _milp_rows
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "remat.plan: the MILP solver for non-chain models needs scipy; "
            "pip install scipy (or remat[plan])"
        ) from err
    start = _time.perf_counter()
    n, k = problem.blocks, len(problem.options)
    x, z, u, nvar = _milp_variables(problem)
    cost = np.zeros(nvar)
    upper = np.ones(nvar)
    for (i, o), v in x.items():
        if problem.kept[i][o] is None:
            upper[v] = 0
        else:
            cost[v] = problem.time[i][o]
    for i, v in z.items():
        cost[v] = problem.extra_time(i)
    a, lo, hi, r = _milp_rows(problem, budget, x, z, u, nvar)
    if problem.base > budget:
        raise infeasible(problem, budget)
    result = milp(cost, constraints=LinearConstraint(a.tocsr()[:r], lo[:r], hi[:r]),
                  integrality=np.ones(nvar), bounds=Bounds(np.zeros(nvar), upper),
                  options={"time_limit": time_limit})
    if result.x is None:
        raise infeasible(problem, budget)
    choice = tuple(max(range(k), key=lambda o, i=i: result.x[x[i, o]]) for i in range(n))
    return solution(problem, choice, "MILP (HiGHS)", start)


def _milp_variables(problem: Problem) -> tuple[dict, dict, dict, int]:
    """The MILP's variables' numbers ``(x, z, u, count)``, as `solve_milp` names them: ``z[i]``
    where blocks ``i`` and ``i + 1`` may both be ``output``, ``u[j, i]`` where ``j..i-1`` may."""
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
    return x, z, u, nvar


def _milp_rows(problem: Problem, budget: float, x: dict, z: dict, u: dict,
               nvar: int) -> tuple[Any, Any, Any, int]:
    """The MILP's constraints ``(matrix, lower, upper, rows used)``: one option per block, each
    memory moment within ``budget``, and ``z`` and ``u`` tied to the ``output`` choices."""
    import numpy as np
    from scipy.sparse import lil_matrix

    n, k = problem.blocks, len(problem.options)
    rows = n + n + 2 + len(z) + len(u)
    a = lil_matrix((rows, nvar))
    lo, hi = np.full(rows, -np.inf), np.zeros(rows)
    r = 0
    for i in range(n):  # one option each
        for o in range(k):
            a[r, x[i, o]] = 1
        lo[r] = hi[r] = 1
        r += 1
    r = _moment_rows(problem, budget, x, u, a, hi, r)
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
    return a, lo, hi, r


def _moment_rows(problem: Problem, budget: float, x: dict, u: dict, a: Any, hi: Any, r: int) -> int:
    """Write the rows of the memory moments into ``a`` and ``hi`` from row ``r``; return the
    next row."""
    n, k = problem.blocks, len(problem.options)
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
    return r


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
    capacity = _cut_graph(weights, inputs, required, banned)
    source, sink = 2 * n, 2 * n + 1
    _max_flow(capacity, source, sink)
    reaches = _sink_side(capacity, sink)
    return [i for i in range(n) if 2 * i not in reaches and 2 * i + 1 in reaches]


def _cut_graph(weights: Sequence[int], inputs: Sequence[Sequence[int]], required: Sequence[int],
               banned: Sequence[int]) -> list[dict[int, int]]:
    """The capacities of `min_cut_keep`'s graph: node ``i`` split in ``2i`` (in) and ``2i + 1``
    (out), the source ``2n``, the sink ``2n + 1``."""
    n = len(weights)
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
    return capacity


def _max_flow(capacity: list[dict[int, int]], source: int, sink: int) -> None:
    """Push a maximum flow from ``source`` to ``sink``, leaving ``capacity`` the residual graph
    (Edmonds-Karp: shortest augmenting paths)."""
    while True:
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
            return
        path, b = [], sink
        while b != source:
            path.append((parent[b], b))
            b = parent[b]
        pushed = min(capacity[a][b] for a, b in path)
        for a, b in path:
            capacity[a][b] -= pushed
            capacity[b][a] += pushed


def _sink_side(capacity: list[dict[int, int]], sink: int) -> set[int]:
    """The sink's side of the cut: every vertex with a residual path to the sink."""
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
    return reaches
