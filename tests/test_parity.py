"""Drop-in parity with torch.utils.checkpoint (torch 2.13): every public name, the global
switches, GraphExecGroup, selective checkpointing, and torch's own checkpoint tests
(test/test_autograd.py, test/test_utils.py) ported to run against remat, with torch's
error messages in ``pytest.raises(match=...)``.

Each behaviour is checked against a baseline: the run without checkpointing (bitwise), and
where torch defines the behaviour, torch's checkpoint run the same way.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings

import pytest
import torch
import torch.utils.checkpoint as tuc

import remat
from tests._harness import bitwise_equal

torch_ctx = tuc  # torch's context managers and types, read by the tests only


def output_and_grads(fn, *inputs):
    """Output and gradients of ``fn(*inputs).sum()`` with respect to the inputs that need them."""
    out = fn(*inputs)
    wrt = [t for t in inputs if t.requires_grad]
    return out.detach(), torch.autograd.grad(out.sum(), wrt)


# --- every public name --------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(tuc.__all__))
def test_remat_has_every_public_name_of_torch_checkpoint(name):
    assert name in remat.__all__, f"from remat import {name} fails"
    ours, theirs = getattr(remat, name), getattr(tuc, name)
    if name == "SAC_IGNORED_OPS":
        assert set(theirs) <= set(ours)
        return
    assert ours is not theirs, f"remat.{name} re-exports torch's instead of running on remat"
    if callable(theirs) and not isinstance(theirs, type):
        # same parameters (names, kinds and defaults), so every call written for torch works
        p_ours = inspect.signature(ours).parameters
        p_theirs = inspect.signature(theirs).parameters
        assert list(p_ours) == list(p_theirs)
        assert [p.kind for p in p_ours.values()] == [p.kind for p in p_theirs.values()]
        defaults = {k: p.default for k, p in p_ours.items() if k != "context_fn"}
        assert defaults == {k: p.default for k, p in p_theirs.items() if k != "context_fn"}


def test_the_product_never_calls_torch_checkpoint(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("remat called torch.utils.checkpoint")

    for name in ("checkpoint", "checkpoint_sequential", "_checkpoint_without_reentrant_generator",
                 "create_selective_checkpoint_contexts"):
        monkeypatch.setattr(tuc, name, refuse)
    monkeypatch.setattr(tuc.CheckpointFunction, "apply", refuse)
    x = torch.randn(3, 4, requires_grad=True)
    lin = torch.nn.Linear(4, 4)
    ctx = functools.partial(remat.create_selective_checkpoint_contexts, [torch.ops.aten.addmm.default])
    for use_reentrant in (False, True):
        remat.checkpoint(lin, x, use_reentrant=use_reentrant).sum().backward()
    remat.checkpoint(lin, x, use_reentrant=False, context_fn=ctx).sum().backward()
    remat.CheckpointFunction.apply(lin, True, x).sum().backward()
    with remat.GraphExecGroup(), remat.set_checkpoint_early_stop(False), \
            remat.set_checkpoint_debug_enabled(True):
        remat.checkpoint_sequential(torch.nn.Sequential(lin, torch.nn.Linear(4, 4)), 2, x, use_reentrant=False).sum().backward()


def test_engine_errors_are_torch_checkpoint_errors():
    calls = []

    def fn(x):
        calls.append(1)
        h = x * 2  # saved by sin: rebuilt (the argument itself would be read back)
        return h.sin() if len(calls) == 1 else h[:2].sin()  # a different shape when re-run

    y = remat.checkpoint(fn, torch.ones(3, requires_grad=True), use_reentrant=False)
    with pytest.raises(tuc.CheckpointError) as caught:
        y.sum().backward()
    assert isinstance(caught.value, remat.CheckpointError)
    assert isinstance(caught.value, remat.RecomputeError)
    assert remat.CheckpointError is remat.RecomputeError


# --- torch's test_autograd.py: test_checkpoint_detects_non_determinism -------------------


def _save_3_tensors(x):
    return x.sin().exp().sin()


def _save_2_tensors(x):
    return x.sin().exp()


def _save_2_tensors_alt(x):
    return x.sin() * torch.tensor([1.0, 2.0])


def _non_det(orig_fn, recompute_fn):
    counter = [0]

    def fn(x):
        if counter[0] == 0:
            counter[0] += 1
            return orig_fn(x)
        return recompute_fn(x)

    return fn


EARLY_STOP_OFF = [
    pytest.param(lambda: remat.set_checkpoint_early_stop(False), id="remat"),
    pytest.param(lambda: torch_ctx.set_checkpoint_early_stop(False), id="torch"),
]
DEBUG_ON = [
    pytest.param(lambda: remat.set_checkpoint_debug_enabled(True), id="remat"),
    pytest.param(lambda: torch_ctx.set_checkpoint_debug_enabled(True), id="torch"),
]


def test_fewer_tensors_in_recomputation_raise_torchs_message():
    a = torch.randn(1, requires_grad=True)
    fn = _non_det(_save_3_tensors, _save_2_tensors)
    with pytest.raises(remat.CheckpointError, match="A different number of tensors was saved"):
        remat.checkpoint(fn, a, use_reentrant=False).backward()
    fn = _non_det(_save_3_tensors, _save_2_tensors)
    with pytest.raises(
        remat.CheckpointError,
        match="number of tensors saved during the original forward and recomputation: 3 and 2",
    ):
        remat.checkpoint(fn, a, use_reentrant=False).backward()


@pytest.mark.parametrize("early_stop_off", EARLY_STOP_OFF)
def test_more_tensors_in_recomputation_raise_only_without_early_stop(early_stop_off):
    a = torch.randn(1, requires_grad=True)
    fn = _non_det(_save_2_tensors, _save_3_tensors)
    with early_stop_off():
        out = remat.checkpoint(fn, a, use_reentrant=False)
    with pytest.raises(remat.CheckpointError, match="trying to save more tensors during recomputation"):
        out.backward()
    # with early stop (the default) the re-run ends at the last tensor needed: exact, no error
    fn = _non_det(_save_2_tensors, _save_3_tensors)
    (grad,) = torch.autograd.grad(remat.checkpoint(fn, a, use_reentrant=False), a)
    assert torch.equal(grad, torch.autograd.grad(_save_2_tensors(a), a)[0])


def test_metadata_mismatch_raises_torchs_message():
    a = torch.randn(1, requires_grad=True)
    fn = _non_det(_save_2_tensors, _save_2_tensors_alt)
    with pytest.raises(
        remat.CheckpointError,
        match="Recomputed values for the following tensors have different metadata than during "
              "the forward pass",
    ):
        remat.checkpoint(fn, a, use_reentrant=False).backward()


DEBUG_SENTENCE = "You are seeing this error because you passed `debug=True` to checkpoint"


def test_debug_argument_prints_both_traces_with_torchs_sentence():
    a = torch.randn(1, requires_grad=True)
    fn = _non_det(_save_2_tensors, _save_2_tensors_alt)
    with pytest.raises(remat.CheckpointError, match=DEBUG_SENTENCE):
        remat.checkpoint(fn, a, use_reentrant=False, debug=True).backward()


@pytest.mark.parametrize("debug_on", DEBUG_ON)
def test_set_checkpoint_debug_enabled_turns_debug_on_in_forward(debug_on):
    a = torch.randn(1, requires_grad=True)
    fn = _non_det(_save_2_tensors, _save_2_tensors_alt)
    with debug_on():
        out = remat.checkpoint(fn, a, use_reentrant=False, debug=False)
    with pytest.raises(remat.CheckpointError, match=rf"(?s)Operators run in recomputation.*{DEBUG_SENTENCE}"):
        out.backward()  # outside the context: what counts is the forward, as in torch


@pytest.mark.parametrize("ours", [True, False], ids=["remat", "torch"])
def test_set_checkpoint_debug_enabled_false_overrides_debug_argument(ours):
    a = torch.randn(1, requires_grad=True)
    fn = _non_det(_save_2_tensors, _save_2_tensors_alt)
    switch = remat.set_checkpoint_debug_enabled if ours else torch_ctx.set_checkpoint_debug_enabled
    with switch(False):
        out = remat.checkpoint(fn, a, use_reentrant=False, debug=True)
    with pytest.raises(remat.CheckpointError) as caught:
        out.backward()
    assert "Recomputed values for the following tensors have different" in str(caught.value)
    assert DEBUG_SENTENCE not in str(caught.value)


def test_global_debug_refuses_context_fn_like_torch():
    x = torch.randn(2, requires_grad=True)
    ctx = functools.partial(remat.create_selective_checkpoint_contexts, [torch.ops.aten.sin.default])
    for switch in (remat.set_checkpoint_debug_enabled, torch_ctx.set_checkpoint_debug_enabled):
        with switch(True), pytest.raises(ValueError, match="debug=True is incompatible with non-default context_fn"):
            remat.checkpoint(torch.sin, x, use_reentrant=False, context_fn=ctx)
    # torch's noop_context_fn is the default context too
    remat.checkpoint(torch.sin, x, use_reentrant=True, context_fn=tuc.noop_context_fn).sum().backward()


def test_switches_reject_non_bools_and_restore_on_exit():
    with pytest.raises(TypeError, match=r"remat.set_checkpoint_early_stop: 'enable' must be a bool"), \
            remat.set_checkpoint_early_stop("no"):
        pass
    with pytest.raises(TypeError, match=r"remat.set_checkpoint_debug_enabled: 'enabled' must be a bool"), \
            remat.set_checkpoint_debug_enabled(1):
        pass
    from remat._engine import flags

    with remat.set_checkpoint_early_stop(False), remat.set_checkpoint_debug_enabled(True):
        assert (flags._early_stop, flags._debug) == (False, True)
    assert (flags._early_stop, flags._debug) == (None, None)


# --- early stop: how far a re-run goes, against torch ----------------------------------


def _count_tail_runs(checkpoint_fn, switch):
    """How many times the code after the last saved tensor ran (forward + re-runs)."""
    tail = []

    def fn(x):
        y = x.sin().cos()
        tail.append(1)  # after the last save: an early-stopped re-run never gets here
        return y

    x = torch.randn(3, requires_grad=True)
    with switch():
        out = checkpoint_fn(fn, x, use_reentrant=False)
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert torch.equal(grad, torch.autograd.grad(fn(x).sum(), x)[0])
    return len(tail) - 1  # minus the baseline call just above


@pytest.mark.parametrize("ours_switch", [remat.set_checkpoint_early_stop, tuc.set_checkpoint_early_stop],
                         ids=["remat", "torch"])
@pytest.mark.parametrize("enable", [True, False])
def test_early_stop_switch_matches_torch(ours_switch, enable):
    ours = _count_tail_runs(remat.checkpoint, lambda: ours_switch(enable))
    theirs = _count_tail_runs(tuc.checkpoint, lambda: tuc.set_checkpoint_early_stop(enable))
    assert ours == theirs == (1 if enable else 2)  # the tail re-runs only without early stop


def test_early_stop_switch_applies_to_marked_modules():
    tail = []

    class Block(torch.nn.Module):
        def forward(self, x):
            y = x.sin().cos()
            tail.append(1)
            return y

    block = remat.recompute_module(Block())
    x = torch.randn(3, requires_grad=True)
    block(x).sum().backward()
    assert len(tail) == 1
    with remat.set_checkpoint_early_stop(False):
        out = block(x)
    out.sum().backward()
    assert len(tail) == 3


# --- GraphExecGroup -----------------------------------------------------------------


def _two_part_backward(checkpoint_fn, group_cls, x):
    """Backward through z -> y, then y -> x, as two calls; return re-runs and the grad."""
    runs = []

    def fn(x):
        runs.append(1)
        y = x.sin().cos()
        return y, y.sin().cos()

    y, z = checkpoint_fn(fn, x, use_reentrant=False)
    with group_cls() if group_cls is not None else contextlib.nullcontext():
        (gy,) = torch.autograd.grad(z.sum(), y, retain_graph=True)
        (gx,) = torch.autograd.grad(y, x, gy + 1.0)
    return len(runs) - 1, gx


@pytest.mark.parametrize("group_cls", [None, remat.GraphExecGroup, tuc.GraphExecGroup],
                         ids=["none", "remat", "torch"])
def test_graph_exec_group_reruns_once_for_all_its_backward_calls(group_cls):
    x = torch.randn(4, requires_grad=True)
    reruns, grad = _two_part_backward(remat.checkpoint, group_cls, x)
    torch_reruns, torch_grad = _two_part_backward(tuc.checkpoint, group_cls, x)
    plain_reruns, plain_grad = _two_part_backward(lambda f, t, use_reentrant: f(t), None, x)
    assert reruns == torch_reruns == (2 if group_cls is None else 1) and plain_reruns == 0
    assert torch.equal(grad, plain_grad) and torch.equal(grad, torch_grad)


@pytest.mark.parametrize("group_cls", [remat.GraphExecGroup, tuc.GraphExecGroup], ids=["remat", "torch"])
def test_graph_exec_group_detects_overlapping_backward_calls(group_cls):
    x = torch.randn(4, requires_grad=True)
    y = remat.checkpoint(lambda t: t.sin().cos(), x, use_reentrant=False)
    with group_cls():
        torch.autograd.grad(y.sum(), x, retain_graph=True)
        with pytest.raises(tuc.CheckpointError, match="Performing two backward calls that overlap"):
            torch.autograd.grad(y.sum(), x)
    # outside a group the same two calls re-run twice and both are exact
    g1 = torch.autograd.grad(y.sum(), x, retain_graph=True)
    assert bitwise_equal(g1, torch.autograd.grad(y.sum(), x))


def test_graph_exec_groups_do_not_nest_across_libraries():
    for outer, inner in [(remat.GraphExecGroup, tuc.GraphExecGroup),
                         (tuc.GraphExecGroup, remat.GraphExecGroup),
                         (remat.GraphExecGroup, remat.GraphExecGroup)]:
        with outer(), pytest.raises(RuntimeError, match="GraphExecGroup contexts cannot be nested"), inner():
            pass
        assert torch._C._get_graph_exec_group() is None


# --- selective checkpointing -----------------------------------------------------------


def _sac_fn(x, y):
    return torch.matmul(torch.matmul(x, y).sin().cos(), y)


def _policy(enum):
    def policy_fn(ctx, op, *args, **kwargs):
        if op == torch.ops.aten.mm.default:
            return enum.MUST_SAVE
        return enum.PREFER_RECOMPUTE

    return policy_fn


POLICIES = {
    "remat_enum": _policy(remat.CheckpointPolicy),
    "torch_enum": _policy(tuc.CheckpointPolicy),
    "bool": lambda ctx, op, *a, **k: op == torch.ops.aten.mm.default,
    "list": [torch.ops.aten.mm.default],
}


@pytest.mark.parametrize("policy", list(POLICIES), ids=list(POLICIES))
@pytest.mark.parametrize("make", ["remat", "torch"])
def test_selective_contexts_save_what_torch_saves_and_give_bitwise_gradients(policy, make):
    torch.manual_seed(0)
    x = torch.randn(64, 64, requires_grad=True)
    y = torch.randn(64, 64, requires_grad=True)
    create = remat.create_selective_checkpoint_contexts if make == "remat" else tuc.create_selective_checkpoint_contexts
    context_fn = functools.partial(create, POLICIES[policy])

    def run(checkpoint_fn):
        return lambda: checkpoint_fn(_sac_fn, x, y, use_reentrant=False, context_fn=context_fn).sum()

    base_bytes = remat.memory.saved_bytes(lambda: _sac_fn(x, y).sum())
    ours_bytes = remat.memory.saved_bytes(run(remat.checkpoint))
    torch_bytes = remat.memory.saved_bytes(run(tuc.checkpoint))
    block = 64 * 64 * 4
    assert base_bytes == 3 * block  # mm, sin and cos outputs
    assert ours_bytes == torch_bytes == 2 * block  # the two mm outputs; sin and cos are rebuilt
    base = output_and_grads(_sac_fn, x, y)
    ours = output_and_grads(lambda a, b: remat.checkpoint(_sac_fn, a, b, use_reentrant=False, context_fn=context_fn), x, y)
    assert torch.equal(ours[0], base[0]) and bitwise_equal(ours[1], base[1])


def test_policy_function_is_asked_in_forward_only_with_a_context():
    asked = []

    def policy_fn(ctx, op, *args, **kwargs):
        asked.append((op, ctx.is_recompute, type(ctx)))
        assert isinstance(ctx, tuc.SelectiveCheckpointContext)
        assert isinstance(ctx.op_output, torch.Tensor)
        return remat.CheckpointPolicy.PREFER_RECOMPUTE

    x = torch.randn(4, 4, requires_grad=True)
    context_fn = functools.partial(remat.create_selective_checkpoint_contexts, policy_fn)
    out = remat.checkpoint(lambda t: t.sin().cos(), x, use_reentrant=False, context_fn=context_fn)
    in_forward = list(asked)
    out.sum().backward()
    assert [op for op, _, _ in in_forward] == [torch.ops.aten.sin.default, torch.ops.aten.cos.default]
    assert asked == in_forward  # nothing asked in recomputation
    assert all(not r and t is remat.SelectiveCheckpointContext for _, r, t in asked)


def test_create_selective_checkpoint_contexts_rejects_bad_input_with_torchs_message():
    with pytest.raises(ValueError, match=r"Expected op in `op_list` to be an OpOverload.*torch.ops.aten.mm.default"):
        remat.create_selective_checkpoint_contexts([torch.ops.aten.mm])
    with pytest.raises(TypeError, match="policy_fn_or_list must be either a function or a list of ops"):
        remat.create_selective_checkpoint_contexts(3)
    context_fn = functools.partial(remat.create_selective_checkpoint_contexts, lambda ctx, op, *a, **k: "save")
    with pytest.raises(TypeError, match=r"returned 'save'; return a CheckpointPolicy"):
        remat.checkpoint(torch.sin, torch.randn(2, requires_grad=True), use_reentrant=False, context_fn=context_fn)


def test_selective_contexts_accept_a_remat_policy():
    x = torch.randn(64, 64, requires_grad=True)
    y = torch.randn(64, 64, requires_grad=True)
    by_policy = functools.partial(remat.create_selective_checkpoint_contexts, remat.save_only("aten::mm"))
    by_list = functools.partial(remat.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    sizes = [remat.memory.saved_bytes(lambda c=c: remat.checkpoint(_sac_fn, x, y, use_reentrant=False,
                                                                   context_fn=c).sum())
             for c in (by_policy, by_list)]
    assert sizes[0] == sizes[1]


def test_checkpoint_policy_members_equal_torchs():
    for ours in remat.CheckpointPolicy:
        theirs = tuc.CheckpointPolicy[ours.name]
        assert ours == theirs and theirs == ours and hash(ours) == hash(theirs)
        assert {theirs: 1}[ours] == 1
        assert [o for o in tuc.CheckpointPolicy if o != ours] == [o for o in tuc.CheckpointPolicy if o is not theirs]


# --- torch's test_autograd.py: saved object identity, unpacking twice ------------------


def test_custom_function_gets_the_saved_region_input_itself():
    """Port of test_checkpointing_without_reentrant_saved_object_identity."""
    seen = []

    class Test(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            ctx.save_for_backward(y)
            return x

        @staticmethod
        def backward(ctx, g):
            seen.append(ctx.saved_tensors[0])
            return g, None

    a = torch.tensor(2.0, requires_grad=True)
    b = torch.tensor(2.0, requires_grad=False)
    Test.apply(a, b).backward()  # baseline: no region
    remat.checkpoint(Test.apply, a, b, use_reentrant=False).backward()
    tuc.checkpoint(Test.apply, a, b, use_reentrant=False).backward()
    assert [s is b for s in seen] == [True, True, True]


def test_unpacking_a_saved_tensor_twice_raises_torchs_message():
    """Port of test_checkpointing_without_reentrant_custom_function_works."""
    msg = "Unpack is being triggered for a tensor that was already unpacked once"
    raised = []

    class MyFunc(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y, z):
            w = x * y * z
            out = w + w
            ctx.save_for_backward(x, y, z, w, out)
            return out

        @staticmethod
        def backward(ctx, grad_out):
            x, y, z, _, _ = ctx.saved_tensors
            if remat.is_recomputing() or raised == ["in region"]:
                with pytest.raises(RuntimeError, match=msg):
                    ctx.saved_tensors  # noqa: B018 - the second unpack is the point
                raised.append(True)
            return x, y, z

    def foo(x, y, z):
        return MyFunc.apply(x * y * z, y * y * z, z * z)

    inputs = [torch.tensor(v, requires_grad=True) for v in (1.0, 2.0, 3.0)]
    expected = torch.autograd.grad(foo(*inputs).sum(), inputs)  # baseline: unpacks once
    raised.append("in region")
    got = torch.autograd.grad(remat.checkpoint(foo, *inputs, use_reentrant=False).sum(), inputs)
    assert raised == ["in region", True] and bitwise_equal(got, expected)


def test_reentrant_grad_works_where_torch_raises():
    """torch's reentrant checkpoint refuses ``torch.autograd.grad``; remat's observes what
    the region reads (NOTE [Observed reads]), even through a callable object, and is exact."""
    lin = torch.nn.Linear(4, 4)

    class Opaque:  # a callable object: neither a module nor a function
        def __call__(self, t):
            return lin(t)

    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"incompatible with \.grad\(\)"):
        torch.autograd.grad(tuc.checkpoint(Opaque(), x, use_reentrant=True).sum(), x)
    want = torch.autograd.grad(lin(x).sum(), [x, *lin.parameters()])
    got = torch.autograd.grad(remat.checkpoint(Opaque(), x, use_reentrant=True).sum(),
                              [x, *lin.parameters()])
    assert bitwise_equal(list(got), list(want))


# --- torch's test_utils.py: TestCheckpoint --------------------------------------------


def test_checkpoint_valid_non_reentrant_grads_equal():
    """Port of TestCheckpoint.test_checkpoint_valid (its use_reentrant=False half)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(100, 50), torch.nn.ReLU(), torch.nn.Linear(50, 20),
                                torch.nn.ReLU(), torch.nn.Linear(20, 5), torch.nn.ReLU())
    x = torch.randn(1, 100, requires_grad=True)
    out = model(x)
    expected = torch.autograd.grad([out], [x], [torch.ones(1, 5)], create_graph=True)
    out_ck = remat.checkpoint_sequential(list(model.children()), 2, x, use_reentrant=False)
    assert torch.equal(out_ck, out)
    got = torch.autograd.grad([out_ck], [x], [torch.ones(1, 5)], create_graph=True)
    assert bitwise_equal(got, expected)


