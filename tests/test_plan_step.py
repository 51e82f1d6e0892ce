"""remat.plan holds its budget in the loop users write (outputs alive), and in their own step.

Each example model is planned for 10 budgets from the floor to the no-recompute peak; every
plan is then measured by ``remat.memory.track`` in the loop itself, against the budget, and
trains bitwise equal to the unmarked model (NOTE [The step users run] in memory/_step.py).
"""

from __future__ import annotations

import argparse
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import remat
from remat.models import gpt, resnet
from remat.models.llama import llama
from remat.models.unet import unet

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
BUDGETS = 10


@dataclass(frozen=True)
class Example:
    make: Callable[[], torch.nn.Module]
    x: torch.Tensor
    y: torch.Tensor
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _tokens(vocab: int, shape: tuple, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _next_token(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _seeded(factory: Callable[[], torch.nn.Module]) -> Callable[[], torch.nn.Module]:
    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return factory()
    return make


EXAMPLES = {
    "gpt": Example(_seeded(lambda: gpt(layers=4, width=64, heads=4, seq_len=64, vocab=512)),
                   _tokens(512, (4, 64), 1), _tokens(512, (4, 64), 2), _next_token),
    "llama": Example(_seeded(lambda: llama(layers=4, width=64, heads=4, hidden=176, vocab=512)),
                     _tokens(512, (4, 64), 1), _tokens(512, (4, 64), 2), _next_token),
    "resnet50": Example(_seeded(lambda: resnet((3, 4, 6, 3), width=4, class_num=10)),
                        torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(1)),
                        _tokens(10, (8,), 2), F.cross_entropy),
    "unet": Example(_seeded(lambda: unet(channels=(4, 8, 16), dropout=0.2)),
                    torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1)),
                    torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(2)), F.mse_loss),
}


