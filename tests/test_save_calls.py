"""Per-call policies (``remat.save_calls``): the per-operator choices of ``remat.plan``.

Each test compares with the unmarked model bit for bit and counts what recomputation
re-ran: the eager engine and the graph pass must keep the same calls.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat._vocab.policy import parse_call_key, policy_from_name
from tests._harness import assert_bitwise_equal


def _block(dropout: float = 0.0) -> torch.nn.Sequential:
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Dropout(dropout),
        torch.nn.Linear(16, 16), torch.nn.GELU(),
        torch.nn.Linear(16, 8), torch.nn.GELU())


def _net(dropout: float = 0.0) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(_block(dropout), _block(dropout))


class _CountAddmm(TorchDispatchMode):
    """Counts ``aten::addmm`` calls: in backward, only recomputation runs it (gradients use mm)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.addmm.default:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _grads(model: torch.nn.Module, x: torch.Tensor, forward=None) -> list[torch.Tensor]:
    torch.manual_seed(1)
    (forward or model)(x).sum().backward()
    return [p.grad for p in model.parameters()] + [x.grad]


# --- the vocabulary ------------------------------------------------------------------


def test_a_call_policy_prints_sorted_and_reads_back_from_its_name():
    p = remat.save_calls("aten::mm#2", "aten::addmm.default#0")
    assert repr(p) == "save_calls('aten::addmm#0', 'aten::mm#2')"
    assert policy_from_name(p.name) == p
    assert policy_from_name(remat.save_only("aten::mm").name) == remat.save_only("aten::mm")
    assert policy_from_name("save_compute_intensive") is remat.save_compute_intensive
    assert (p.saves("aten::mm"), p.saves("aten::relu")) == (True, False)
    assert (p.saves_call("aten::mm", 2), p.saves_call("aten::mm", 1)) == (True, False)


@pytest.mark.parametrize("key", ["aten::mm", "mm#0", "aten::mm#x", "aten::mm#-1", ""])
def test_a_malformed_call_key_is_refused_with_its_form(key):
    with pytest.raises(ValueError, match=r"remat.save_calls: a call key looks like 'aten::mm#0'"):
        remat.save_calls(key)


def test_a_repeated_call_key_and_an_unknown_name_are_refused():
    with pytest.raises(ValueError, match="repeated"):
        remat.save_calls("aten::mm#0", "aten::mm.default#0")
    with pytest.raises(ValueError, match="no policy is named 'keep_some'"):
        policy_from_name("keep_some")
    assert parse_call_key("aten::bmm#12") == ("aten::bmm", 12)


# --- eager ---------------------------------------------------------------------------


@pytest.mark.parametrize("kept", [(), (0,), (1,), (0, 2), (0, 1, 2)])
@pytest.mark.parametrize("front", ["cell", "checkpoint"])
def test_eager_keeps_exactly_the_calls_named(kept, front):
    """Block 0's three products: recomputation re-runs those not named, gradients unchanged."""
    net, x = _net(dropout=0.25), torch.randn(4, 8)
    expected = _grads(copy.deepcopy(net), x.clone().requires_grad_())
    marked = copy.deepcopy(net)
    policy = remat.save_calls(*[f"aten::addmm#{k}" for k in kept])
    forward = None
    if front == "cell":
        remat.recompute_module(marked[0], policy=policy)
    else:
        def forward(t):
            h = remat.checkpoint(marked[0], t, use_reentrant=False,
                                 context_fn=remat.policy_context(policy))
            return marked[1](h)
    x2 = x.clone().requires_grad_()
    torch.manual_seed(1)
    loss = (forward or marked)(x2).sum()
    counter = _CountAddmm()
    with counter:
        loss.backward()
    assert counter.calls == 3 - len(kept)
    assert_bitwise_equal([p.grad for p in marked.parameters()] + [x2.grad], expected)


def test_calls_are_counted_per_region_and_across_overloads():
    """Two marked blocks each count from 0; ``aten::addmm#1`` keeps the second product of each."""
    net, x = _net(), torch.randn(4, 8)
    for block in net:
        remat.recompute_module(block, policy=remat.save_calls("aten::addmm#1"))
    loss = net(x.requires_grad_()).sum()
    counter = _CountAddmm()
    with counter:
        loss.backward()
    assert counter.calls == 4


# --- graph mode ----------------------------------------------------------------------


