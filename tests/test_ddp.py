"""DDP with ``use_reentrant=True`` marks: two gloo processes on loopback train as one process.

Each rank gets the same batch, so DDP's average of the two gradients equals
either one bit for bit, and the ranks' parameters must equal those of a single
process training the unmarked model. Before NOTE [Reentrant gradients], every
reentrant region fired each parameter's gradient hook twice and DDP refused it
("Expected to mark a variable ready only once") unless ``static_graph=True``.
"""

from __future__ import annotations

import datetime
import io
import os
import queue
import socket
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import remat

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


def _worker(rank: int, port: int, results: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60))
        for name, kwargs in VARIANTS.items():
            torch.manual_seed(0)
            model = Net()
            ddp = torch.nn.parallel.DistributedDataParallel(model, **kwargs)
            buffer = io.BytesIO()  # plain bytes: shared-memory tensors die with this process
            torch.save(_train(model, ddp), buffer)
            results.put((rank, name, buffer.getvalue(), None))
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001  report it, so the test fails at once instead of waiting out the deadline
        results.put((rank, None, None, traceback.format_exc()))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_ranks() -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(rank, port, results), daemon=True) for rank in range(2)]
    for p in procs:
        p.start()
    got: dict = {}
    try:
        end = time.monotonic() + DEADLINE_S
        while len(got) < 2 * len(VARIANTS):
            try:
                rank, name, result, error = results.get(timeout=max(0.1, end - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"DDP test: no result within {DEADLINE_S} s; got {sorted(got)}")
            if error is not None:
                pytest.fail(f"DDP rank {rank} failed:\n{error}")
            got[(rank, name)] = torch.load(io.BytesIO(result))
        for p in procs:
            p.join(timeout=max(1.0, end - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return got


def test_ddp_reentrant_marks_train_like_one_process():
    torch.manual_seed(0)
    single = Net(marked=False)
    want_losses, want_params = _train(single, single)
    got = _run_two_ranks()
    for (rank, name), (losses, params) in sorted(got.items()):
        assert all(torch.equal(a, b) for a, b in zip(losses, want_losses)), (rank, name)
        assert len(params) == len(want_params)
        for i, (a, b) in enumerate(zip(params, want_params)):
            assert torch.equal(a, b), f"rank {rank}, {name}: parameter {i} differs by {(a - b).abs().max()}"
