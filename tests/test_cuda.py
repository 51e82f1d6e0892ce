"""The engine on CUDA: per-device random state, exact gradients, kept bytes. Skipped without a GPU."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import remat
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
