"""``remat.compile(model, budget=...)``: planned on the compiled step, held by its measured peak
(NOTE [Planning a compiled step])."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

import remat
from remat._graph.internal import allocation_peak
from remat.planner import solve_savings
from remat.planner._settings import marks_of
from tests.test_plan import grads, sequence, tiny_transformer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# --- the solver: exact against brute force -------------------------------------------


def _brute(saving, time, need, exclude=()):
    best = None
    for choice in itertools.product(*[range(len(row)) for row in saving]):
        if any(saving[i][o] is None for i, o in enumerate(choice)) or choice in exclude:
            continue
        if sum(saving[i][o] for i, o in enumerate(choice)) < need:
            continue
        key = (sum(time[i][o] for i, o in enumerate(choice)), choice)
        best = key if best is None or key < best else best
    return None if best is None else best[1]


@pytest.mark.parametrize("seed", range(40))
def test_the_knapsack_is_the_brute_force_optimum(seed):
    r = random.Random(seed)
    n, m = r.randint(1, 5), r.randint(2, 5)
    saving = [[0] + [r.choice([None, r.randint(-3, 20)]) for _ in range(m - 1)] for _ in range(n)]
    time = [[0] + [r.randint(0, 9) for _ in range(m - 1)] for _ in range(n)]
    need = r.randint(-2, 15 * n)
    expected = _brute(saving, time, need)
    assert solve_savings(saving, time, need, resolution=1) == expected
    if expected is not None:  # the next best when the best measured over its budget
        assert solve_savings(saving, time, need, resolution=1, exclude=[expected]) == _brute(
            saving, time, need, exclude={expected})


# --- planning and compiling in one call ----------------------------------------------


def _base_bytes(model: torch.nn.Module, x: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers(), x))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


@pytest.fixture(scope="module")
def planned():
    model, x = tiny_transformer(), sequence()
    compiled = remat.compile(model, budget=0.75, example_inputs=(x,), loss_fn=_loss, rounds=2)
    return model, compiled, x


def test_the_compiled_plan_holds_its_budget_measured_on_the_compiled_step(planned):
    model, compiled, x = planned
    plan = compiled.remat_plan
    assert plan.measured_peak_bytes <= plan.budget_bytes
    assert plan.budget_bytes == int(0.75 * plan.no_recompute_peak_bytes)
    assert any(c != "keep" for c in plan.choices.values())
    named = dict(model.named_modules())
    assert sorted(remat.marked_modules(model)) == sorted(
        n for d in plan.decisions for n, _, _ in marks_of(d.name, named[d.name], d.choice))

    def step() -> None:
        _loss(compiled(x)).backward()
        model.zero_grad(set_to_none=True)

    step()
    assert compiled.remat_reports  # it compiled (Dynamo's caches were reset after planning)
    assert _base_bytes(model, x) + allocation_peak(step) <= plan.budget_bytes


def test_the_compiled_plan_trains_bitwise_equal_to_unmarked_eager_dropout_included(planned):
    model, compiled, x = planned
    expected = grads(tiny_transformer(), x)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)
    compiled(x).float().pow(2).mean().backward()
    assert all(torch.equal(p.grad, expected[n]) for n, p in model.named_parameters())
    model.zero_grad(set_to_none=True)


def test_a_budget_below_every_compiled_peak_is_refused_and_marks_nothing():
    model, x = tiny_transformer(), sequence()
    with pytest.raises(remat.BudgetError, match="remat.compile: no plan measured within") as err:
        remat.compile(model, budget=1000, example_inputs=(x,), rounds=1,
                      options=remat.planner.BLOCK_OPTIONS)
    assert err.value.floor_bytes > 1000
    assert remat.marked_modules(model) == {}


def test_planning_arguments_need_a_budget_and_a_budget_needs_a_module_and_inputs():
    model, x = tiny_transformer(), sequence()
    with pytest.raises(TypeError, match=r"remat.compile: example_inputs= plans .* give budget="):
        remat.compile(model, example_inputs=(x,))
    with pytest.raises(TypeError, match="remat.compile: budget= plans a torch.nn.Module"):
        remat.compile(lambda t: model(t), budget=0.5, example_inputs=(x,))
    with pytest.raises(TypeError, match="remat.compile: budget= needs the step's inputs"):
        remat.compile(model, budget=0.5)
    with pytest.raises(ValueError, match="remat.compile: rounds must be a positive int"):
        remat.compile(model, budget=0.5, example_inputs=(x,), rounds=0)
    remat.recompute_module(model[0])
    with pytest.raises(ValueError, match="already has recompute marks"):
        remat.compile(model, budget=0.5, example_inputs=(x,))
    assert sorted(remat.marked_modules(model)) == ["0"]
