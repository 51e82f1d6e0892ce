"""remat.checkpoint and the engine under it, against the same models run without recompute."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc

import remat
from remat._engine import outputs as _outputs
from remat._engine import state as _state
from tests._harness import TransformerBlock, assert_bitwise_equal, step_grads

MODES = [False, True]  # use_reentrant


class MLP(torch.nn.Module):
    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


class ConvBlock(torch.nn.Module):
    def __init__(self, c: int = 4, p: float = 0.0) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(c, c, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(c)
        self.drop = torch.nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(torch.relu(self.bn(self.conv(x))))


CASES = {
    "mlp": (lambda: MLP(), lambda: torch.randn(4, 16)),
    "conv_bn_relu": (lambda: ConvBlock(), lambda: torch.randn(2, 4, 6, 6)),
    "dropout": (lambda: ConvBlock(p=0.5), lambda: torch.randn(2, 4, 6, 6)),
    "transformer": (lambda: TransformerBlock(), lambda: torch.randn(2, 5, 16)),
}


@pytest.mark.parametrize("reentrant", MODES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_gradients_equal_unmarked_model(case, reentrant):
    make_model, make_input = CASES[case]
    model, x = make_model(), make_input().requires_grad_()
    plain, loss0 = step_grads(model, lambda m, t: m(t).pow(2).sum(), [x])
    marked, loss1 = step_grads(
        model, lambda m, t: remat.checkpoint(m, t, use_reentrant=reentrant).pow(2).sum(), [x]
    )
    assert torch.equal(loss0, loss1)
    assert_bitwise_equal(plain, marked)


@pytest.mark.parametrize("reentrant", MODES)
def test_nested_regions_gradients_equal(reentrant):
    model = MLP(depth=4)
    x = torch.randn(3, 16, requires_grad=True)

    def nested(m, t):
        def inner(h):
            return m.layers[1](torch.relu(m.layers[0](h)))

        def outer(h):
            h = remat.checkpoint(inner, h, use_reentrant=reentrant)
            return m.layers[3](torch.tanh(m.layers[2](h)))

        return remat.checkpoint(outer, t, use_reentrant=reentrant).sum()

    def plain(m, t):
        h = m.layers[1](torch.relu(m.layers[0](t)))
        return m.layers[3](torch.tanh(m.layers[2](h))).sum()

    assert_bitwise_equal(step_grads(model, plain, [x])[0], step_grads(model, nested, [x])[0])


@pytest.mark.parametrize("reentrant", MODES)
def test_batch_norm_statistics_updated_once_unlike_torch(reentrant):
    """NOTE [No double state updates]: torch.utils.checkpoint counts the batch twice."""

    def stats_after(run):
        torch.manual_seed(3)
        block, x = ConvBlock(), torch.randn(2, 4, 6, 6, requires_grad=True)
        run(block, x).sum().backward()
        return block.bn.running_mean.clone(), block.bn.running_var.clone(), int(block.bn.num_batches_tracked)

    plain = stats_after(lambda m, x: m(x))
    ours = stats_after(lambda m, x: remat.checkpoint(m, x, use_reentrant=reentrant))
    theirs = stats_after(lambda m, x: tuc.checkpoint(m, x, use_reentrant=reentrant))
    assert torch.equal(ours[0], plain[0]) and torch.equal(ours[1], plain[1]) and ours[2] == 1
    assert theirs[2] == 2 and not torch.equal(theirs[0], plain[0])


def test_in_place_buffer_written_once():
    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("seen", torch.zeros(()))

        def forward(self, x):
            self.seen += 1
            return torch.sin(x) * self.seen

    m, x = Counter(), torch.randn(5, requires_grad=True)
    remat.checkpoint(m, x, use_reentrant=False).sum().backward()
    assert m.seen.item() == 1
    assert torch.allclose(x.grad, torch.cos(x.detach()))  # rebuilt with seen == 1, as in forward


def test_dropout_mask_replayed_and_caller_rng_untouched():
    x = torch.randn(64, requires_grad=True)

    def f(t):
        return F.dropout(t.exp(), 0.5)

    torch.manual_seed(7)
    y = remat.checkpoint(f, x, use_reentrant=False)
    after_forward = torch.rand(3)
    torch.manual_seed(7)
    y.sum().backward()
    torch.manual_seed(7)
    expected = torch.autograd.grad(F.dropout(x.exp(), 0.5).sum(), x)[0]
    assert torch.equal(x.grad, expected)
    torch.manual_seed(7)
    _ = F.dropout(x.exp(), 0.5)
    assert torch.equal(torch.rand(3), after_forward)


def test_autocast_state_restored_in_recomputation():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = remat.checkpoint(lin, x, use_reentrant=False)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()  # outside autocast: recomputation must still run in bf16
    g = x.grad.clone()
    x.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y2 = lin(x)
    y2.float().sum().backward()
    assert torch.equal(g, x.grad)


def test_kept_bytes_eight_layers_each_in_a_region_are_region_inputs_only():
    batch, width, depth = 32, 64, 8
    layers = [torch.nn.Linear(width, width) for _ in range(depth)]
    x = torch.randn(batch, width, requires_grad=True)
    activation = batch * width * 4

    def forward(kind):
        h = x
        for layer in layers:
            block = lambda t, layer=layer: torch.relu(layer(t))
            if kind == "plain":
                h = block(h)
            elif kind == "region":
                h = remat.checkpoint(block, h, use_reentrant=False)
            else:
                h = remat.recompute(block, h, output_recompute=True)
        return h.sum()

    assert remat.memory.saved_bytes(lambda: forward("plain")) == depth * activation  # relu outputs
    # each region keeps its input: x (not allocated by the step) and 7 region outputs
    assert remat.memory.saved_bytes(lambda: forward("region")) == (depth - 1) * activation
    # adjacent output_recompute regions merge: only the first region's input (x) is kept
    assert remat.memory.saved_bytes(lambda: forward("output")) == 0
    assert not _outputs.hook_active()


@pytest.mark.parametrize("kind", ["region", "output"])
def test_each_region_reruns_once_per_backward(kind):
    """Plain regions re-run once each; a chain of n output_recompute regions 2n - 1 times.

    NOTE [Output pass]: each region but the last runs once to hand its output to
    the next region's recomputation, and once more, when its own backward comes,
    to rebuild its saved tensors; so backward never holds the whole chain.
    """
    layers = [torch.nn.Linear(8, 8) for _ in range(5)]
    x = torch.randn(2, 8, requires_grad=True)
    h = x
    for layer in layers:
        block = lambda t, layer=layer: torch.relu(layer(t))
        if kind == "region":
            h = remat.checkpoint(block, h, use_reentrant=False)
        else:
            h = remat.recompute(block, h, output_recompute=True)
    runs = 5 if kind == "region" else 2 * 5 - 1
    before = _state.recompute_count()
    h.sum().backward(retain_graph=True)
    assert _state.recompute_count() - before == runs
    h.sum().backward()  # a second graph task rebuilds again
    assert _state.recompute_count() - before == 2 * runs


def test_output_recompute_chain_never_holds_the_whole_chain_in_backward():
    blocks = [torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
              for _ in range(6)]
    x = torch.randn(32, 64, requires_grad=True)

    def step(kind):
        for block in blocks:
            block.zero_grad(set_to_none=True)
        x.grad = None
        h = x
        for block in blocks:
            if kind == "torch":
                h = tuc.checkpoint(block, h, use_reentrant=False)
            elif kind == "region":
                h = remat.checkpoint(block, h, use_reentrant=False)
            else:
                h = remat.recompute(block, h, output_recompute=True)
        params = [p for block in blocks for p in block.parameters()]
        with remat.memory.track(baseline=[x, params]) as tracker:  # every parameter counted
            h.sum().backward()
        return tracker.peak().total_bytes

    torch_peak = step("torch")
    assert step("region") == torch_peak
    # backward under output_recompute holds one block at a time (plus the chain's outputs),
    # never the whole chain: no higher than torch's plain regions
    assert step("output") <= torch_peak


def test_early_stop_reruns_only_up_to_last_needed_tensor():
    ran = []
    w = torch.randn(8, 8, requires_grad=True)

    def f(x):
        ran.append("first")
        h = torch.relu(x @ w)  # saves x, w, relu output
        ran.append("second")
        return h.detach() * 2 + h  # ops after the last save: nothing more saved

    def g(x):
        ran.append("a")
        h = torch.sin(x @ w)
        ran.append("b")
        return h + torch.exp(x).sum()  # exp saves its result after "b"

    x = torch.randn(3, 8, requires_grad=True)
    ran.clear()
    remat.checkpoint(f, x, use_reentrant=False, early_stop=True).sum().backward()
    assert ran == ["first", "second", "first"]  # stopped at relu, before "second"
    ran.clear()
    remat.checkpoint(f, x, use_reentrant=False, early_stop=False).sum().backward()
    assert ran == ["first", "second", "first", "second"]
    ran.clear()
    remat.checkpoint(g, x, use_reentrant=False).sum().backward()
    assert ran == ["a", "b", "a", "b"]


def test_retain_graph_twice_and_autograd_grad():
    model, x = MLP(), torch.randn(4, 16, requires_grad=True)
    y = remat.checkpoint(model, x, use_reentrant=False).sum()
    y.backward(retain_graph=True)
    first = x.grad.clone()
    y.backward()
    assert torch.equal(x.grad, 2 * first)
    (gx,) = torch.autograd.grad(remat.checkpoint(model, x, use_reentrant=False).sum(), x)
    assert torch.equal(gx, first)


def test_nested_containers_kwargs_non_tensors_and_partly_used_outputs():
    a = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(4, 5, requires_grad=True)
    bias = torch.randn(5, requires_grad=True)
    frozen = torch.randn(3, 5)  # does not require grad

    def f(pair, scale, *, bias, extra):
        h = torch.relu(pair["a"] @ pair["b"]) * scale + bias + extra
        return {"out": h, "unused": h.exp(), "tag": "ok"}, [h.sum()]

    def loss(fn):
        out, (total,) = fn(f, {"a": a, "b": b}, 2.0, bias=bias, extra=frozen)
        assert out["tag"] == "ok"
        return out["out"].pow(2).sum() + total

    l0 = loss(lambda fn, *args, **kw: fn(*args, **kw))
    l0.backward()
    expected = [a.grad.clone(), b.grad.clone(), bias.grad.clone()]
    a.grad = b.grad = bias.grad = None
    l1 = loss(lambda fn, *args, **kw: remat.checkpoint(fn, *args, use_reentrant=False, **kw))
    l1.backward()
    assert torch.equal(l0, l1)
    assert_bitwise_equal(expected, [a.grad, b.grad, bias.grad])


def test_selective_policy_keeps_matmul_outputs_only():
    w1, w2 = torch.randn(32, 64, requires_grad=True), torch.randn(64, 32, requires_grad=True)
    x = torch.randn(16, 32, requires_grad=True)

    def f(t):
        return torch.tanh(torch.relu(t @ w1) @ w2)

    def run(**kw):
        return remat.checkpoint(f, x, use_reentrant=False, **kw).sum()

    ctx = remat.policy_context(remat.save_compute_intensive)
    # kept: the two mm outputs (16x64 and 16x32 floats); relu and tanh are rebuilt
    assert remat.memory.saved_bytes(lambda: run(context_fn=ctx)) == (16 * 64 + 16 * 32) * 4
    assert remat.memory.saved_bytes(lambda: run()) == 0
    f(x).sum().backward()
    expected = x.grad.clone()
    torch_ctx = functools.partial(tuc.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    for context in (ctx, torch_ctx):
        x.grad = None
        run(context_fn=context).backward()
        assert torch.equal(x.grad, expected)


def test_non_callable_region_fails_clearly():
    with pytest.raises(TypeError, match=r"remat.checkpoint: function must be callable, got int"):
        remat.checkpoint(3, torch.randn(2), use_reentrant=False)


def test_determinism_mismatch_names_region_and_tensor():
    calls = []

    def shifty(x):
        calls.append(1)
        n = 4 if len(calls) == 1 else 3
        return torch.relu(x[:n]).sum()

    x = torch.randn(5, requires_grad=True)
    y = remat.checkpoint(shifty, x, use_reentrant=False)
    with pytest.raises(remat.RecomputeError, match=r"(?s)region 'test_determinism.*shifty'.*tensor #0: forward shape \[4\]"):
        y.backward()
    calls.clear()
    y = remat.checkpoint(shifty, x, use_reentrant=False, debug=True)
    with pytest.raises(remat.RecomputeError, match=r"(?s)Operators run in forward:.*aten.relu.*"
                                                   r"Operators run in recomputation:"):
        y.backward()


def test_reentrant_rejects_tensors_in_lists_and_autograd_grad_and_second_backward():
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(TypeError, match=r"use_reentrant=True.*inside lists.*use_reentrant=False"):
        remat.checkpoint(lambda xs: lin(xs[0]), [x], use_reentrant=True)

    class Opaque:  # a callable object remat cannot look into
        def __call__(self, t):
            return lin(t)

    # refused before (remat walked Python objects and could not enter this one); the region
    # now observes what it reads (NOTE [Observed reads]), so torch.autograd.grad is exact
    want = torch.autograd.grad(lin(x).sum(), [x, *lin.parameters()])
    got = torch.autograd.grad(remat.checkpoint(Opaque(), x, use_reentrant=True).sum(),
                              [x, *lin.parameters()])
    assert_bitwise_equal(list(want), list(got))
    y = remat.checkpoint(lin, x, use_reentrant=True).sum()
    y.backward()
    with pytest.raises(remat.RecomputeError, match=r"second time.*retain_graph=True"):
        y.backward()


class _Opaque:
    """A callable object: neither a module nor a function."""

    def __init__(self, model):
        self.model = model

    def __call__(self, t):
        return self.model(t)


@pytest.mark.parametrize("wrap", ["module", "closure", "bound_method", "object", "marked"])
def test_reentrant_works_with_autograd_grad_unlike_torch(wrap):
    model = MLP()
    x = torch.randn(4, 16, requires_grad=True)
    if wrap == "marked":  # the bound method of a marked module: a MarkedForward object
        remat.recompute_module(model)
    fn = {"module": model, "closure": lambda t: model(t), "bound_method": model.forward,
          "object": _Opaque(model), "marked": model.forward}[wrap]
    params = list(model.parameters())
    expected = torch.autograd.grad(model(x).pow(2).sum(), [x, *params])
    got = torch.autograd.grad(remat.checkpoint(fn, x, use_reentrant=True).pow(2).sum(), [x, *params])
    assert_bitwise_equal(list(expected), list(got))
    assert all(p.grad is None for p in params)  # nothing accumulated behind the caller's back
    with pytest.raises(RuntimeError, match=r"torch.autograd.grad|\.grad\(\)"):
        torch.autograd.grad(tuc.checkpoint(fn, x, use_reentrant=True).sum(), x)


def test_torch_compatible_warnings_and_errors():
    lin, x = torch.nn.Linear(2, 2), torch.randn(1, 2, requires_grad=True)
    with pytest.warns(UserWarning, match="use_reentrant parameter should be passed explicitly"):
        remat.checkpoint(lin, x)
    with pytest.raises(ValueError, match="Unexpected keyword arguments: foo"):
        remat.checkpoint(lin, x, use_reentrant=True, foo=1)
    with pytest.raises(ValueError, match="only supported when use_reentrant=False"):
        remat.checkpoint(lin, x, use_reentrant=True, debug=True)
    with pytest.raises(ValueError, match="determinism_check should be one of"):
        remat.checkpoint(lin, x, use_reentrant=False, determinism_check="strict")


@pytest.mark.parametrize("reentrant", MODES)
def test_checkpoint_sequential_matches_torch(reentrant):
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)], torch.nn.Tanh())
    x = torch.randn(3, 8, requires_grad=True)
    ours = step_grads(model, lambda m, t: remat.checkpoint_sequential(m, 3, t, use_reentrant=reentrant).sum(), [x])
    theirs = step_grads(model, lambda m, t: tuc.checkpoint_sequential(m, 3, t, use_reentrant=reentrant).sum(), [x])
    assert_bitwise_equal(ours[0], theirs[0])
    kept = remat.memory.saved_bytes(
        lambda: remat.checkpoint_sequential(model, 3, x, use_reentrant=False).sum()
    )
    torch_kept = remat.memory.saved_bytes(
        lambda: tuc.checkpoint_sequential(model, 3, x, use_reentrant=False).sum()
    )
    assert kept == torch_kept


def test_same_bytes_kept_as_torch_checkpoint():
    model, x = TransformerBlock(), torch.randn(2, 5, 16, requires_grad=True)
    ours = remat.memory.saved_bytes(lambda: remat.checkpoint(model, x, use_reentrant=False).sum())
    theirs = remat.memory.saved_bytes(lambda: tuc.checkpoint(model, x, use_reentrant=False).sum())
    plain = remat.memory.saved_bytes(lambda: model(x).sum())
    assert ours == theirs < plain


@pytest.mark.parametrize(
    "options",
    [{}, {"output_recompute": True}, {"use_reentrant": True}, {"policy": remat.save_compute_intensive}],
    ids=lambda o: ",".join(o) or "default",
)
def test_no_engine_object_outlives_its_graph(options):
    """Counts only the engine objects this test's own graphs create: objects an earlier test
    left behind (or holds) are taken as a baseline first, so the test does not depend on order."""
    import gc

    from remat._engine import hooked as _hooked
    from remat._engine import rebuilt as _rebuilt
    from remat._engine import reentrant as _reentrant

    kinds = (_hooked.HookedFrame, _rebuilt.Holder, _reentrant.ReentrantFrame, _outputs.OutputRef)

    def engine_objects() -> list:
        gc.collect()
        with warnings.catch_warnings():  # gc.get_objects() trips deprecated torch attributes
            warnings.simplefilter("ignore")
            return [o for o in gc.get_objects() if isinstance(o, kinds)]

    before = engine_objects()  # held until the end, so no new object can reuse their ids
    ids_before = {id(o) for o in before}
    registry_before = dict(_outputs._registry)
    hook_before = _outputs.hook_active()

    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()) for _ in range(3)])
    remat.apply(model, where=lambda name, m: name in ("0", "1", "2"), **options)
    for _ in range(3):
        model(torch.randn(2, 8, requires_grad=True)).sum().backward()
    y = model(torch.randn(2, 8, requires_grad=True))  # forward only, then dropped
    del y
    alive = [o for o in engine_objects() if id(o) not in ids_before]
    added = {k: v for k, v in _outputs._registry.items() if registry_before.get(k) is not v}
    assert alive == [] and added == {} and _outputs.hook_active() == hook_before
    del before


def test_kept_output_changed_in_place_is_rebuilt_not_replayed():
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)

    def f(t):
        h = t @ w  # kept by the policy ...
        h.add_(1)  # ... then changed in place: replaying it would add 1 twice
        return torch.sin(h)

    f(x).sum().backward()
    expected = x.grad.clone()
    x.grad = None
    ctx = remat.policy_context(remat.save_compute_intensive)
    remat.checkpoint(f, x, use_reentrant=False, context_fn=ctx).sum().backward()
    assert torch.equal(x.grad, expected)


@pytest.mark.parametrize("reentrant", MODES)
def test_swapping_the_import_trains_identically_to_torch(reentrant):
    """Three optimizer steps of a dropout transformer: remat.checkpoint == torch's, bitwise."""

    def train(checkpoint):
        torch.manual_seed(5)
        blocks = torch.nn.ModuleList(TransformerBlock() for _ in range(2))
        opt = torch.optim.AdamW(blocks.parameters(), lr=1e-2)
        for step in range(3):
            x = torch.randn(2, 5, 16, requires_grad=reentrant)
            for block in blocks:
                x = checkpoint(block, x, use_reentrant=reentrant)
            opt.zero_grad()
            x.pow(2).mean().backward()
            opt.step()
        return [p.detach().clone() for p in blocks.parameters()]

    assert_bitwise_equal(train(tuc.checkpoint), train(remat.checkpoint))


