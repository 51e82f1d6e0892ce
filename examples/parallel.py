"""Recompute marks under torch.distributed: tensor parallelism and FSDP2, measured per rank.

    torchrun --nproc-per-node 2 examples/parallel.py      # CPU: gloo; GPUs: NCCL

A small decoder (pre-norm attention and MLP blocks) is trained one step in each
setting below. Tensor parallelism (DTensor ``parallelize_module``: q/k/v and the
MLP's first layer column-wise, the projections row-wise) runs with the blocks
marked ``mp_comm_recompute=False`` (collective results kept from forward) or
``True`` (issued again in recomputation); FSDP2 (``fully_shard`` on every block)
runs with ``parallel_optimizer_comm_recompute=False`` (gathered parameters kept
until backward) or ``True`` (gathered again for recomputation). Every rank
reports the collectives issued in forward and backward, its peak memory
(``remat.memory.track``, checked against the CPU allocator's own peak) and
whether its gradients equal those of the same model in one process.
"""

from __future__ import annotations

import datetime
import gc
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import remat

D, HEADS, SEQ, BATCH, LAYERS = 128, 4, 64, 8, 4


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds HEADS / world of them
        q, k, v = (f(x).view(b, s, -1, D // HEADS).transpose(1, 2) for f in (self.q, self.k, self.v))
        # attention written out (nanoGPT's slow path): every buffer goes through the
        # dispatcher, so the tracker sees what the allocator sees (SDPA's CPU kernels
        # allocate work buffers inside, out of the tracker's sight)
        scores = (q @ k.transpose(-2, -1)) / (D // HEADS) ** 0.5
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        y = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = nn.LayerNorm(D), Attention(), nn.LayerNorm(D), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def decoder() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(LAYERS)], nn.LayerNorm(D))


def tensor_parallel(model: nn.Sequential, mesh) -> nn.Sequential:
    plan = {f"attn.{n}": ColwiseParallel() for n in "qkv"}
    plan.update({"attn.o": RowwiseParallel(), "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()})
    for block in model[:-1]:
        parallelize_module(block, mesh, plan)
    return model


def sharded(model: nn.Sequential, mesh) -> nn.Sequential:
    for block in model[:-1]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


SETTINGS = [  # (name, parallelism, mark options or None for no marks)
    ("TP, no marks", tensor_parallel, None),
    ("TP, mp_comm_recompute=False", tensor_parallel, {"mp_comm_recompute": False}),
    ("TP, mp_comm_recompute=True", tensor_parallel, {"mp_comm_recompute": True}),
    ("FSDP2, no marks", sharded, None),
    ("FSDP2, marks, option not passed", sharded, {}),
    ("FSDP2, parallel_optimizer_comm_recompute=False", sharded, {"parallel_optimizer_comm_recompute": False}),
    ("FSDP2, parallel_optimizer_comm_recompute=True", sharded, {"parallel_optimizer_comm_recompute": True}),
]


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).sin().mean()


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def run(name: str, parallelize, marks, mesh, x: torch.Tensor, reference: list, on_cpu: bool) -> dict:
    model = decoder()
    if marks is not None:
        remat.apply(model, Block, **marks)
    model = parallelize(model.to(x.device), mesh)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        loss_of(model, x).backward()

    step()  # warm-up: lazy initialisation of FSDP2 and DTensor caches
    with remat.parallel.count_collectives() as counts:
        step()
    grads = [full(p.grad) for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    runs = []
    for _ in range(6):
        gc.collect()  # no collection of older garbage in the middle of the step
        gc.disable()
        try:
            with remat.memory.track(model, baseline=[x]) as tracker:
                peak = remat.memory.allocator_peak(step) if on_cpu else None
        finally:
            gc.enable()
        runs.append((tracker.peak_increase, peak))
    # The first measured step also allocates the gradients' storages (set to None before
    # it). A free made on one of gloo's threads goes unrecorded now and then (NOTE [Frees
    # on gloo's worker thread]), so a step's allocator figure can only read high: both
    # figures are from the step with the allocator's least peak.
    runs = runs[1:]
    tracked, allocated = min(runs, key=lambda r: r[1]) if on_cpu else (max(r[0] for r in runs), None)
    equal = all(torch.equal(g, r) for g, r in zip(grads, reference))
    scale = max(r.abs().max().item() for r in reference)
    diff = max((g - r).abs().max().item() for g, r in zip(grads, reference)) / scale
    return {
        "name": name, "forward": dict(counts.forward), "backward": dict(counts.backward),
        "tracked": tracked, "equal": equal, "diff": diff, "allocator": allocated,
    }


def show(counts: dict) -> str:
    return ", ".join(f"{n} {op}" for op, n in sorted(counts.items())) or "none"


def main() -> None:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" not in os.environ:  # plain `python examples/parallel.py`: a group of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29531")
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,))
    x = torch.randn(BATCH, SEQ, D, generator=torch.Generator().manual_seed(1)).to(device)

    single = decoder().to(device)
    loss_of(single, x).backward()
    reference = [p.grad for p in single.parameters()]

    rows = [run(name, parallelize, marks, mesh, x, reference, not cuda) for name, parallelize, marks in SETTINGS]
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        print(f"{world} rank(s), {dist.get_backend()}, decoder of {LAYERS} blocks, d={D}, batch {BATCH}x{SEQ}")
        for r, rank_rows in enumerate(gathered):
            for row in rank_rows:
                mib = row["tracked"] / 2**20
                check = (f" (allocator {row['allocator'] / 2**20:.2f})" if row["allocator"] is not None else "")
                grads = ("equal to one process" if row["equal"]
                         else f"within {row['diff']:.0e} of one process")
                print(f"rank {r} | {row['name']:<47} | forward: {show(row['forward'])}"
                      f" | backward: {show(row['backward'])} | peak {mib:.2f} MiB{check} | grads {grads}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