@pytest.mark.parametrize("kept", [(0,), (1,), (2,), (0, 1)])
def test_the_graph_pass_keeps_the_calls_eager_keeps(kept):
    """The copies the pass puts in backward are the products the policy does not name (the
    last product's output feeds a GELU's backward, so it is rebuilt unless kept); gradients
    bit for bit those of the same model compiled unmarked, dropout included."""
    net, x = _net(dropout=0.25), torch.randn(4, 8)
    plain = remat.compile(copy.deepcopy(net))
    expected = _grads(plain, x.clone().requires_grad_())
    marked_net = copy.deepcopy(net)
    remat.recompute_module(marked_net[0], policy=remat.save_calls(*[f"aten::addmm#{k}" for k in kept]))
    marked = remat.compile(marked_net)
    got = _grads(marked_net, x.clone().requires_grad_(), forward=marked)
    assert_bitwise_equal(got[:-1], expected[:-1])
    copies = sorted(where for _, op, where in marked.remat_reports[0].duplicated if op == "aten::addmm")
    linears = ["0.0 (Linear)", "0.3 (Linear)", "0.5 (Linear)"]
    assert copies == [name for k, name in enumerate(linears) if k not in kept]


class _TwoDraws(torch.nn.Module):
    """Two random operators in a row (``native_dropout``, as CUDA's dropout runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.native_dropout(self.fc(x), 0.5, True)[0]
        return (torch.native_dropout(a.sin(), 0.5, True)[0] * 3).cos()


def _keep_first_draw(model: torch.nn.Module, how: str):
    """Mark ``model[0]`` to keep its first random operator's output, ``how`` the front end says;
    return the forward to run."""
    import functools

    if how == "save_calls":
        remat.recompute_module(model[0], policy=remat.save_calls("aten::native_dropout#0"))
        return model
    first = []

    def policy(ctx, op, *args, **kwargs):  # keep the first draw only
        keep = op is torch.ops.aten.native_dropout.default and not first
        first.append(keep) if keep else None
        return remat.CheckpointPolicy.MUST_SAVE if keep else remat.CheckpointPolicy.PREFER_RECOMPUTE

    context = functools.partial(remat.create_selective_checkpoint_contexts, policy)

    def forward(x: torch.Tensor) -> torch.Tensor:
        first.clear()
        return model[1](remat.checkpoint(model[0], x, use_reentrant=False, context_fn=context))

    return forward


@pytest.mark.parametrize("how, compiled", [("save_calls", False), ("save_calls", True), ("policy_fn", False)])
def test_a_kept_random_operator_leaves_the_later_draws_as_forward_made_them(how, compiled):
    """NOTE [Kept random operators]: keeping a dropout's output while the next dropout of the
    region is rebuilt once drew other numbers in recomputation (the kept one did not draw):
    gradients silently wrong in eager mode. Bitwise equal to unmarked now, eager and compiled."""
    def make() -> torch.nn.Sequential:
        torch.manual_seed(0)
        return torch.nn.Sequential(_TwoDraws(), _TwoDraws())

    x = torch.randn(4, 16)

    def grads(model, forward) -> list[torch.Tensor]:
        torch.manual_seed(5)
        forward(x).sum().backward()
        return [p.grad for p in model.parameters()]

    plain = make()
    expected = grads(plain, plain)
    model = make()
    forward = _keep_first_draw(model, how)
    if compiled:
        forward = remat.compile(model)
    assert_bitwise_equal(grads(model, forward), expected)


class _Unbiased(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)  # 3-D input: mm, then _unsafe_view (a version counter of its own)
        h.add_(1.0)  # in place through the alias, after the kept mm
        return (self.b(h.tanh()) * h).sum()


@pytest.mark.parametrize("policy", [remat.save_compute_intensive, remat.save_calls("aten::mm#0")])
def test_a_kept_output_changed_through_an_alias_with_its_own_version_is_rebuilt(policy):
    """NOTE [Aliases with a version of their own]: the kept mm output's version did not move when
    the Linear's _unsafe_view alias was changed in place, and recomputation handed back the
    changed values (the independent fuzzer's seed 70324): wrong gradients. Now bitwise equal."""
    def grads(mark: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = _Unbiased()
        if mark:
            remat.recompute_module(model, policy=policy)
        x = torch.randn(2, 3, 4, requires_grad=True)
        model(x).backward()
        return [p.grad for p in model.parameters()] + [x.grad]

    assert_bitwise_equal(grads(True), grads(False))
