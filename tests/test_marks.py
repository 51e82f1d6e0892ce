"""Cell.recompute, recompute_module, apply, unmark and the functional remat.recompute."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

import remat
from remat._engine import outputs as _outputs
from remat._engine import state as _state
from tests import _harness
from tests._harness import assert_bitwise_equal, step_grads

B, W = 8, 32
ACT = B * W * 4  # bytes of one (B, W) float32 activation


class MLPBlock(remat.nn.Cell):
    """fc1 -> gelu -> fc2: the output operator is fc2's addmm, which saves nothing of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(W, 2 * W), torch.nn.Linear(2 * W, W)

    def construct(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class ReluBlock(remat.nn.Cell):
    """fc -> relu: the output operator (relu) saves its own result."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(W, W)

    def construct(self, x):
        return torch.relu(self.fc(x))


class Bottleneck(remat.nn.Cell):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = torch.nn.Conv2d(c, c, 1, bias=False), torch.nn.BatchNorm2d(c)
        self.conv2, self.bn2 = torch.nn.Conv2d(c, c, 3, padding=1, bias=False), torch.nn.BatchNorm2d(c)

    def construct(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + x)


class TransformerBlock(_harness.TransformerBlock, remat.nn.Cell):
    def __init__(self) -> None:
        super().__init__(d=W, heads=4)


def make_layer(n: int, c: int = 4, **options) -> torch.nn.Sequential:
    """Seed 003's _make_layer: every block but the first is recomputed."""
    blocks = [Bottleneck(c) for _ in range(n)]
    for block in blocks[1:]:
        block.recompute(**options)
    return torch.nn.Sequential(*blocks)


def chain(block_type, n: int = 3, **options) -> torch.nn.Sequential:
    model = torch.nn.Sequential(*[block_type() for _ in range(n)])
    if options.pop("mark", True):
        for block in model:
            block.recompute(**options)
    return model


def kept(model, x) -> int:
    return remat.memory.saved_bytes(lambda: model(x).sum())


def test_cell_keeps_inputs_and_output_ops_result():
    x = torch.randn(B, W, requires_grad=True)
    # unmarked, per block: fc1 out (2 acts, saved by gelu), gelu out (2 acts, saved by fc2),
    # and the block output (saved by the next block's fc1) for the first two blocks
    assert kept(chain(MLPBlock, mark=False), x) == 3 * 4 * ACT + 2 * ACT
    # recomputed cells keep their inputs only: fc2's addmm saves nothing of its result
    assert kept(chain(MLPBlock), x) == 2 * ACT
    # a relu output operator saves its result, which the cell keeps (3 blocks, 3 results)
    assert kept(chain(ReluBlock), x) == 3 * ACT
    # output_recompute: not even the outputs; only the first block's input (x) is kept
    assert kept(chain(MLPBlock, output_recompute=True), x) == 0
    assert kept(chain(ReluBlock, output_recompute=True), x) == 0
    assert not _outputs.hook_active()


def test_output_recompute_output_not_kept_by_plain_operators_after_it():
    x = torch.randn(B, W, requires_grad=True)
    head = torch.nn.Linear(W, W)  # saves its input: the last block's output
    assert kept(torch.nn.Sequential(chain(ReluBlock), head), x) == 3 * ACT
    assert kept(torch.nn.Sequential(chain(ReluBlock, output_recompute=True), head), x) == 0


CASES = {
    "mlp_cells": lambda **kw: chain(MLPBlock, **kw),
    "relu_cells": lambda **kw: chain(ReluBlock, **kw),
    "resnet_layer": lambda **kw: make_layer(3, **kw),
    "transformer": lambda **kw: chain(TransformerBlock, n=2, **kw),
}
OPTIONS = [{}, {"use_reentrant": True}, {"output_recompute": True},
           {"policy": remat.save_compute_intensive}]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "default")