def standard_step(example: Example) -> Callable:
    """The loop users write: the output stays alive until the step ends."""
    def run(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        out = model(example.x)
        loss = example.loss(out, example.y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del out, loss
    return run


def accumulating_step(example: Example) -> Callable:
    """``step(model, batch)``: two micro-batches, gradients accumulated."""
    def step(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
        x, y = batch
        for xs, ys in zip(x.chunk(2), y.chunk(2), strict=True):
            out = model(xs)
            loss = example.loss(out, ys) / 2
            loss.backward()
        return loss
    return step


def loop_peak(model: torch.nn.Module, example: Example, step: Callable | None = None) -> int:
    """Peak bytes of the second step of a training loop (Adam's state made by the first)."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def run() -> None:
        if step is None:
            standard_step(example)(model, opt)
        else:
            step(model, (example.x, example.y))
            opt.step()
            opt.zero_grad(set_to_none=True)

    run()
    with remat.memory.track(model, baseline=[example.x, example.y, opt]) as tracker:
        run()
    return tracker.peak_bytes


def sweep_budgets(example: Example, **kwargs: object) -> list:
    """Plans for 10 budgets from the floor to the no-recompute peak (floors found by a first plan)."""
    first = remat.plan(example.make(), budget=1.0, repeat=1, **kwargs)
    low, high = first.floor_bytes, first.no_recompute_peak_bytes
    budgets = [int(low + (high - low) * k / (BUDGETS - 1)) for k in range(BUDGETS)]
    return first, remat.planner.sweep(example.make(), budgets=budgets, repeat=1, floors=True, **kwargs)


def gradients(model: torch.nn.Module, example: Example) -> dict:
    torch.manual_seed(123)  # dropout draws the same masks in every run
    example.loss(model(example.x), example.y).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def check_sweep(example: Example, first: remat.Plan, plans: list, step: Callable | None) -> None:
    unmarked = loop_peak(example.make(), example, step)
    assert first.no_recompute_peak_bytes == unmarked  # the printed peak is the loop's
    made = [p for p in plans if isinstance(p, remat.Plan)]
    # a budget is met, or refused naming a measured peak above it (the cost model's floor is
    # optimistic on graphs such as the U-Net's: the plans near it measure higher)
    refused = [e for e in plans if not isinstance(e, remat.Plan)]
    assert all(e.floor_bytes > e.budget_bytes for e in refused)
    assert len(made) >= BUDGETS // 2 and plans[-1] is made[-1], [str(e) for e in refused]
    assert any(c != "keep" for c in made[0].choices.values())
    expected = gradients(example.make(), example)
    for p in made:
        marked = example.make()
        p.apply(marked)
        assert loop_peak(marked, example, step) <= p.budget_bytes, (p.budget_bytes, p.choices)
        marked = example.make()
        p.apply(marked)
        got = gradients(marked, example)
        assert all(torch.equal(got[n], expected[n]) for n in expected), p.choices


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_a_budget_sweep_holds_in_the_loop_users_write(name):
    example = EXAMPLES[name]
    first, plans = _standard_sweep(example)
    check_sweep(example, first, plans, None)
    if name in ("gpt", "llama"):  # and every distinct plan of the sweep, compiled
        check_compiled(example, plans)


def check_compiled(example: Example, plans: list) -> None:
    """Each distinct plan, under ``remat.compile``, trains bit for bit as the unmarked model."""
    expected = gradients(example.make(), example)
    distinct = {tuple(p.choices.values()): p for p in plans if isinstance(p, remat.Plan)}
    assert len(distinct) >= 2  # (per-operator options rebuilt one tensor at a time hold most budgets)
    for plan in distinct.values():
        marked = example.make()
        plan.apply(marked)
        compiled = remat.compile(marked)
        torch.manual_seed(123)
        example.loss(compiled(example.x), example.y).backward()
        assert compiled.remat_reports, plan.choices  # compiled, not run eagerly
        got = {n: p.grad for n, p in marked.named_parameters()}
        assert all(torch.equal(got[n], expected[n]) for n in expected), plan.choices
        torch.compiler.reset()  # one compile per plan, each from clean caches


def _standard_sweep(example: Example) -> tuple:
    first = remat.plan(example.make(), example.x, budget=1.0, repeat=1,
                       loss_fn=lambda out: example.loss(out, example.y))
    low, high = first.floor_bytes, first.no_recompute_peak_bytes
    budgets = [int(low + (high - low) * k / (BUDGETS - 1)) for k in range(BUDGETS)]
    return first, remat.planner.sweep(example.make(), example.x, budgets=budgets, repeat=1, floors=True,
                                      loss_fn=lambda out: example.loss(out, example.y))


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_a_budget_sweep_holds_in_a_step_with_gradient_accumulation(name):
    example = EXAMPLES[name]
    step = accumulating_step(example)
    first, plans = sweep_budgets(example, batch=(example.x, example.y), step=step)
    check_sweep(example, first, plans, step)


def test_the_old_step_freed_the_output_and_planned_over_budget_in_the_loop():
    # The planner's first step was loss_fn(model(x)).backward(): the logits died before backward.
    example = EXAMPLES["gpt"]
    freed = remat.profile(example.make(), example.x, loss_fn=lambda out: example.loss(out, example.y),
                          optimizer="adam", repeat=0).peak_bytes
    p = remat.plan(example.make(), example.x, budget=1.0, repeat=1,
                   loss_fn=lambda out: example.loss(out, example.y))
    logits = 4 * 64 * 512 * 4
    assert p.no_recompute_peak_bytes >= freed + logits  # the logits count now


def test_a_string_budget_means_what_the_cli_means():
    from remat.cli.plan import _budget_arg

    example = EXAMPLES["gpt"]
    kwargs = {"loss_fn": lambda out: example.loss(out, example.y), "repeat": 1, "verify": False}
    as_string = remat.plan(example.make(), example.x, budget="0.6", **kwargs)
    as_float = remat.plan(example.make(), example.x, budget=0.6, **kwargs)
    assert as_string.budget_bytes == as_float.budget_bytes == int(0.6 * as_float.no_recompute_peak_bytes)
    parse = remat.planner.parse_budget
    assert parse("0.6") == parse("60%") == parse(0.6) == (0.6, True)
    assert parse("1") == (1.0, True) and parse("2GiB") == (2 * 2**30, False)
    assert parse("512MB") == (512e6, False) and parse("4000000000") == (4e9, False)
    assert _budget_arg("0.6") == "0.6"  # the CLI checks with the same parser, then passes it on
    with pytest.raises(argparse.ArgumentTypeError, match="cannot read budget"):
        _budget_arg("60 parsecs")  # argparse turns it into a one-line error, exit status 2
    with pytest.raises(ValueError, match="neither a fraction"):
        parse("1.5")


def test_errors_print_their_public_names():
    example = EXAMPLES["gpt"]
    with pytest.raises(remat.BudgetError) as info:
        remat.plan(example.make(), example.x, budget=1, repeat=1)
    shown = "".join(traceback.format_exception_only(info.type, info.value))
    assert shown.startswith("remat.BudgetError: remat.plan: no plan fits a budget of 1 B")
    assert remat.RecomputeError.__module__ == "remat" and remat.CheckpointError is remat.RecomputeError


def test_the_planner_package_is_not_hidden_by_the_function():
    assert callable(remat.plan) and remat.plan is remat.planner.plan
    assert remat.planner.OPTIONS == ("keep", "recompute", "selective", "output", "children", "ops")
    assert remat.planner.FAMILIES == (*remat.planner.OPTIONS, "staged")  # staged: only when asked
    assert set(remat.planner.BLOCK_OPTIONS) < set(remat.planner.OPTIONS)
    assert remat.planner.BudgetError is remat.BudgetError and remat.planner.Plan is remat.Plan


def test_step_arguments_are_checked():
    example = EXAMPLES["gpt"]
    step = accumulating_step(example)
    with pytest.raises(ValueError, match="loss_fn= or step=, not both"):
        remat.plan(example.make(), batch=(example.x, example.y), step=step, loss_fn=sum, budget=0.9)
    with pytest.raises(ValueError, match="give the batch once"):
        remat.plan(example.make(), example.x, batch=(example.x, example.y), step=step, budget=0.9)
    with pytest.raises(TypeError, match="batch must be a dict"):
        remat.plan(example.make(), batch=(example.x,), budget=0.9)
    with pytest.raises(TypeError, match="ran no backward"):
        remat.plan(example.make(), example.x, step=lambda m, x: None, budget=0.9)


def test_a_hugging_face_style_batch_and_output_are_planned_as_the_loop_runs():
    # A model taking keyword inputs and returning a ModelOutput with its loss: the default
    # loss is the output's loss, and the whole output (the logits too) stays alive.
    outputs = pytest.importorskip("transformers.modeling_outputs")

    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = EXAMPLES["gpt"].make()

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> object:
            logits = self.inner(input_ids)
            return outputs.CausalLMOutput(loss=_next_token(logits, labels), logits=logits)

    example = EXAMPLES["gpt"]
    batch = {"input_ids": example.x, "labels": example.y}
    p = remat.plan(Wrapped(), batch=batch, budget="70%", repeat=1)
    model = Wrapped()
    p.apply(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(2):  # the second step measured, Adam's state made by the first
        with remat.memory.track(model, baseline=[batch, opt]) as tracker:
            out = model(**batch)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del out
    assert tracker.peak_bytes <= p.budget_bytes < p.no_recompute_peak_bytes
