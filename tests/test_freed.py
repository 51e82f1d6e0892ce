"""A marked model its user drops is freed at once, as an unmarked one is (NOTE [A mark holds
its module weakly] in ``remat/_front/marks.py``, NOTE [A compiled model held weakly] in
``remat/_graph/_backend.py``): no reference cycle keeps its parameters for Python's cyclic
collector to find later."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import remat
from remat import ops


class _Block(remat.nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 8)
        self.act = ops.GeLU()
        self.out = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.out(self.act(self.fc(x)))


def _train(model, steps: int = 3) -> None:
    for _ in range(steps):
        model(torch.randn(2, 4, requires_grad=True)).sum().backward()


def _recompute_module(reentrant):
    def mark(net):
        remat.recompute_module(net, use_reentrant=reentrant)
        _train(net)
        return net
    return mark


def _apply(net):
    remat.apply(net, where=torch.nn.Linear)
    _train(net)
    return net


def _cell(net):
    net.recompute()
    _train(net)
    return net


def _primitive(net):
    net.act.recompute()
    _train(net)
    return net


def _policy(net):
    remat.recompute_module(net, policy=remat.save_compute_intensive)
    _train(net)
    return net


def _unmarked_again(net):
    remat.recompute_module(net)
    _train(net)
    remat.unmark(net)
    return net


def _compiled(net):
    remat.recompute_module(net.fc, output_recompute=True)
    _train(remat.compile(net), steps=2)  # the compiled wrapper dropped with the model
    return net


FRONTS = {"recompute_module": _recompute_module(False), "recompute_module reentrant": _recompute_module(True),
          "remat.apply": _apply, "cell marks": _cell, "primitive marks": _primitive,
          "a policy": _policy, "marked then unmarked": _unmarked_again, "remat.compile": _compiled}


def _freed_without_collection(prepare) -> bool:
    prepare(_Block())  # lazy imports and first-call caches, outside the measure
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()  # as between two collections of the user's loop
    try:
        net = prepare(_Block())
        weight = weakref.ref(net.fc.weight)
        del net
        return weight() is None
    finally:
        if enabled:
            gc.enable()


def test_an_unmarked_model_is_freed_without_a_collection():
    """The baseline the marks are held to."""
    assert _freed_without_collection(lambda net: (_train(net), net)[1])


@pytest.mark.parametrize("front", list(FRONTS))
def test_a_marked_model_dropped_is_freed_without_a_collection(front):
    assert _freed_without_collection(FRONTS[front])


@pytest.mark.parametrize("switch", ["gradient_checkpointing_enable", "reentrant switch", "where=blocks"])
def test_a_hugging_face_model_marked_and_dropped_is_freed_without_a_collection(switch):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)

    def build():
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config).train()
        if switch == "where=blocks":
            remat.apply(model, where="blocks")
        else:
            remat.gradient_checkpointing_enable(model, use_reentrant=switch == "reentrant switch")
        ids = torch.randint(0, 64, (2, 8))
        for _ in range(2):
            model(ids, labels=ids).loss.backward()
        return model

    build()
    gc.collect()
    gc.disable()
    try:
        model = build()
        weight = weakref.ref(model.transformer.h[0].mlp.c_fc.weight)
        del model
        assert weight() is None
    finally:
        gc.enable()


def test_a_marks_forward_called_after_its_module_was_freed_says_so():
    """The mark holds its module weakly: its forward alone does not keep the module (a bound
    method of an unmarked module would); a call then raises a ReferenceError naming the fix,
    not an error from deep inside the engine."""
    net = remat.recompute_module(torch.nn.Linear(4, 4))
    forward = net.forward
    x = torch.randn(2, 4, requires_grad=True)
    forward(x).sum().backward()  # while the module is alive: a region, as any call
    del net
    gc.collect()
    with pytest.raises(ReferenceError, match="keep a reference to the module"):
        forward(x)
