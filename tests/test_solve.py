"""The planner's solvers against the brute-force reference on random small problems (no torch)."""

from __future__ import annotations

import itertools
import random

import pytest

from remat.planner._solve import (
    BLOCK_OPTIONS,
    KEEP,
    OUTPUT,
    BudgetError,
    Problem,
    evaluate,
    floor,
    min_cut_keep,
    solve,
    solve_brute_force,
    solve_chain,
    solve_milp,
)

CHILD_OPTIONS = ("children:attn", "children:mlp", "children:attn+mlp")


def random_problem(rng: random.Random, n: int, *, chain: bool = True, children: int = 0) -> Problem:
    """Blocks with the four block options and ``children`` options inside blocks: each keeps
    something between ``recompute`` and ``keep``, costs part of a re-run, and holds its own
    bytes in backward (the block's activations, less or more); a block may lack some."""
    kept, time, rebuilt, output = [], [], [], []
    for i in range(n):
        act = rng.randint(4, 40)
        out = rng.randint(1, 8)
        t = rng.randint(1, 20)
        allow_output = chain or rng.random() < 0.5 or i == n - 1
        kept.append([act + out, out + rng.randint(0, 3), out + rng.randint(0, act // 2),
                     rng.randint(0, 2) if allow_output else None])
        time.append([0, t, rng.randint(0, t), t])
        held = act + out + rng.randint(0, 10)
        rebuilt.append([held, held, held, held])
        for _ in range(children):
            has = rng.random() < 0.8
            kept[-1].append(out + rng.randint(0, act) if has else None)
            time[-1].append(rng.randint(0, t))
            rebuilt[-1].append(held + rng.randint(-act // 2, 5))
        output.append(out)
    fixed = [rng.randint(0, 30) for _ in range(n)]
    return Problem(kept=kept, time=time, rebuilt=rebuilt, fixed=fixed, output=output,
                   end=rng.randint(0, 20), chain_time=[rng.randint(1, 20) for _ in range(n)],
                   last_held=[o + rng.randint(0, 10) for o in output],
                   tail=rng.choice([None, rng.randint(0, 20)]),
                   options=(*BLOCK_OPTIONS, *CHILD_OPTIONS[:children]))


def budgets(problem: Problem, rng: random.Random, count: int = 4) -> list[float]:
    low = floor(problem)
    high = evaluate(problem, [KEEP] * problem.blocks)[0]
    return [low, high, *(rng.uniform(low, high) for _ in range(count))]


@pytest.mark.parametrize("seed", range(12))
def test_dynamic_program_is_optimal_on_chains(seed):
    rng = random.Random(seed)
    problem = random_problem(rng, rng.randint(1, 6))
    for budget in budgets(problem, rng):
        exact = solve_brute_force(problem, budget)
        found = solve_chain(problem, budget)
        assert found.time == exact.time
        assert found.peak <= budget
        assert (found.peak, found.time) == evaluate(problem, [problem.options.index(c) for c in found.choices])


@pytest.mark.parametrize("seed", range(12))
def test_dynamic_program_is_optimal_with_options_inside_blocks(seed):
    rng = random.Random(200 + seed)
    problem = random_problem(rng, rng.randint(1, 5), children=rng.randint(1, 3))
    for budget in budgets(problem, rng):
        exact = solve_brute_force(problem, budget)
        found = solve_chain(problem, budget)
        assert found.time == exact.time and found.peak <= budget
        assert (found.peak, found.time) == evaluate(problem, [problem.options.index(c) for c in found.choices])
        assert all(problem.kept[i][problem.options.index(c)] is not None for i, c in enumerate(found.choices))


def test_the_random_instances_choose_options_inside_blocks():
    # the instances of the tests above exercise the new columns: many optima take one
    chosen = []
    for seed in range(12):
        rng = random.Random(200 + seed)
        problem = random_problem(rng, rng.randint(1, 5), children=rng.randint(1, 3))
        chosen += [c for b in budgets(problem, rng) for c in solve_chain(problem, b).choices]
    inside = [c for c in chosen if c.startswith("children:")]
    assert len(inside) >= len(chosen) // 10, (len(inside), len(chosen))


@pytest.mark.parametrize("seed", range(6))
def test_milp_is_optimal_with_options_inside_blocks(seed):
    pytest.importorskip("scipy")
    rng = random.Random(300 + seed)
    problem = random_problem(rng, rng.randint(2, 5), chain=False, children=3)
    for budget in budgets(problem, rng, 2):
        exact = solve_brute_force(problem, budget)
        found = solve_milp(problem, budget)
        assert found.time == pytest.approx(exact.time, abs=1e-6) and found.peak <= budget
        assert solve_chain(problem, budget).time == exact.time


def test_an_option_inside_blocks_is_chosen_where_it_beats_the_block_options():
    # recompute keeps 2 and costs 10; the attention child keeps 6, holds 14 in its block's
    # backward and costs 3. With the last block kept (20 in its backward), the first may keep
    # 6 at a budget of 26; at 22 the last block holds 14 at most; the floor is 6 + 14
    problem = Problem(kept=[[20, 2, 12, None, 6]] * 2, time=[[0, 10, 4, 10, 3]] * 2,
                      rebuilt=[[20, 20, 20, 20, 14]] * 2, fixed=[0, 0], output=[2, 2], end=0,
                      options=(*BLOCK_OPTIONS, "children:attn"))
    blocks_only = Problem(**{**problem.__dict__, "kept": [[20, 2, 12, None, None]] * 2})
    assert solve_chain(problem, 26).choices == ("children:attn", "keep")
    assert solve_brute_force(problem, 26).choices == ("children:attn", "keep")
    assert solve_milp(problem, 26).choices == ("children:attn", "keep")
    assert solve(blocks_only, 26).choices == ("recompute", "keep")
    assert solve(problem, 26).time == 3 < solve(blocks_only, 26).time == 10
    assert solve(problem, 22).choices == ("children:attn", "children:attn")
    assert floor(problem) == pytest.approx(20, abs=1) and floor(blocks_only) == pytest.approx(22, abs=1)


@pytest.mark.parametrize("seed", range(8))
def test_milp_is_optimal_on_graphs(seed):
    pytest.importorskip("scipy")
    rng = random.Random(100 + seed)
    problem = random_problem(rng, rng.randint(2, 6), chain=False)
    for budget in budgets(problem, rng, 2):
        exact = solve_brute_force(problem, budget)
        found = solve_milp(problem, budget)
        assert found.time == pytest.approx(exact.time, abs=1e-6)
        assert found.peak <= budget
        assert solve_chain(problem, budget).time == exact.time


def test_floor_is_the_least_peak_and_below_it_is_an_error():
    rng = random.Random(7)
    problem = random_problem(rng, 5)
    low = floor(problem)
    solve_brute_force(problem, low)
    with pytest.raises(BudgetError) as info:
        solve(problem, low - 1)
    assert info.value.floor_bytes == low
    assert f"{low:,.0f}" in str(info.value)
    with pytest.raises(BudgetError):
        solve_brute_force(problem, low - 1)


@pytest.mark.parametrize("seed", range(20))
def test_floor_is_the_least_peak_of_every_plan(seed):
    # floor() bisects on the untimed dynamic program: the least peak brute force finds
    rng = random.Random(100 + seed)
    problem = random_problem(rng, rng.randint(1, 6))
    least = min(evaluate(problem, c)[0] for c in itertools.product(
        *(problem.allowed(i) for i in range(problem.blocks))))
    assert floor(problem) == pytest.approx(least, abs=1)


def test_monotone_over_a_budget_sweep():
    rng = random.Random(3)
    problem = random_problem(rng, 6)
    low, high = floor(problem), evaluate(problem, [KEEP] * 6)[0]
    sweep = [high - (high - low) * k / 15 for k in range(16)]
    plans = [solve(problem, b) for b in sweep]
    assert [p.peak <= b for p, b in zip(plans, sweep, strict=True)] == [True] * 16
    assert all(a.peak >= b.peak and a.time <= b.time for a, b in itertools.pairwise(plans))
    assert plans[0].time == 0 and plans[-1].time > 0


def test_output_chains_hold_their_outputs_and_run_twice_but_last():
    problem = Problem(kept=[[10, 2, 6, 0]] * 3, time=[[0, 5, 2, 5]] * 3, rebuilt=[10] * 3,
                      fixed=[0] * 3, output=[2] * 3, end=0, chain_time=[4] * 3, last_held=[7] * 3)
    peak, time = evaluate(problem, [OUTPUT, OUTPUT, OUTPUT])
    assert time == 3 * 5 + 2 * 4
    assert peak == 10 + 2 + 7  # block 2's backward holds block 0's output and block 1 rebuilt whole
    assert evaluate(problem, [KEEP, OUTPUT, KEEP])[0] == 10 + 10 + 7  # after block 0 keeps 10
    assert evaluate(problem, [KEEP] * 3) == (30, 0)


def test_a_problem_with_inconsistent_lists_is_refused():
    with pytest.raises(ValueError, match="Problem.time"):
        Problem(kept=[[1, 1, 1, 1]], time=[], rebuilt=[1], fixed=[0], output=[1], end=0)
    with pytest.raises(ValueError, match="4 kept and 5 time entries for 5 options"):
        Problem(kept=[[1, 1, 1, 1]], time=[[0, 1, 1, 1, 1]], rebuilt=[1], fixed=[0], output=[1], end=0,
                options=(*BLOCK_OPTIONS, "children:mlp"))
    with pytest.raises(ValueError, match="must start with"):
        Problem(kept=[[1, 1]], time=[[0, 1]], rebuilt=[1], fixed=[0], output=[1], end=0,
                options=("keep", "children:mlp"))


def test_a_final_chain_is_rebuilt_after_the_end_of_forward_not_at_it():
    # the loss's temporaries (end) and the rebuilt final chain (tail) are not alive together
    kwargs = {"kept": [[10, 2, 6, 0]] * 3, "time": [[0, 1, 1, 1]] * 3, "rebuilt": [10] * 3,
              "fixed": [0] * 3, "output": [2] * 3, "end": 50}
    together, apart = Problem(**kwargs), Problem(**kwargs, tail=5)
    chain = [OUTPUT] * 3
    assert evaluate(together, chain)[0] == 50 + 2 + 2 + 2
    assert evaluate(apart, chain)[0] == max(50, 5 + 2 + 2 + 2) == 50
    assert solve_chain(apart, 50).choices == solve_brute_force(apart, 50).choices == ("output",) * 3
    with pytest.raises(BudgetError):
        solve_chain(together, 50)


def test_dominated_options_are_not_tried_and_the_optimum_stands():
    from remat.planner._solve import _undominated

    # children:fc and children:gelu keep and hold the same; gelu costs less: fc is never needed
    problem = Problem(kept=[[20, 2, 12, 0, 8, 8]] * 3, time=[[0, 10, 4, 10, 6, 1]] * 3,
                      rebuilt=[[20, 20, 20, 20, 18, 18]] * 3, fixed=[0] * 3, output=[2] * 3, end=0,
                      options=(*BLOCK_OPTIONS, "children:fc", "children:gelu"))
    assert _undominated(problem, 0) == [0, 1, 3, 5]  # selective (12, 20, 4) loses to gelu too
    for budget in (60, 48, 36, 30):
        assert solve_chain(problem, budget).time == solve_brute_force(problem, budget).time


def _rebuildable(weights, inputs, required, banned, kept) -> bool:
    """Whether backward can have every required output: kept, or re-run from what it can have."""
    have: list[bool] = []
    for i in range(len(weights)):
        have.append(i in kept or (i not in banned and all(have[j] for j in inputs[i])))
    return all(have[i] for i in required)


def test_min_cut_keeps_the_fewest_bytes_brute_force_finds():
    rng = random.Random(3)
    for _ in range(400):
        n = rng.randint(1, 8)
        weights = [rng.choice([0, 1, 2, 4, 8, 16]) for _ in range(n)]
        inputs = [sorted(rng.sample(range(i), rng.randint(0, min(i, 3)))) for i in range(n)]
        required = [i for i in range(n) if rng.random() < 0.4]
        banned = [i for i in range(n) if rng.random() < 0.3]
        kept = min_cut_keep(weights, inputs, required, banned)
        assert _rebuildable(weights, inputs, required, banned, set(kept))
        best = min(sum(weights[i] for i in subset)
                   for size in range(n + 1) for subset in itertools.combinations(range(n), size)
                   if _rebuildable(weights, inputs, required, banned, set(subset)))
        assert sum(weights[i] for i in kept) == best


def test_min_cut_keeps_the_later_of_two_equal_outputs_so_less_is_re_run():
    # a rotary embedding: a product (0, banned) then four cheap operators (1..4) whose last
    # output (the same bytes) attention saves: keep that one, not the product and a re-run
    assert min_cut_keep([8, 8, 8, 8, 8], [[], [0], [0], [1, 2], [3]], required=[4], banned=[0]) == [4]
    # what nothing needs is not kept, banned or not
    assert min_cut_keep([8, 8], [[], [0]], required=[], banned=[0]) == []


def test_min_cut_refuses_a_node_reading_a_later_one():
    with pytest.raises(ValueError, match="reads earlier ones only"):
        min_cut_keep([1, 1], [[1], []], required=[0], banned=[])
