"""Tensors bound as keywords in the partial a region runs (NOTE [Keywords bound in a partial]
in ``_engine/region.py``): Hugging Face's layers call their checkpoint function as
``func(partial(layer.__call__, **kwargs), hidden_states)``.

Before, the attention mask and rotary embeddings bound in that partial were read from
outside the region's arguments, and each region was watched (a dispatch mode on every
operator) on every call. They are the call's arguments: watched once per key, gradients
bitwise against the unmarked model, an in-place change before backward refused.
"""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch

import remat
from remat import RecomputeError
from tests._harness import assert_bitwise_equal, observed_calls
from tests.test_ecosystem import OPTIONS, _hf_model, _sgd


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_hugging_face_switch_regions_are_watched_once_and_train_bitwise(monkeypatch, kind, option):
    """Against the unmarked model; GPT-2's attention takes another path with the switch on
    (no cache), so there against torch's checkpoint through the same switch."""
    base = _hf_model(kind)
    marked = copy.deepcopy(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        remat.gradient_checkpointing_enable(marked, **OPTIONS[option])
        if kind == "gpt2":
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        want = _sgd(base, kind, steps=3)
    entered = observed_calls(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _sgd(marked, kind, steps=3)
    assert_bitwise_equal(got, want)
    layers = base.config.num_hidden_layers
    assert len(entered) == layers  # the first call of each layer only (3 steps: 3x before)


class Masked(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x, *, mask, scale=(None,)):
        h = torch.tanh(self.fc(x)) * mask
        return h * scale[0] if scale[0] is not None else h


MODES = {"reentrant": True, "non-reentrant": False}


@pytest.mark.parametrize("mode", list(MODES))
def test_a_keyword_tensor_that_requires_grad_gets_its_gradient(mode):
    torch.manual_seed(0)
    base, block = Masked(), Masked()
    block.load_state_dict(base.state_dict())
    x = torch.randn(2, 4)
    mask, scale = torch.rand(2, 4, requires_grad=True), torch.rand(4, requires_grad=True)
    results = []
    for model, marked in ((base, False), (block, True)):
        mask.grad = scale.grad = None
        model.zero_grad()
        xi = x.clone().requires_grad_()
        fn = functools.partial(model.__call__, mask=mask, scale=(scale,))
        out = remat.checkpoint(fn, xi, use_reentrant=MODES[mode]) if marked else fn(xi)
        out.pow(2).sum().backward()
        results.append([xi.grad, mask.grad, scale.grad, *(p.grad for p in model.parameters())])
    assert_bitwise_equal(results[1], results[0])


@pytest.mark.parametrize("mode", list(MODES))
def test_a_keyword_tensor_changed_in_place_before_backward_is_refused(mode):
    block = Masked()
    mask = torch.ones(2, 4)
    fn = functools.partial(block.__call__, mask=mask)
    out = remat.checkpoint(fn, torch.randn(2, 4, requires_grad=True), use_reentrant=MODES[mode])
    mask.mul_(2)  # the value the forward read is gone
    with pytest.raises(RecomputeError, match="changed in place"):
        out.sum().backward()
    assert all(p.grad is None for p in block.parameters())