@pytest.mark.parametrize("keyword", ["use_reentrant", "preserve_rng_state", "debug", "early_stop"])
def test_checkpoint_flags_must_be_bools(keyword):
    layer, x = torch.nn.Linear(2, 2), torch.randn(1, 2, requires_grad=True)
    with pytest.raises(TypeError, match=f"remat.checkpoint: '{keyword}' must be a bool, got str 'no'"):
        remat.checkpoint(layer, x, **{"use_reentrant": False, keyword: "no"})


def test_checkpoint_sequential_flags_must_be_bools():
    model, x = torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.randn(1, 2)
    with pytest.raises(TypeError, match="remat.checkpoint_sequential: 'use_reentrant' must be a bool"):
        remat.checkpoint_sequential(model, 1, x, use_reentrant="no")


def test_profile_flags_are_type_checked():
    net, x = torch.nn.Linear(2, 2), torch.randn(1, 2)
    with pytest.raises(TypeError, match="remat.profile: 'output_recompute' must be a bool"):
        remat.profile(net, x, output_recompute="yes")
    with pytest.raises(TypeError, match="remat.profile: 'repeat' must be an int"):
        remat.profile(net, x, repeat=-1)
    with pytest.raises(TypeError, match="remat.estimate: 'output_recompute' must be a bool"):
        remat.estimate(net, x, output_recompute=1)


class _Checkpointed(torch.nn.Module):
    """A block called through ``remat.checkpoint`` (or directly, for the unmarked model)."""

    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.block = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
        self.reentrant = reentrant

    def forward(self, x):
        if self.reentrant is None:
            return self.block(x).pow(2).sum()
        return remat.checkpoint(self.block, x, use_reentrant=self.reentrant).pow(2).sum()


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_traced_by_dynamo_warns_nothing_and_trains_as_unmarked(reentrant):
    """remat.checkpoint inside torch.compile: its options are made as written while traced (a
    cache of them made dynamo warn, once per call site, that it ignores the cache)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    marked = _Checkpointed(reentrant)
    plain = _Checkpointed(None)
    plain.load_state_dict(marked.state_dict())
    x = torch.randn(3, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(marked, backend="eager")(x).backward()
    plain(x).backward()
    assert [str(w.message) for w in caught if "checkpoint.py" in str(w.message)] == []
    for (name, p), q in zip(marked.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
