"""The planner's solvers: pure functions over plain lists (layer 1: no torch).

By job: the options' vocabulary and `Choice`, the typed option, in ``_choice.py`` (NOTE
[Choices as values]); the cost model in ``_problem.py`` (NOTE [Plan cost model]:
`Problem`, `evaluate`, `BudgetError`); the exact dynamic program over blocks in order and
the floor bisected on it in ``_chain.py`` (`solve_chain`, `floor`); the solvers beyond the
chain in ``_graph.py`` (`solve_milp` over any block graph, `solve_savings` for a compiled
step, `min_cut_keep` inside a block); `solve`, which picks one, in ``_choose.py``. This
module only re-exports them.

Examples:
    >>> from remat.planner._solve import Problem, solve
    >>> p = Problem(kept=[[8, 2, 4, 0]] * 3, time=[[0, 3, 1, 4]] * 3, rebuilt=[8] * 3,
    ...             fixed=[0] * 3, output=[2] * 3, end=0)
    >>> solve(p, 20).choices
    ('keep', 'selective', 'keep')
"""

from remat.planner._solve._chain import _undominated as _undominated
from remat.planner._solve._chain import floor as floor
from remat.planner._solve._chain import solve_chain as solve_chain
from remat.planner._solve._choice import BLOCK_OPTIONS as BLOCK_OPTIONS
from remat.planner._solve._choice import CALL_FAMILIES as CALL_FAMILIES
from remat.planner._solve._choice import CHILDREN as CHILDREN
from remat.planner._solve._choice import FAMILIES as FAMILIES
from remat.planner._solve._choice import OPS as OPS
from remat.planner._solve._choice import OPTIONS as OPTIONS
from remat.planner._solve._choice import STAGED as STAGED
from remat.planner._solve._choice import STAGES as STAGES
from remat.planner._solve._choice import Choice as Choice
from remat.planner._solve._choose import is_chain as is_chain
from remat.planner._solve._choose import solve as solve
from remat.planner._solve._choose import solve_brute_force as solve_brute_force
from remat.planner._solve._graph import min_cut_keep as min_cut_keep
from remat.planner._solve._graph import solve_milp as solve_milp
from remat.planner._solve._graph import solve_savings as solve_savings
from remat.planner._solve._problem import KEEP as KEEP
from remat.planner._solve._problem import OUTPUT as OUTPUT
from remat.planner._solve._problem import RECOMPUTE as RECOMPUTE
from remat.planner._solve._problem import SELECTIVE as SELECTIVE
from remat.planner._solve._problem import BudgetError as BudgetError
from remat.planner._solve._problem import Problem as Problem
from remat.planner._solve._problem import Solution as Solution
from remat.planner._solve._problem import evaluate as evaluate