@pytest.mark.parametrize("case", sorted(CASES))
def test_marked_model_gradients_equal_unmarked(case, options):
    torch.manual_seed(0)
    marked = CASES[case](**options)
    plain = copy.deepcopy(marked)
    remat.unmark(plain)
    x = {"resnet_layer": torch.randn(2, 4, 5, 5), "transformer": torch.randn(2, 6, W)}.get(
        case, torch.randn(B, W)
    )
    x.requires_grad_()
    head = torch.nn.Linear(x.shape[-1], 3)  # a plain consumer after the marked blocks

    def loss(model, t):
        return head(model(t)).pow(2).sum()

    g0, l0 = step_grads(plain, loss, [x])
    before = _state.recompute_count()
    g1, l1 = step_grads(marked, loss, [x])
    reruns = _state.recompute_count() - before
    assert torch.equal(l0, l1)
    assert_bitwise_equal(g0, g1)
    # output_recompute: each block runs once to hand its output on (NOTE [Output pass]) and
    # once to rebuild its own saved tensors (none of these blocks saves only its output)
    per_block = 2 if options.get("output_recompute") else 1
    assert reruns == per_block * len(remat.marked_modules(marked))
    if case == "resnet_layer":  # running statistics equal too (no double update)
        _check_buffers_after_step(plain, marked, x)


