"""The engine on CUDA: per-device random state, exact gradients, kept bytes. Skipped without a GPU."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import remat
from remat._graph._backend import _torch_version
from tests._harness import TransformerBlock, assert_bitwise_equal, step_grads

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("reentrant", [False, True])
def test_dropout_on_cuda_replays_the_device_random_state(reentrant):
    model = TransformerBlock().cuda()
    x = torch.randn(2, 5, 16, device="cuda", requires_grad=True)
    plain, l0 = step_grads(model, lambda m, t: m(t).pow(2).sum(), [x])
    marked, l1 = step_grads(
        model, lambda m, t: remat.checkpoint(m, t, use_reentrant=reentrant).pow(2).sum(), [x]
    )
    assert torch.equal(l0, l1)
    assert_bitwise_equal(plain, marked)


def test_cuda_rng_of_the_caller_is_untouched():
    x = torch.randn(64, device="cuda", requires_grad=True)
    torch.cuda.manual_seed(3)
    y = remat.checkpoint(lambda t: F.dropout(t, 0.5), x, use_reentrant=False)
    expected = torch.rand(4, device="cuda")
    torch.cuda.manual_seed(3)
    _ = F.dropout(x, 0.5)
    y.sum().backward()  # recomputation replays the forward's state, then restores the caller's
    assert torch.equal(torch.rand(4, device="cuda"), expected)


def test_batch_norm_statistics_once_on_cuda():
    block = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.BatchNorm2d(4)).cuda()
    twin = copy.deepcopy(block)
    x = torch.randn(2, 4, 6, 6, device="cuda", requires_grad=True)
    block(x).sum().backward()
    remat.checkpoint(twin, x, use_reentrant=False).sum().backward()
    assert torch.equal(block[1].running_mean, twin[1].running_mean)
    assert int(twin[1].num_batches_tracked) == 1


def test_kept_bytes_on_cuda_are_region_inputs_only():
    layers = [torch.nn.Linear(64, 64).cuda() for _ in range(4)]
    x = torch.randn(32, 64, device="cuda", requires_grad=True)

    def forward():
        h = x
        for layer in layers:
            h = remat.checkpoint(lambda t, layer=layer: torch.relu(layer(t)), h, use_reentrant=False)
        return h.sum()

    assert remat.memory.saved_bytes(forward) == 3 * 32 * 64 * 4


def _marks():
    """name -> forward(model, x) for every way to mark, on a two-block stack."""
    def blocks(model, x, call):
        for block in model:
            x = call(block, x)
        return x.pow(2).sum()

    def marked(**kw):
        def forward(model, x):
            remat.apply(model, where=TransformerBlock, **kw)
            return blocks(model, x, lambda b, t: b(t))
        return forward

    return {
        "apply non-reentrant": marked(use_reentrant=False),
        "apply reentrant": marked(use_reentrant=True),
        "output_recompute": marked(output_recompute=True),
        "policy": marked(policy=remat.save_compute_intensive),
        "checkpoint non-reentrant": lambda m, x: blocks(
            m, x, lambda b, t: remat.checkpoint(b, t, use_reentrant=False)),
        "checkpoint reentrant": lambda m, x: blocks(
            m, x, lambda b, t: remat.checkpoint(b, t, use_reentrant=True)),
        "recompute": lambda m, x: blocks(m, x, lambda b, t: remat.recompute(b, t)),
    }


@pytest.mark.parametrize("name", list(_marks()))
def test_every_way_to_mark_is_bitwise_on_cuda(name):
    torch.manual_seed(0)
    model = torch.nn.Sequential(TransformerBlock(64, 4), TransformerBlock(64, 4)).cuda()
    x = torch.randn(2, 16, 64, device="cuda", requires_grad=True)
    plain, l0 = step_grads(model, lambda m, t: m(t).pow(2).sum(), [x])
    marked, l1 = step_grads(model, _marks()[name], [x])
    assert torch.equal(l0, l1)
    assert_bitwise_equal(plain, marked)


@pytest.mark.skipif(_torch_version() < (2, 13), reason="remat.compile needs torch 2.13 or later "
                    "(older versions skip its graph pass: it refuses them)")
def test_compiled_marks_with_inductor_on_cuda():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).cuda()
    x = torch.randn(32, 64, device="cuda", requires_grad=True)
    twin = copy.deepcopy(model)
    expected = torch.compile(twin, backend="inductor")(x).pow(2).sum()
    expected.backward()
    remat.recompute_module(model[1], output_recompute=True)  # its output not kept either
    compiled = remat.compile(model, backend="inductor")
    loss = compiled(x.detach().requires_grad_()).pow(2).sum()
    loss.backward()
    reports = compiled.remat_reports
    assert any("GELU" in path for r in reports for _, _, path in r.recomputed), reports
    assert all(r.saved == ["addmm"] for r in reports), reports  # the first product's output only
    # Inductor fuses the re-run with its consumer, so the last bits may differ from the
    # unmarked compiled step: a stated tolerance, not bitwise.
    for a, b in zip(twin.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6)
