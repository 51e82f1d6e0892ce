"""Graph mode: functional regions, output_recompute, policies, compiled functions, and the pieces.

Every compiled case compares its gradients with the eager run and asserts the
exact set of nodes copied into backward.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx

import remat
from remat._engine.trace_marks import decode_spec, encode_spec, run_marked
from remat._graph._cse import eliminate_common_subexpressions
from remat._graph._regions import clean_path
from remat._vocab.spec import RegionSpec

torch.set_num_threads(1)


def mlp() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))


def copied(compiled) -> list[tuple[str, str]]:
    (report,) = compiled.remat_reports
    return [(op, path) for _, op, path in report.duplicated]


def check_grads(step, compiled, params, x) -> None:
    """Gradients of ``compiled(x)`` equal those of ``step(x)`` run eagerly."""
    for p in params:
        p.grad = None
    compiled(x).backward()
    got = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    step(x).backward()
    for p, g in zip(params, got, strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    torch.manual_seed(0)


def test_checkpoint_inside_a_compiled_function_copies_its_inner_ops():
    block, head = mlp(), torch.nn.Linear(8, 1)

    def step(x):
        return head(remat.checkpoint(block, x, use_reentrant=False)).sum()

    compiled = remat.compile(step)
    x = torch.randn(4, 8)
    check_grads(step, compiled, [*block.parameters(), *head.parameters()], x)
    # the region's output (the second Linear) is kept; what it needs is rebuilt
    assert copied(compiled) == [("aten::addmm", "block.0 (Linear)"), ("aten::gelu", "block.1 (GELU)")]
    assert compiled.remat_reports[0].saved == ["addmm_1"]


def test_recompute_with_output_recompute_keeps_nothing_of_the_block():
    class Block(remat.nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def construct(self, x):
            return torch.tanh(self.fc(x)) * 2

    block = Block()

    def step(x):
        return remat.recompute(block, x, use_reentrant=False, output_recompute=True).pow(2).sum()

    compiled = remat.compile(step)
    check_grads(step, compiled, list(block.parameters()), torch.randn(4, 8))
    assert copied(compiled) == [
        ("aten::addmm", "block.fc (Linear)"),
        ("aten::tanh", "block (Block)"),
        ("aten::mul.Tensor", "block (Block)"),
    ]
    assert compiled.remat_reports[0].saved == []


def test_policy_keeps_the_operators_it_saves():
    block = remat.recompute_module(mlp(), policy=remat.save_compute_intensive)

    def step(x):
        return block(x).relu().sum()

    compiled = remat.compile(step)
    check_grads(step, compiled, list(block.parameters()), torch.randn(4, 8))
    assert copied(compiled) == [("aten::gelu", "block.1 (GELU)")]
    # the unmarked relu after the block is torch's min-cut's (NOTE [Unmarked operators under
    # the min-cut]): rebuilt from the block's last product, which is kept instead
    assert compiled.remat_reports[0].saved == ["addmm", "addmm_1"]
    assert [op for _, op, _ in compiled.remat_reports[0].partitioned] == ["aten::relu"]


def test_cell_output_recompute_and_nested_primitive():
    class Net(remat.nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = torch.nn.Linear(8, 8)
            self.act = remat.ops.Tanh()
            self.fc2 = torch.nn.Linear(8, 8)

        def construct(self, x):
            return self.fc2(self.act(self.fc1(x)))

    net = Net()
    net.act.recompute()  # a primitive marked inside an unmarked cell
    compiled = remat.compile(net)
    x = torch.randn(3, 8)

    def step(x):
        return net(x).sum()

    check_grads(step, lambda x: compiled(x).sum(), list(net.parameters()), x)
    assert copied(compiled) == [("aten::tanh", "act (Tanh)")]

    torch._dynamo.reset()
    net.recompute(output_recompute=True)  # now the whole cell, output included
    compiled = remat.compile(net)
    check_grads(step, lambda x: compiled(x).sum(), list(net.parameters()), x)
    # fc2's output is never read by a gradient, so only what backward reads is copied
    assert copied(compiled) == [("aten::addmm", "fc1 (Linear)"), ("aten::tanh", "act (Tanh)")]


def test_unmarked_model_copies_nothing(tmp_path):
    model = mlp()
    compiled = remat.compile(model, save_graphs=str(tmp_path))
    compiled(torch.randn(2, 8)).sum().backward()
    (report,) = compiled.remat_reports
    assert report.recomputed == [] and report.duplicated == [] and report.target_grad == []
    lines = (tmp_path / "graph0_01_recompute.ir").read_text().splitlines()
    assert not [line for line in lines if line.startswith("%") and "cnode_attrs" in line]
    assert "%0(primals_1) = input 0.weight : () -> (f32[16, 8])" in lines


def test_modules_passed_as_arguments_are_found():
    block = remat.recompute_module(mlp())

    def step(module, x):
        return module(x).sum()

    compiled = remat.compile(step)
    compiled(block, torch.randn(2, 8)).backward()
    assert copied(compiled) == [("aten::addmm", "module.0 (Linear)"), ("aten::gelu", "module.1 (GELU)")]


def test_compile_rejects_bad_arguments():
    with pytest.raises(ValueError, match="remat.compile: backend must be one of"):
        remat.compile(mlp(), backend="tvm")(torch.randn(1, 8))
    with pytest.raises(TypeError, match="remat.compile: expected a torch.nn.Module or a function"):
        remat.compile(3)


def test_run_marked_outside_compile_just_runs():
    calls = []

    def fn(x, scale=1):
        calls.append(1)
        return x * scale

    out = run_marked(fn, (torch.ones(2),), {"scale": 3}, RegionSpec())
    assert out.tolist() == [3.0, 3.0] and len(calls) == 1


def test_spec_encoding_round_trips():
    for spec in (
        RegionSpec(),
        RegionSpec(output_recompute=True),
        RegionSpec(policy=remat.save_only("aten::mm")),
        RegionSpec(keep_outputs=True, preserve_rng_state=False, policy=remat.save_all),
    ):
        encoded = encode_spec(spec)
        assert all(isinstance(v, (bool, tuple, type(None))) for v in encoded)
        back = decode_spec(encoded)
        assert (back.output_recompute, back.keep_outputs, back.preserve_rng_state) == (
            spec.output_recompute, spec.keep_outputs, spec.preserve_rng_state,
        )
        assert back.policy == spec.policy


def test_cse_merges_only_identical_pure_nodes():
    graph = fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(torch.ops.aten.relu.default, (x,))
    b = graph.call_function(torch.ops.aten.relu.default, (x,))
    c = graph.call_function(torch.ops.aten.add.Tensor, (a, b))
    d = graph.call_function(torch.ops.aten.bernoulli.default, (x,))
    e = graph.call_function(torch.ops.aten.bernoulli.default, (x,))
    graph.output((c, d, e))
    assert eliminate_common_subexpressions(graph, [a, b, c, d, e]) == 1
    assert c.args == (a, a)
    assert len([n for n in graph.nodes if n.target is torch.ops.aten.bernoulli.default]) == 2


def test_clean_path():
    assert clean_path("L['self'].layers[1]") == "layers.1"
    assert clean_path("G['model'].fc2") == "model.fc2"
    assert clean_path("L['self']") == ""
    assert clean_path("L['fn'].blocks[0]") == "blocks.0"
    # a marked module reached through its mark, which holds it weakly (NOTE [A mark holds its
    # module weakly])
    assert clean_path("L['self'].layers[1].forward._remat_module().bn1") == "layers.1.bn1"
    assert clean_path("L['self'].forward._remat_module()") == ""


class _Attention(torch.nn.Module):
    """Causal self-attention through torch's fused attention (the CPU's flash kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = torch.nn.Linear(8, 24), torch.nn.Linear(8, 8)

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 6, 3, 2, 4).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(2, 6, 8))


def test_the_cpus_attention_is_rebuilt_in_a_marked_block():
    """NOTE [Seeded operators that never draw]: the CPU's flash attention carries the random
    tag and never draws, so a marked block copies it into backward like any pure operator
    (it was kept, with its log-sum-exp), bit for bit with eager."""
    block = remat.recompute_module(_Attention())
    x = torch.randn(2, 6, 8, requires_grad=True)

    def step(x):
        return block(x).pow(2).sum()

    compiled = remat.compile(step)
    compiled(x).backward()
    got = [p.grad.clone() for p in (x, *block.parameters())]
    for p in (x, *block.parameters()):
        p.grad = None
    step(x).backward()
    assert all(torch.equal(g, p.grad) for g, p in zip(got, (x, *block.parameters()), strict=True))
    ops = [op for op, _ in copied(compiled)]
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops, ops
    saved = compiled.remat_reports[0].saved
    assert not any(name.startswith(("_scaled_dot_product", "getitem")) for name in saved), saved