def test_checkpoint_function_apply_matches_torch():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)

    def grads(fn):
        lin.zero_grad()
        x.grad = None
        fn().sum().backward()
        return [x.grad.clone(), lin.weight.grad.clone(), lin.bias.grad.clone()]

    plain = grads(lambda: lin(x))
    assert bitwise_equal(grads(lambda: remat.CheckpointFunction.apply(lin, True, x)), plain)
    assert bitwise_equal(grads(lambda: tuc.CheckpointFunction.apply(lin, True, x)), plain)


def test_helpers_behave_like_torchs():
    x = torch.ones(2, requires_grad=True) * 3
    for ours, theirs in zip(remat.detach_variable((x, 4)), tuc.detach_variable((x, 4)), strict=True):
        if isinstance(ours, torch.Tensor):
            assert torch.equal(ours, theirs) and ours.requires_grad == theirs.requires_grad
            assert ours.grad_fn is None and ours is not x
        else:
            assert ours == theirs
    with pytest.raises(RuntimeError, match="Only tuple of tensors is supported"):
        remat.detach_variable([x])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        remat.check_backward_validity([torch.ones(1)])
        tuc.check_backward_validity([torch.ones(1)])
        remat.check_backward_validity([x])
    assert [str(w.message) for w in caught][:1] * 2 == [str(w.message) for w in caught]
    assert remat.get_device_states(torch.ones(2), [torch.ones(1)]) == tuc.get_device_states(torch.ones(2))
    remat.set_device_states([], [])
    before = remat.DefaultDeviceType.get_device_type()
    assert before == tuc.DefaultDeviceType.get_device_type()
    remat.DefaultDeviceType.set_device_type("meta")
    assert remat.DefaultDeviceType.get_device_type() == "meta"
    remat.DefaultDeviceType.set_device_type(before)
    fwd, rec = remat.noop_context_fn()
    with fwd, rec:
        pass


