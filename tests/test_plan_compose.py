"""A plan's peak composed from short models equals the whole model's, to the byte
(NOTE [Verifying by composition] in ``remat/planner/_verify.py``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import remat
from remat._front.marks import unmark_module
from remat.memory._step import Step
from remat.memory.internal import identical_container
from remat.models import gpt
from remat.models.llama import Llama, LlamaConfig, next_token_loss
from remat.planner._cost import composed_costs
from remat.planner._measure import measure_peak
from remat.planner._settings import Machine, Settings, mark_choices
from remat.planner._trace import find_blocks
from remat.planner._verify import composed_peak, runs_of

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

LAYERS = 11


def tiny_gpt() -> torch.nn.Module:
    return gpt(layers=LAYERS, width=32, heads=4, seq_len=16, vocab=1024)


def tiny_llama() -> torch.nn.Module:
    return Llama(LlamaConfig(layers=LAYERS, width=32, heads=4, kv_heads=2, hidden=64, vocab=1024))


def plans(options: list[str]) -> list[list[str]]:
    """Uniform plans of every option, then mixed ones: a prefix kept, long and short runs,
    runs of one block, neighbours of every kind."""
    n, out = LAYERS, [[o] * LAYERS for o in options[:5]]
    a, b, c = options[1], options[2 % len(options)], options[-1]
    out += [["keep"] * 3 + [b] * (n - 3),
            # the peak moves from the start of backward (short models) to its end (the whole)
            ["keep"] * 3 + ["recompute"] * (n - 3),
            ["recompute"] * (n - 3) + ["keep"] * 3,
            [a] * 5 + [c] * (n - 5),
            ["keep"] + [b] * (n - 2) + [a],
            [c] * 6 + ["keep"] * 2 + [a] * (n - 8),
            [options[k % len(options)] for k in range(n)],
            ["output"] * 7 + ["recompute"] + ["output"] * (n - 8),
            ["selective"] * 2 + ["keep"] * 5 + [c] * 4]
    return out


@pytest.mark.parametrize("make, loss_fn, optimizer, batch", [
    (tiny_gpt, None, None, 2), (tiny_llama, next_token_loss, "adam", 8)], ids=["gpt-None-2", "llama-adam-8"])
def test_composed_verification_equals_the_whole_trace_to_the_byte(make, loss_fn, optimizer, batch):
    # (batch 2 without an optimizer: gradients outgrow activations, and the peak moves within
    # backward as a run grows, which composing each phase's peak alone gets wrong)
    with FakeTensorMode():
        model = make()
        model.train()
        step = Step(inputs=(torch.zeros(batch, 16, dtype=torch.long),), loss_fn=loss_fn)
        blocks = find_blocks(model)
        container = identical_container(model, blocks)
        settings = Settings(step=step, optimizer=optimizer, machine=Machine(fake=True, device="cpu"))
        costs = composed_costs(model, blocks, container, settings)
        options = [o for o in costs.options if all(k[costs.options.index(o)] is not None for k in costs.kept)]
        assert any(o.startswith("children:") for o in options)  # options inside blocks are composed too
        composed_any = beyond_optimizer = 0
        for choices in plans(options):
            chosen = dict(zip(costs.names, choices, strict=True))
            marked = mark_choices(dict(model.named_modules()), chosen)
            try:
                whole = measure_peak(model, step, optimizer=optimizer, fake=True,
                                     optimizer_peak=costs.memory.optimizer_peak)
            finally:
                for m in marked:
                    unmark_module(m)
            composed = composed_peak(model, costs.names, choices, container, settings,
                                     costs.memory.optimizer_peak, cheaper=False)
            assert composed is not None, runs_of(choices)
            assert composed == whole, (runs_of(choices), composed - whole)
            composed_any += any(n > 4 for _, n in runs_of(choices))
            beyond_optimizer += whole > (costs.memory.optimizer_peak or 0)
        assert composed_any >= 4  # most plans have a run that the short models cut
        assert beyond_optimizer >= 4  # and the peak is the forward's or the backward's


def test_plan_verified_by_composition_measures_what_the_full_trace_measures(monkeypatch):
    import remat.planner._fitting as planning

    composed = []

    def spy(*args, **kwargs):
        composed.append(composed_peak(*args, **kwargs))
        return composed[-1]

    monkeypatch.setattr(planning, "composed_peak", spy)
    config = LlamaConfig(layers=16, width=32, heads=4, kv_heads=2, hidden=64, vocab=1024)

    def inputs():
        return (torch.zeros(8, 16, dtype=torch.long),)

    used = 0
    for budget, options in ((0.8, ("keep", "selective")), (0.6, ("keep", "selective", "recompute"))):
        fast = remat.plan(config, inputs, budget=budget, loss_fn=next_token_loss, options=options)
        used += any(c is not None for c in composed)  # (a plan of many short runs is traced whole)
        composed.clear()
        full = remat.plan(config, inputs, budget=budget, loss_fn=next_token_loss, options=options,
                          verify="full")
        assert not composed
        # the same plan, measured at the same peak to the byte (only the solver's clock differs)
        assert dataclasses.replace(fast, solve_s=0.0) == dataclasses.replace(full, solve_s=0.0)
        assert fast.measured_peak_bytes <= fast.budget_bytes
    assert used >= 2


@pytest.mark.parametrize("verify, error", [("composed", ValueError), ("yes", ValueError), (1, TypeError),
                                           (None, TypeError)])
def test_verify_takes_a_bool_or_full(verify, error):
    net = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    with pytest.raises(error, match="verify must be True, False or 'full'"):
        remat.plan(net, torch.randn(2, 8), budget=0.9, verify=verify)


def test_a_rank_plans_composed_verification_equals_the_whole_trace():
    # FSDP2 gathers a unit's neighbour ahead of it: a block's footprints reach two blocks out
    import functools

    from remat.memory.estimate import Ranks
    from remat.planner._settings import Builder

    def shard(model, mesh):
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)

    config = LlamaConfig(layers=14, width=64, heads=4, kv_heads=2, hidden=160, vocab=1024)
    ranks = Ranks(2, shard, 0)
    with ranks.group(), FakeTensorMode():
        template = Llama(config)
        blocks = find_blocks(template)
        container = identical_container(template, blocks)
        build = Builder(make=functools.partial(Llama, config), finish=lambda m: ranks.apply(m, "cpu"))
        step = Step(inputs=(torch.zeros(4, 32, dtype=torch.long),), loss_fn=next_token_loss)
        settings = Settings(step=step, optimizer="adam", machine=Machine(fake=True, device="cpu"),
                            options=("keep", "recompute", "selective"), build=build)
        costs = composed_costs(template, blocks, container, settings)
        names = costs.names
        beyond_optimizer = 0
        for choices in (["keep"] * 14, ["recompute"] * 14, ["keep"] * 7 + ["recompute"] * 7,
                        ["recompute"] * 3 + ["selective"] * 8 + ["keep"] * 3,
                        ["selective"] * 2 + ["keep"] * 9 + ["recompute"] * 3):
            whole = measure_peak(build(dict(zip(names, choices, strict=True))), step, optimizer="adam",
                                 fake=True, optimizer_peak=costs.memory.optimizer_peak)
            composed = composed_peak(template, names, choices, container, settings,
                                     costs.memory.optimizer_peak, cheaper=False)
            assert composed == whole, (runs_of(choices), None if composed is None else composed - whole)
            beyond_optimizer += whole > costs.memory.optimizer_peak
        assert beyond_optimizer >= 2


def test_a_step_of_micro_batches_is_verified_on_the_whole_model(monkeypatch):
    import remat.planner._fitting as planning

    calls = []
    monkeypatch.setattr(planning, "composed_peak", lambda *a, **k: calls.append(1) or composed_peak(*a, **k))
    config = LlamaConfig(layers=12, width=32, heads=4, kv_heads=2, hidden=64, vocab=1024)

    def step(model, batch):
        for half in batch.chunk(2):
            next_token_loss(model(half)).backward()

    def inputs():
        return (torch.zeros(8, 16, dtype=torch.long),)

    plan = remat.plan(config, inputs, budget=0.85, step=step, options=("keep", "recompute"))
    assert not calls and plan.measured_peak_bytes <= plan.budget_bytes
    # the same plan measured alike with verify="full"
    full = remat.plan(config, inputs, budget=0.85, step=step, options=("keep", "recompute"), verify="full")
    assert full.measured_peak_bytes == plan.measured_peak_bytes and full.choices == plan.choices
