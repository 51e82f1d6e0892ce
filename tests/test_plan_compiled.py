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


def test_a_module_outside_the_blocks_is_an_item_of_the_compiled_plan():
    """NOTE [Modules outside the blocks]: the final norm of a Llama (outside its blocks) is
    offered with ``output`` (rebuilt in backward, not kept for the head's product) and so is
    its embedding; compiled, marking the norm lowers the peak, and a plan that marks a module
    outside the blocks holds its budget, trains bitwise equal to unmarked eager and reads
    back from JSON."""
    from remat.models.llama import llama
    from remat.planner._compiled import _outside

    def make() -> torch.nn.Module:  # a vocabulary whose logits the peak holds
        torch.manual_seed(0)
        return llama(layers=2, width=128, heads=4, hidden=344, vocab=4096)

    x = torch.randint(0, 4096, (2, 64), generator=torch.Generator().manual_seed(1))
    rows = {r.name: r for r in remat.profile(make(), x, repeat=0).rows}
    found = _outside(make(), ["blocks.0", "blocks.1"], rows)
    assert found["norm"] == "output" and not any(n.startswith("blocks") for n in found), found

    def peak(mark) -> int:
        model = make()
        mark(model)
        compiled = remat.compile(model)

        def step() -> None:
            _loss(compiled(x)).backward()
            model.zero_grad(set_to_none=True)

        step()
        return allocation_peak(step)

    assert peak(lambda m: remat.recompute_module(m.norm, output_recompute=True)) < peak(lambda m: None)

    said: list[str] = []
    options = ("keep", "recompute", "output")
    with pytest.raises(remat.BudgetError) as below:  # the lowest peak the options reach ...
        remat.compile(make(), budget=0.5, example_inputs=(x,), loss_fn=_loss, rounds=1, options=options)
    model = make()  # ... is reached with the norm rebuilt (the blocks alone keep its output)
    compiled = remat.compile(model, budget=below.value.floor_bytes, example_inputs=(x,), loss_fn=_loss,
                             rounds=1, options=options, progress=said.append)
    assert any("'norm=output'" in line for line in said), said
    plan = compiled.remat_plan
    assert plan.measured_peak_bytes <= plan.budget_bytes
    outside = {n: c for n, c in plan.choices.items() if not n.startswith("blocks.")}
    assert outside and set(outside) <= set(found), plan.choices
    assert set(outside) <= set(remat.marked_modules(model))
    expected = grads(make(), x)
    torch.manual_seed(123)
    compiled(x).float().pow(2).mean().backward()
    assert all(torch.equal(p.grad, expected[n]) for n, p in model.named_parameters())
    assert remat.Plan.from_json(plan.to_json()) == plan


def test_when_the_knapsack_keeps_missing_the_fastest_uniform_option_that_fits_is_taken(monkeypatch):
    """NOTE [Planning a compiled step], step 4: a separable model that errs six times in a row
    (here a knapsack that always answers "keep everything") no longer ends in a BudgetError
    while an option marking every block alike was measured within the budget."""
    import remat.planner._compiled as compiled_planner

    monkeypatch.setattr(compiled_planner, "solve_savings", lambda saving, *a, **k: (0,) * len(saving))
    model, x = tiny_transformer(), sequence()
    compiled = remat.compile(model, budget=0.8, example_inputs=(x,), loss_fn=_loss, rounds=1,
                             options=("keep", "recompute", "selective"))
    plan = compiled.remat_plan
    assert plan.measured_peak_bytes <= plan.budget_bytes
    assert len(set(plan.choices.values())) == 1 and set(plan.choices.values()) <= {"recompute", "selective"}
    expected = grads(tiny_transformer(), x)
    torch.manual_seed(123)
    compiled(x).float().pow(2).mean().backward()
    assert all(torch.equal(p.grad, expected[n]) for n, p in model.named_parameters())