# --- more of torch's checkpoint tests (test_autograd.py, test_utils.py), against remat ---------


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_correct_grad(use_reentrant):
    """Port of test_checkpointing_without_reentrant_correct_grad (both implementations)."""
    a = torch.randn(2, requires_grad=True)
    (expected,) = torch.autograd.grad(torch.exp(a).sum(), a)
    a.grad = None
    remat.checkpoint(torch.exp, a, use_reentrant=use_reentrant).sum().backward()
    assert torch.equal(a.grad, expected)


def test_parameter_used_in_an_out():
    """Port of test_checkpointing_without_reentrant_parameter_used_in_an_out."""
    w = torch.randn(10, 10, requires_grad=True)
    x = torch.randn(10, 10, requires_grad=True)

    def fn(t):
        return torch.matmul(w, t) + torch.matmul(w, w)  # w reached through the closure

    expected = torch.autograd.grad(fn(x).sum(), (w, x))
    got = torch.autograd.grad(remat.checkpoint(fn, x, use_reentrant=False).sum(), (w, x))
    assert bitwise_equal(got, expected)


def test_arbitrary_input_output():
    """Port of test_checkpointing_without_reentrant_arbitrary_input_output."""

    class MyModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(5, 5, bias=False)

        def forward(self, dict_input):
            return {"result": self.layer(dict_input["tensor"])}

    model = MyModel()
    inp = {"tensor": torch.randn(5, 5)}
    plain = model(inp)["result"].sum()
    (expected,) = torch.autograd.grad(plain, model.layer.weight)
    out = remat.checkpoint(model, inp, use_reentrant=False)["result"].sum()
    assert torch.equal(out, plain)
    assert torch.equal(torch.autograd.grad(out, model.layer.weight)[0], expected)


