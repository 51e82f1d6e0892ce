"""Minimal reproducers of failures the fuzz suite (tests/test_fuzz.py) found outside issue 10's list.

Each compares with the unmarked model, bitwise; a typed error that the README documents
(``fuzz_models.DOCUMENTED_ERRORS``) is a correct outcome too.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from tests import fuzz_models as fm
from tests._harness import bitwise_equal


class ReadsThenWritesInput(nn.Module):
    """Reads its input, writes it in place, reads it again: legal without marks."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        a = torch.exp(x)  # saves its result, not x
        x.mul_(0.5)
        return self.fc(a * 0.1 + x)


class WritesInput(nn.Module):
    """Writes its input in place, then uses it: legal without marks."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        x.mul_(0.5)
        return self.fc(x)


class Net(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), block

    def forward(self, x):
        return self.b(self.a(x))


def _grads_or_refusal(model: nn.Module, run) -> list | None:
    """Gradients after one step; None when remat refused the model with a documented error."""
    try:
        run(model).square().sum().backward()
    except (remat.RecomputeError, TypeError, ValueError) as err:
        if fm._documented(err) is None:
            raise
        return None  # a clear, documented refusal is a correct outcome too
    return [p.grad for p in model.parameters() if p.requires_grad]


def _bitwise_equal_unless_refused(a: list, b: list | None) -> bool:
    """``b`` equals ``a`` bit for bit, or remat refused the model with a documented error."""
    return b is None or bitwise_equal(a, b)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_region_that_reads_then_writes_its_input(use_reentrant):
    """Silent with use_reentrant=True (the re-run starts from the written input, so
    ``exp(x)`` is rebuilt as ``exp(x / 2)`` and ``b.fc.weight.grad`` is wrong);
    a RuntimeError in backward with use_reentrant=False."""
    torch.manual_seed(0)
    base = Net(ReadsThenWritesInput())
    base.a.requires_grad_(False)  # the region's input does not require grad
    marked = copy.deepcopy(base)
    remat.recompute_module(marked.b, use_reentrant=use_reentrant)
    x = torch.randn(3, 4)
    assert _bitwise_equal_unless_refused(_grads_or_refusal(base, lambda m: m(x)), _grads_or_refusal(marked, lambda m: m(x)))


@pytest.mark.parametrize("context", [False, True])
def test_marked_module_writing_its_input_inside_a_checkpoint(context):
    """Fuzz case 1035, silent: the inner region's input, rebuilt by the outer region, is
    the value before the write; the inner re-run drops the write (NOTE [No double state
    updates]) and ``b.fc`` sees ``x`` instead of ``x / 2``: ``b.fc.weight.grad`` doubles."""
    torch.manual_seed(0)
    base = Net(WritesInput())
    marked = copy.deepcopy(base)
    remat.recompute_module(marked.b)
    x = torch.randn(3, 4)
    kwargs = {"context_fn": remat.policy_context(remat.save_compute_intensive)} if context else {}
    expected = _grads_or_refusal(base, lambda m: m(x))
    got = _grads_or_refusal(marked, lambda m: remat.checkpoint(m, x, use_reentrant=False, **kwargs))
    assert _bitwise_equal_unless_refused(expected, got)


@pytest.mark.parametrize("mutate", [False, True])
def test_torch_selective_contexts_run_by_remats_policy_engine(mutate):
    """Fuzz case 1104: torch's ``create_selective_checkpoint_contexts`` as ``context_fn`` kept
    torch's limits ("Trying to backward an extra time" on a second backward; "has been
    mutated" after an in-place write to a kept output). remat now runs its policy function
    in its own engine: both work and match the unmarked model, bitwise."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy_fn(ctx, op, *args, **kwargs):
        keep = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    x0 = torch.randn(3, 4)
    context_fn = functools.partial(create_selective_checkpoint_contexts, policy_fn)

    def run(marked):
        model = copy.deepcopy(block)
        x = x0.clone().requires_grad_()
        if marked:
            out = remat.checkpoint(model, x, use_reentrant=False, context_fn=context_fn)
        else:
            out = model(x)
        if mutate:
            out = out.mul_(2)  # a write to the output of a kept addmm
        loss = out.pow(2).sum()
        loss.backward(retain_graph=True)
        first = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
        loss.backward()
        return first + [p.grad for p in model.parameters()] + [x.grad]

    want, got = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


