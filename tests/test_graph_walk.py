"""The walk of a re-run's autograd graph for leaves outside a Function's inputs (NOTE [Reads
that vary], NOTE [Observed reads]), against a plain reference walk on graphs with shared
nodes, several outputs of one node, inputs that are not leaves and leaves the re-run made."""

from __future__ import annotations

import torch

from remat._engine.walk import reached_outside


def _reference(outs: list, wrt: list, made: set) -> tuple[set, set]:
    """Every leaf reachable from ``outs`` without passing a ``wrt`` node: ``(outside, made)``
    as sets of ids, by a walk that visits each path (no shortcut)."""
    stops = {t.grad_fn for t in wrt if t.grad_fn is not None}
    leaves = {id(t) for t in wrt if t.grad_fn is None}
    outside, own = set(), set()
    todo = [o.grad_fn for o in outs]
    while todo:
        node = todo.pop()
        if node is None or node in stops:
            continue
        if hasattr(node, "variable"):
            v = node.variable
            if id(v) in made:
                own.add(id(v))
            elif id(v) not in leaves:
                outside.add(id(v))
            continue
        todo.extend(n for n, _ in node.next_functions)
    return outside, own


def _check(outs: list, wrt: list, made: set = frozenset()) -> list:
    made_reached: list = []
    found = reached_outside(outs, wrt, made, made_reached)
    outside, own = _reference(outs, wrt, made)
    assert {id(t) for t in found} == outside
    assert len(found) == len(outside)  # each leaf once
    assert {id(t) for t in made_reached} == own
    return found


def test_a_leaf_reached_by_two_paths_is_found_once():
    torch.manual_seed(0)
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)  # read twice, not an input
    g = torch.randn(4, requires_grad=True)  # an input
    h = (x @ w).relu() @ w + g
    found = _check([h], [x, g])
    assert found[0] is w


def test_every_leaf_inside_the_inputs_finds_nothing():
    x = torch.randn(2, 3, requires_grad=True)
    lin = torch.nn.Linear(3, 3)
    y = lin(torch.tanh(lin(x)))
    assert _check([y], [x, *lin.parameters()]) == []


def test_outputs_of_one_node_and_an_input_that_is_not_a_leaf():
    x = torch.randn(4, 2, requires_grad=True)
    w = torch.randn(2, requires_grad=True)
    mid = x * 2  # an input of the Function with a history: the walk stops there
    a, b = (mid * w).unbind(0)[:2]  # two outputs of one node
    found = _check([a, b, a], [mid])
    assert [t is w for t in found] == [True]


def test_a_leaf_the_re_run_made_is_told_apart():
    x = torch.randn(3, requires_grad=True)
    bias = torch.zeros(3).requires_grad_()  # made inside the re-run (T5's position bias)
    outside = torch.ones(3, requires_grad=True)
    y = (x + bias) * outside
    found = _check([y], [x], made={id(bias)})
    assert [t is outside for t in found] == [True]


def test_outputs_without_history_and_outputs_that_are_inputs():
    x = torch.randn(3, requires_grad=True)
    leaf = torch.randn(3, requires_grad=True)  # returned as it is: no history to walk
    y = x.sin()
    assert _check([leaf, y, x], [x]) == []