def _check_buffers_after_step(plain, marked, x):
    plain, marked = copy.deepcopy(plain), copy.deepcopy(marked)
    for model in (plain, marked):
        torch.manual_seed(1)
        model(x.detach()).sum().backward()
    for (name, a), (_, b) in zip(plain.named_buffers(), marked.named_buffers(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("reentrant", [True, False])
def test_functional_recompute_gradients_equal(reentrant):
    block = MLPBlock()
    x = torch.randn(B, W, requires_grad=True)
    g0, _ = step_grads(block, lambda m, t: m(t).sum(), [x])
    g1, _ = step_grads(block, lambda m, t: remat.recompute(m, t, use_reentrant=reentrant).sum(), [x])
    assert_bitwise_equal(g0, g1)


def test_functional_output_recompute_chain_merges():
    blocks = [MLPBlock() for _ in range(3)]
    x = torch.randn(B, W, requires_grad=True)

    def run(output_recompute):
        h = x
        for block in blocks:
            h = remat.recompute(block, h, output_recompute=output_recompute)
        return h.sum()

    assert remat.memory.saved_bytes(lambda: run(False)) == 2 * ACT  # inputs of blocks 2 and 3
    assert remat.memory.saved_bytes(lambda: run(True)) == 0  # only block 1's input (x)


def test_functional_recompute_tensor_in_list_reentrant_errors():
    class Pair(torch.nn.Module):
        def forward(self, pair):
            return pair[0] * pair[1]

    a, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    with pytest.raises(TypeError, match=r"cannot differentiate tensors inside lists"):
        remat.recompute(Pair(), [a, b])
    remat.recompute(Pair(), [a, b], use_reentrant=False).sum().backward()
    assert torch.equal(a.grad, b.detach())


def test_bad_input_errors_name_the_api():
    def f(x):
        return x

    with pytest.raises(TypeError, match=r"remat.recompute: block must be a torch.nn.Module.*function 'test_bad"):
        remat.recompute(f, torch.randn(2))
    assert remat.recompute(f, torch.randn(2), use_reentrant=False).shape == (2,)
    with pytest.raises(TypeError, match=r"got primitive ReLU; mark the primitive with ReLU\(\).recompute\(\)"):
        remat.recompute(remat.ops.ReLU(), torch.randn(2))
    assert torch.equal(remat.recompute(remat.ops.ReLU(), -torch.ones(2), use_reentrant=False), torch.zeros(2))
    with pytest.raises(TypeError, match=r"'use_reentrant' must be a bool, got str"):
        remat.recompute(MLPBlock(), torch.randn(2, W), use_reentrant="yes")
    with pytest.raises(TypeError, match=r"MLPBlock.recompute: unknown keyword argument\(s\) 'outputs'; accepted: use_reentrant"):
        MLPBlock().recompute(outputs=True)
    with pytest.raises(TypeError, match=r"'output_recompute' must be a bool, got int"):
        remat.recompute_module(torch.nn.Linear(2, 2), output_recompute=1)
    block = MLPBlock()
    block.recompute()
    block.recompute()  # the same mark again is fine
    with pytest.raises(ValueError, match=r"already marked with \(default options\).*output_recompute=True.*unmark"):
        block.recompute(output_recompute=True)
    assert remat.mark_of(block).output_recompute is False  # unchanged
    with pytest.raises(ValueError, match=r"output_recompute=True needs.*use_reentrant=False"):
        remat.recompute_module(torch.nn.Linear(2, 2), use_reentrant=True, output_recompute=True)


def test_apply_checks_every_module_before_marking_any():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    remat.recompute_module(model[2], output_recompute=True)
    with pytest.raises(ValueError, match=r"module '2' is already marked"):
        remat.apply(model, where=torch.nn.Linear)
    assert remat.mark_of(model[0]) is None
    assert remat.apply(model, where=lambda name, m: name == "1") == ["1"]
    assert sorted(remat.unmark(model)) == ["1", "2"]
    assert remat.marked_modules(model) == {}
    assert not model[0]._forward_pre_hooks and not model[2]._forward_hooks


def test_marks_survive_deepcopy_state_dict_to_and_pickle():
    model = chain(MLPBlock, output_recompute=True)
    names = [n for n, _ in model.named_parameters()]
    twin = copy.deepcopy(model)
    twin.load_state_dict(model.state_dict())
    twin = pickle.loads(pickle.dumps(twin)).to(torch.float64)
    assert [n for n, _ in twin.named_parameters()] == names
    assert remat.marked_modules(twin) == remat.marked_modules(model)
    x = torch.randn(B, W, dtype=torch.float64, requires_grad=True)
    assert kept(twin, x) == 0
    remat.unmark(twin)
    assert remat.marked_modules(model) != {}  # the original keeps its marks


def test_cell_recompute_accepts_positional_parallel_keywords_and_mode_false():
    cell = MLPBlock()
    cell.recompute(True, False, True)
    spec = remat.mark_of(cell)
    assert (spec.mp_comm_recompute, spec.parallel_optimizer_comm_recompute) == (False, True)
    cell.recompute(False)
    assert remat.mark_of(cell) is None
    with pytest.raises(TypeError, match="'mode' must be a bool"):
        cell.recompute("on")


def test_exception_in_marked_forward_leaves_no_hooks_behind():
    class Broken(remat.nn.Cell):
        def construct(self, x):
            torch.relu(x)
            raise KeyError("boom")

    cell = Broken()
    cell.recompute()
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    with pytest.raises(KeyError):
        cell(torch.randn(2, requires_grad=True))
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) == top
    block = ReluBlock()
    block.recompute()
    x = torch.randn(B, W, requires_grad=True)
    assert kept(block, x) == ACT  # the next marked call works normally


def test_a_marked_module_that_fails_to_open_leaves_the_outer_region_intact():
    outer, inner = ReluBlock(), torch.nn.Linear(W, W)
    outer.recompute()
    remat.recompute_module(inner, use_reentrant=True)
    bad = [torch.randn(2, W, requires_grad=True)]  # a list: the reentrant region refuses it

    class Wrapper(remat.nn.Cell):
        def __init__(self):
            super().__init__()
            self.outer, self.inner = outer, inner

        def construct(self, x):
            mine = torch._C._autograd._top_saved_tensors_default_hooks(False)
            with pytest.raises(TypeError, match="inside lists"):
                self.inner(bad)
            # the wrapper's own region is still open: its hooks are still on top
            assert torch._C._autograd._top_saved_tensors_default_hooks(False) == mine
            return self.outer(x)

    wrapper = Wrapper()
    wrapper.recompute()
    x = torch.randn(B, W, requires_grad=True)
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    y = wrapper(x)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) == top
    y.sum().backward()
    expected = torch.autograd.grad(torch.relu(outer.fc(x)).sum(), x)[0]
    assert torch.equal(x.grad, expected)


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_marked_model_in_inference_runs_plainly(context):
    model = chain(MLPBlock, output_recompute=True)
    plain = copy.deepcopy(model)
    remat.unmark(plain)
    x = torch.randn(B, W)
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    before = _state.recompute_count()
    with context():
        assert torch.equal(model(x), plain(x))
    assert _state.recompute_count() == before
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) == top
    assert _outputs._registry == {}
