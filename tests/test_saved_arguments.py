"""A saved tensor that is one of the region's arguments is kept, not rebuilt
(NOTE [Saved arguments are kept] in ``hooked.py``): fewer re-runs, the same gradients,
the same errors when the argument changes in place."""

import pytest
import torch
import torch.nn.functional as F

import remat
from remat import ops
from remat._engine.state import recompute_count


def _grads(model, x):
    xi = x.clone().requires_grad_()
    model(xi).pow(2).sum().backward()
    return [xi.grad, *(p.grad for p in model.parameters())]


class _Mlp(torch.nn.Module):
    def __init__(self, act) -> None:
        super().__init__()
        self.fc1, self.fc2, self.act = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8), act

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def _gelu_tanh(h):
    return F.gelu(h, approximate="tanh")


@pytest.mark.parametrize(("primitive", "reruns"), [(ops.GeLU, 1), (ops.MatMul, 0)])
def test_primitive_whose_saved_tensors_are_its_inputs_reruns_only_for_its_output(primitive, reruns):
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    if isinstance(primitive(), ops.MatMul):
        class M(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.w, self.mm = torch.nn.Parameter(torch.randn(8, 8)), ops.MatMul()

            def forward(self, x):
                return torch.tanh(self.mm(x.sin(), self.w))
        plain, marked = M(), M()
        marked.load_state_dict(plain.state_dict())
        marked.mm.recompute()
    else:
        plain = _Mlp(_gelu_tanh)
        marked = _Mlp(primitive())
        marked.load_state_dict(plain.state_dict())
        marked.act.recompute()
    expected = _grads(plain, x)
    before = recompute_count()
    got = _grads(marked, x)
    # GeLU's output is rebuilt for fc2's backward, which saved it (one re-run); tanh saves its
    # own output, not the product's. The operator's own backward reads only its inputs, read
    # back: no re-run for it (one more each before)
    assert recompute_count() - before == reruns
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["checkpoint", "apply"])
def test_region_that_saves_only_its_argument_never_reruns(mode):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    marked = torch.nn.Sequential(*(torch.nn.Sequential(m) for m in model))
    marked.load_state_dict({k.replace(".", ".0.", 1): v for k, v in model.state_dict().items()})
    x = torch.randn(4, 8)
    expected = _grads(model, x)
    if mode == "apply":
        remat.recompute_module(marked[1], use_reentrant=False)
        run = marked
    else:
        def run(h):
            return marked[2](remat.checkpoint(marked[1], marked[0](h), use_reentrant=False))
        run.parameters = marked.parameters
    before = recompute_count()
    got = _grads(run, x)
    assert recompute_count() - before == 0  # GELU saves its input only
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)


def test_argument_changed_in_place_after_forward_is_refused():
    lin = torch.nn.Linear(8, 8)
    h = lin(torch.randn(4, 8))
    y = remat.checkpoint(F.gelu, h, use_reentrant=False)
    with torch.no_grad():
        h.add_(1.0)
    with pytest.raises(remat.RecomputeError, match="changed in place"):
        y.sum().backward()


def test_unmarked_refuses_argument_changed_in_place_too():
    lin = torch.nn.Linear(8, 8)
    h = lin(torch.randn(4, 8))
    y = F.gelu(h)
    with torch.no_grad():
        h.add_(1.0)
    with pytest.raises(RuntimeError, match="inplace"):
        y.sum().backward()


def test_region_writing_its_argument_after_saving_it_errs_as_unmarked():
    def block(h):
        y = F.gelu(h)
        h.mul_(2.0)
        return y

    for run in (block, lambda h: remat.checkpoint(block, h, use_reentrant=False)):
        lin = torch.nn.Linear(8, 8)
        h = lin(torch.randn(4, 8))
        with pytest.raises(RuntimeError, match="inplace"):
            run(h).sum().backward()


def test_saved_argument_without_grad_comes_back_as_itself():
    seen = []

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, w, s):
            ctx.save_for_backward(s)
            ctx.s = s
            return w * s

        @staticmethod
        def backward(ctx, g):
            (s,) = ctx.saved_tensors
            seen.append(s is ctx.s)
            return g * s, None

    w = torch.randn(4, requires_grad=True)
    s = torch.randn(4)
    remat.checkpoint(Scale.apply, w, s, use_reentrant=False).sum().backward()
    assert seen == [True]
    assert torch.equal(w.grad, s)