class GatedBlock(nn.Module):
    """``act(fc(x)) + gate``, its weight frozen: unmarked, autograd saves nothing of ``x``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.fc.weight.requires_grad_(False)

    def forward(self, x, gate):
        return torch.nn.functional.gelu(self.fc(x)) + gate


class WritesItsInputAfterACheckpoint(nn.Module):
    """A checkpointed block reads the input, then the model writes it in place (``relu_``)."""

    def __init__(self, checkpoint: bool) -> None:
        super().__init__()
        self.block, self.fc, self.checkpoint = GatedBlock(), nn.Linear(6, 6), checkpoint

    def forward(self, x):
        if self.checkpoint:
            h = remat.checkpoint(self.block, x, x, use_reentrant=False, early_stop=False)
        else:
            h = self.block(x, x)
        return h, self.fc(torch.relu_(x))


@pytest.mark.parametrize("outer", [False, True], ids=["checkpoint alone", "inside an output_recompute region"])
def test_a_checkpoint_whose_input_is_written_later_is_refused_even_inside_a_region(outer):
    """Shared fuzzer case 931425: inside a region that writes its own input (the model, marked
    output_recompute, runs ``relu_`` on it), the region kept the checkpoint's saved input at
    the version it had when kept, after the write, so the checkpoint re-ran on the written
    value: bias gradient off by 0.9, silently. It is stale as autograd's own saved tensors are."""

    def step(model):
        torch.manual_seed(0)
        h, o = model(torch.randn(3, 6, 6))
        ((h * torch.tanh(h)).sum() + o.pow(2).mean()).backward()
        return model.block.fc.bias.grad

    torch.manual_seed(0)
    unmarked = WritesItsInputAfterACheckpoint(checkpoint=False)
    marked = WritesItsInputAfterACheckpoint(checkpoint=True)
    marked.load_state_dict(unmarked.state_dict())
    if outer:
        remat.recompute_module(marked, output_recompute=True)
    assert step(unmarked) is not None  # legal without marks
    with pytest.raises(remat.RecomputeError, match="changed in place after the region ran"):
        step(marked)


class ReadTwiceThenWritten(nn.Module):
    """A marked MLP called twice (on x, then on its own output h), then ``relu_`` on h: with
    fc1's weight frozen, nothing unmarked saves h, so the unmarked model trains."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        self.fc = nn.Linear(8, 8)
        self.mlp[0].weight.requires_grad_(False)

    def forward(self, x):
        h = self.mlp(x)
        again = self.mlp(h)
        return self.fc(torch.relu_(h)), again


@pytest.mark.parametrize("outer", [False, True], ids=["region alone", "inside an output_recompute region"])
def test_a_region_input_written_later_in_the_outer_re_run_is_refused(outer):
    """Shared fuzzer case 960800: the outer output_recompute region's re-run rebuilt h, the
    inner region saved it, and the re-run's ``relu_`` then changed it before the inner
    region's re-run read it: fc2's weight gradient off by 0.88, silently. Alone, the inner
    region refuses (its input changed in place); inside the outer one it must refuse too
    (NOTE [Rebuilt tensors keep their version])."""

    def step(model):
        torch.manual_seed(0)
        out, again = model(torch.randn(3, 4, 8))
        (out.pow(2).mean() + again.sum()).backward()

    torch.manual_seed(0)
    unmarked = ReadTwiceThenWritten()
    marked = copy.deepcopy(unmarked)
    remat.recompute_module(marked.mlp)
    if outer:
        remat.recompute_module(marked, output_recompute=True)
    step(unmarked)  # legal without marks
    with pytest.raises(remat.RecomputeError, match="changed in place"):
        step(marked)


class ConvNormTransposed(nn.Module):
    """A convolution over time, a batch norm, SiLU, and the result handed back transposed: a view."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv1d(d, d, 3, padding=1), nn.BatchNorm1d(d)

    def forward(self, x):
        return F.silu(self.bn(self.conv(x.transpose(1, 2)))).transpose(1, 2)


@pytest.mark.parametrize("written", [False, True])
@pytest.mark.parametrize("reentrant", [True, False])
def test_a_view_output_changed_in_place_after_the_region_back_propagates_bitwise(reentrant, written):
    # shared fuzz case 981970: under use_reentrant=True the region hands back a detached alias
    # of its view output; changed in place, the unmarked model's CopySlices gives the batch
    # norm's backward its gradient in the base's layout, the region gave it the view's: other
    # sums (a relative 4e-2 on the convolution's bias). NOTE [Views changed after the region]
    torch.manual_seed(0)
    pre, block = nn.Linear(6, 6), ConvNormTransposed()
    x = torch.randn(2, 6, 6)

    def run(mark: bool) -> list:
        p, b = copy.deepcopy(pre), copy.deepcopy(block)
        xi = x.clone().requires_grad_()
        h = p(xi)
        out = remat.recompute(b, h, use_reentrant=reentrant) if mark else b(h)
        if written:
            out.add_(1.0)
        (out * torch.linspace(0.5, 1.5, out.numel()).view_as(out)).sum().backward()
        return [t.grad for t in (*p.parameters(), *b.parameters(), xi)] + list(b.buffers())

    assert bitwise_equal(run(False), run(True))
