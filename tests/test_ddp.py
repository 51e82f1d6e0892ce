"""DDP with ``use_reentrant=True`` marks: two gloo processes on loopback train as one process.

Each rank gets the same batch, so DDP's average of the two gradients equals
either one bit for bit, and the ranks' parameters must equal those of a single
process training the unmarked model. Before NOTE [Reentrant gradients], every
reentrant region fired each parameter's gradient hook twice and DDP refused it
("Expected to mark a variable ready only once") unless ``static_graph=True``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import remat
from tests._harness import assert_bitwise_equal, assert_every_rank_succeeded, spawn_two_ranks

STEPS = 3
DEADLINE_S = 120  # the whole test; each collective times out after 60 s
VARIANTS = {
    "default": {},
    "find_unused_parameters": {"find_unused_parameters": True},
    "static_graph": {"static_graph": True},
}

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Net(torch.nn.Module):
    """Two blocks marked as MindSpore marks them by default (``use_reentrant=True``)."""

    def __init__(self, d: int = 8, marked: bool = True) -> None:
        super().__init__()
        self.stem, self.head = torch.nn.Linear(4, d), torch.nn.Linear(d, 2)
        self.b1, self.b2, self.b3 = Block(d), Block(d), Block(d)
        self.marked = marked
        if marked:
            remat.recompute_module(self.b3, use_reentrant=True)  # a cell mark

    def forward(self, x):
        h = self.stem(x)
        if self.marked:
            h = remat.recompute(self.b1, h)  # the functional mark, its default use_reentrant=True
            h = remat.checkpoint(self.b2, h, use_reentrant=True)
        else:
            h = self.b2(self.b1(h))
        return self.head(self.b3(h))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(6, 4, generator=g), torch.randint(0, 2, (6,), generator=g)


def _train(model: torch.nn.Module, forward: torch.nn.Module) -> tuple[list, list]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = torch.nn.functional.cross_entropy(forward(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses, [p.detach().clone() for p in model.parameters()]


def ddp_ranks(rank: int) -> dict:
    """One rank: each variant of DDP trains its own marked ``Net``; ``{variant: (losses, params)}``."""
    out = {}
    for name, kwargs in VARIANTS.items():
        torch.manual_seed(0)
        model = Net()
        ddp = torch.nn.parallel.DistributedDataParallel(model, **kwargs)
        out[name] = _train(model, ddp)
    return out


def test_ddp_reentrant_marks_train_like_one_process():
    torch.manual_seed(0)
    single = Net(marked=False)
    want_losses, want_params = _train(single, single)
    out, codes = spawn_two_ranks(ddp_ranks, deadline=DEADLINE_S, pg_timeout=60)
    assert_every_rank_succeeded(out, codes)
    for variants in out.values():
        assert list(variants) == list(VARIANTS)
        for losses, params in variants.values():
            assert_bitwise_equal(losses, want_losses)
            assert_bitwise_equal(params, want_params)
