"""A tree that goes back to a state it had keeps what was learned in it.

NOTE [Trees seen before] (``_engine/tree.py``) and NOTE [A mark set again is the same mark]
(``_front/marks.py``): a block marked, unmarked and marked again with the same options is
the same tree as before, so its region is not watched again; a tree whose objects are not
the very ones seen is. Gradients are bitwise equal to the unmarked model's at every step.
The planner's timing, which marks and unmarks every option in every round, watched every
region in every round before (it timed the observation, which the user's loop never pays).
"""

from __future__ import annotations

import copy

import pytest
import torch

import remat
from remat.memory._step import Step
from remat.models.gpt import GPT, GPTConfig
from tests._harness import assert_bitwise_equal, observed_calls

MODES = {"non-reentrant": {}, "reentrant": {"use_reentrant": True}}


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.act = torch.nn.Tanh()
        self.scale = torch.full((4,), 0.5)

    def forward(self, x):
        return self.act(self.fc(x) * self.scale)


def _steps(model: torch.nn.Module, marks: list, seed: int = 0) -> list:
    """One step per entry of ``marks`` (a function that marks the model, or None for none),
    the marks taken off after each step; the gradients of each step."""
    g = torch.Generator().manual_seed(seed)
    found = []
    for mark in marks:
        if mark is not None:
            mark(model)
        x = torch.randn(3, 4, generator=g, requires_grad=True)
        model(x).pow(2).sum().backward()
        found.append([p.grad.clone() for p in model.parameters()] + [x.grad])
        model.zero_grad(set_to_none=True)
        remat.unmark(model)
    return found


def _watched(monkeypatch, marks: list) -> list[str]:
    """The regions watched over `_steps` of a marked block, whose gradients at every step are
    bitwise equal to an unmarked copy's."""
    torch.manual_seed(0)
    base = Block()
    marked = copy.deepcopy(base)
    entered = observed_calls(monkeypatch)
    got = _steps(marked, marks)
    want = _steps(base, [None] * len(marks))
    for a, b in zip(got, want, strict=True):
        assert_bitwise_equal(a, b)
    return entered


@pytest.mark.parametrize("mode", list(MODES))
def test_a_block_marked_again_with_the_same_options_is_not_watched_again(monkeypatch, mode):
    mark = lambda m: remat.recompute_module(m, **MODES[mode])
    entered = _watched(monkeypatch, [mark, mark, None, mark, None, mark])
    assert entered == ["Block"]  # the first call only: every later state was seen before


@pytest.mark.parametrize("mode", list(MODES))
def test_marks_that_alternate_are_each_watched_once(monkeypatch, mode):
    block = lambda m: remat.recompute_module(m, **MODES[mode])
    child = lambda m: remat.recompute_module(m.fc, **MODES[mode])
    output = lambda m: remat.recompute_module(m, output_recompute=True)
    entered = _watched(monkeypatch, [block, child, output] * 3)
    # each option's first call, and the block's first call under its first mark again after
    # the child's first mark gave the child remat's cache and its marks; then nothing
    assert entered == ["Block", "Linear", "Block", "Block"]


@pytest.mark.parametrize("mode", list(MODES))
def test_a_state_with_a_new_object_is_watched_even_after_a_state_seen_before(monkeypatch, mode):
    torch.manual_seed(0)
    base = Block()
    marked = remat.recompute_module(copy.deepcopy(base), **MODES[mode])
    entered = observed_calls(monkeypatch)
    first, second = marked.scale, torch.full((4,), 2.0)
    values = [first, second, first, torch.full((4,), 3.0), second]
    got, want = [], []
    for model, found in ((base, want), (marked, got)):
        g = torch.Generator().manual_seed(0)
        for value in values:
            model.scale = value
            x = torch.randn(3, 4, generator=g, requires_grad=True)
            model(x).pow(2).sum().backward()
            found.append([p.grad.clone() for p in model.parameters()] + [x.grad])
            model.zero_grad(set_to_none=True)
    # first, second: new; first again and second again: seen before; the third tensor: new
    assert entered == ["Block"] * 3
    for a, b in zip(got, want, strict=True):
        assert_bitwise_equal(a, b)


def test_a_mark_with_other_options_or_another_forward_is_a_new_mark():
    block = Block()
    remat.recompute_module(block)
    wrapper = block.forward
    remat.unmark(block)
    remat.recompute_module(block)
    assert block.forward is wrapper  # the same options: the same mark
    remat.unmark(block)
    remat.recompute_module(block, use_reentrant=True)
    assert block.forward is not wrapper and remat.mark_of(block).use_reentrant
    remat.unmark(block)
    block.forward = lambda x: x  # another forward set on the instance since
    remat.recompute_module(block)
    assert block.forward.inner is not None and block.forward is not wrapper
    remat.unmark(block)
    x = torch.randn(2, 4)
    assert block(x) is x and remat.mark_of(block) is None


def test_the_planners_rounds_watch_each_option_in_the_first_round_only(monkeypatch):
    """Before, every marked region was watched in every round of the planner's timing."""
    from remat.planner._measure import interleaved_steps

    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=2, width=32, heads=2, seq_len=8, vocab=16))
    x = torch.randint(0, 16, (2, 8))
    names = [name for name, _ in model.blocks.named_children()]
    uniform = {"keep": {}, "recompute": dict.fromkeys(names, "recompute"),
               "output": dict.fromkeys(names, "output"), "children:gelu": dict.fromkeys(names, "children:gelu")}
    entered = observed_calls(monkeypatch)
    counts = []
    for rounds in (2, 6):
        del entered[:]
        copied = copy.deepcopy(model)
        interleaved_steps(copied, Step(inputs=(x,)), dict(copied.blocks.named_children()), uniform,
                          rounds=rounds)
        counts.append(len(entered))
    # the first round watches each option's regions, once: two options of two blocks, one of
    # two children (before: every region in every round; then, the FSDP adapter's note set
    # by an output mark's first call, and a child's first mark, changed the blocks' trees
    # after their first call, so the first timed round watched them again)
    assert counts == [3 * 2, 3 * 2]