def test_context_fn_runs_forward_and_recomputation_under_its_contexts():
    """Port of test_checkpointing_without_reentrant_with_context_fn."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Verbose(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.operators = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.operators.append(func.__name__)
            return func(*args, **(kwargs or {}))

    x = torch.tensor(1.0, requires_grad=True)
    verbose = Verbose()
    remat.checkpoint(lambda t: t.exp(), x, use_reentrant=False,
                     context_fn=lambda: (verbose, contextlib.nullcontext()))
    assert verbose.operators == ["exp.default"]
    verbose.operators = []
    out = remat.checkpoint(lambda t: t.exp(), x, use_reentrant=False,
                           context_fn=lambda: (contextlib.nullcontext(), verbose))
    assert verbose.operators == []
    out.backward()
    assert [op for op in verbose.operators if op != "detach.default"] == ["exp.default"]
    with pytest.raises(ValueError, match="only supported when use_reentrant=False"):
        remat.checkpoint(lambda t: t.sin(), x, use_reentrant=True,
                         context_fn=lambda: (contextlib.nullcontext(), verbose))


def test_warns_if_use_reentrant_not_passed_explicitly():
    """Port of test_checkpoint(_sequential)_warns_if_use_reentrant_not_passed_explcitly."""
    a = torch.randn(1, 4, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        remat.checkpoint(lambda t: t, a, use_reentrant=False)
        remat.checkpoint_sequential([torch.nn.Identity()], 1, a, use_reentrant=False)
    with pytest.warns(UserWarning, match=".*the use_reentrant parameter should be passed explicitly.*"):
        remat.checkpoint(lambda t: t, a)
    with pytest.warns(UserWarning, match=".*the use_reentrant parameter should be passed explicitly.*"):
        remat.checkpoint_sequential([torch.nn.Identity()], 1, a)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_non_tensor_inputs_and_outputs(use_reentrant):
    """Port of TestCheckpoint.test_checkpoint_non_tensor_inputs_outputs."""

    def foo(t1, t2, scale, t3):
        t4 = t1 + t2 * t3
        t5 = t1 * t2 + t3
        t4 *= scale
        t5 *= scale
        return scale, t4, None, True, t5, "bar", t1

    t1, t2, t3 = (torch.rand(10, requires_grad=True) for _ in range(3))
    res = remat.checkpoint(foo, t1, t2, 3, t3, use_reentrant=use_reentrant)
    plain = foo(t1, t2, 3, t3)
    assert (res[0], res[2], res[3], res[5]) == (3, None, True, "bar")
    assert torch.equal(res[1], plain[1]) and torch.equal(res[4], plain[4]) and torch.equal(res[6], t1)
    got = torch.autograd.grad([res[1].sum(), res[4].sum()], (t1, t2, t3), retain_graph=True)
    expected = torch.autograd.grad([plain[1].sum(), plain[4].sum()], (t1, t2, t3))
    assert bitwise_equal(got, expected)


def test_partial_grad():
    """Port of TestCheckpoint.test_checkpoint_partial_grad (its first half)."""
    x = torch.randn(1, 4, requires_grad=True)
    other = torch.randn(1, 4, requires_grad=False)
    for use_reentrant in (True, False):
        x.grad = None
        out = remat.checkpoint(lambda a, b: (a.sin(), b), x, other, use_reentrant=use_reentrant)
        out[0].sum().backward()
        assert torch.equal(x.grad, x.cos()) and torch.equal(out[1], other)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_rng_cpu(use_reentrant):
    """Port of TestCheckpoint.test_checkpoint_rng_cpu: dropout masks replayed exactly."""
    for _ in range(3):
        inp = torch.randn(20000).requires_grad_()
        phase1, phase2 = torch.nn.Dropout(), torch.nn.Dropout()
        state = torch.get_rng_state()
        out = remat.checkpoint(phase2, phase1(inp), use_reentrant=use_reentrant)
        out.sum().backward()
        with_recompute = inp.grad
        torch.set_rng_state(state)
        inp.grad = None
        phase2(phase1(inp)).sum().backward()
        assert torch.equal(with_recompute, inp.grad)


def test_selective_contexts_allow_a_second_backward_unlike_torch():
    """torch raises "Trying to backward an extra time"; remat rebuilds and stays exact, with
    its own contexts and with torch's (rebuilt on remat's policy engine)."""
    x = torch.randn(16, 16, requires_grad=True)
    y = torch.randn(16, 16, requires_grad=True)
    expected = torch.autograd.grad(_sac_fn(x, y).sum(), (x, y))
    for create in (remat.create_selective_checkpoint_contexts, tuc.create_selective_checkpoint_contexts):
        context_fn = functools.partial(create, [torch.ops.aten.mm.default])
        out = remat.checkpoint(_sac_fn, x, y, use_reentrant=False, context_fn=context_fn).sum()
        first = torch.autograd.grad(out, (x, y), retain_graph=True)
        assert bitwise_equal(first, expected) and bitwise_equal(torch.autograd.grad(out, (x, y)), expected)


def test_selective_contexts_rebuild_a_kept_output_changed_in_place():
    """torch raises "has been mutated" (unless allow_cache_entry_mutation); remat rebuilds it."""
    x = torch.randn(8, 8, requires_grad=True)
    w = torch.randn(8, 8)

    def fn(t):
        h = t @ w
        out = h * 2
        h.relu_()  # the kept mm output changes in place after forward kept it
        return out + h

    expected = torch.autograd.grad(fn(x).sum(), x)
    context_fn = functools.partial(remat.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    got = torch.autograd.grad(remat.checkpoint(fn, x, use_reentrant=False, context_fn=context_fn).sum(), x)
    assert bitwise_equal(got, expected)
    torch_fn = functools.partial(tuc.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    out = tuc.checkpoint(fn, x, use_reentrant=False, context_fn=torch_fn).sum()
    with pytest.raises(RuntimeError, match="has been mutated"):
        torch.autograd.grad(out, x)
