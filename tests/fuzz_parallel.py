"""Random tensor-parallel and FSDP2 models under random distributed marks (for tests/test_parallel.py).

A *case* is one integer seed; every rank draws the same case from it. :func:`make_case`
draws a model (a chain of blocks of the kinds in ``KINDS``), a parallelism (DTensor
tensor parallelism or FSDP2 units) and a mark per block (none, or a cell mark with
random ``mp_comm_recompute``, ``parallel_optimizer_comm_recompute``, ``use_reentrant``
and ``output_recompute``), sometimes with a marked operator between blocks.
:func:`run_case` builds the model twice from the seed, parallelizes both, marks the
second, trains both two steps with SGD and compares losses, local gradient shards and
updated parameters with ``torch.equal``, and the collectives each issues.

Grow it by adding block kinds to ``KINDS`` and options to :func:`_draw_marks`.

Reproduce one case (2 processes)::

    PYTHONPATH=src torchrun --nproc-per-node 2 -m tests.fuzz_parallel 1234
"""

from __future__ import annotations

import random
import sys
import traceback
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

import remat
from tests._harness import bitwise_equal

D, HEADS = 16, 4


class MLP(nn.Module):
    """``x + down(gelu(up(x)))``: up column-wise, down row-wise (one all-reduce each way)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))

    tp_plan: ClassVar[dict] = {"up": "colwise", "down": "rowwise"}


class NormMLP(MLP):
    """Pre-norm MLP: a replicated LayerNorm before the tensor-parallel layers."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Attention(nn.Module):
    """Causal self-attention written out; q/k/v column-wise, o row-wise."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (f(x).view(b, s, -1, D // HEADS).transpose(1, 2) for f in (self.q, self.k, self.v))
        scores = (q @ k.transpose(-2, -1)) / (D // HEADS) ** 0.5
        causal = torch.ones(s, s, dtype=torch.bool).triu(1)
        y = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v
        return x + self.o(y.transpose(1, 2).reshape(b, s, -1))

    tp_plan: ClassVar[dict] = {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise"}


class Plain(nn.Module):
    """No collective inside (replicated under tensor parallelism)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))

    tp_plan: ClassVar[dict] = {}


class Scaled(nn.Module):
    """Functional collectives on detached values scale the branch (no gradient through them)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        functional, name = torch.ops._c10d_functional, dist.group.WORLD.group_name
        total = functional.wait_tensor(functional.all_reduce(h.detach(), "sum", name))
        a, b = (functional.wait_tensor(t) for t in functional.all_reduce_coalesced(
            [h.detach().mean(-1), h.detach().amax(-1)], "avg", name))
        return x + h * torch.sigmoid(total) * (a - b).unsqueeze(-1).tanh()

    tp_plan: ClassVar[dict] = {}


KINDS = {"mlp": MLP, "norm_mlp": NormMLP, "attention": Attention, "plain": Plain, "scaled": Scaled}


class Chain(nn.Module):
    def __init__(self, kinds: list[str], relus: list[int]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(KINDS[k]() for k in kinds)
        self.relus = nn.ModuleDict({str(i): remat.ops.ReLU() for i in relus})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x)
            if str(i) in self.relus:
                x = self.relus[str(i)](x) - 0.5
        return x


def _draw_marks(r: random.Random, parallel: str, n: int) -> list[dict | None]:
    marks: list[dict | None] = []
    for _ in range(n):
        if r.random() < 0.3:
            marks.append(None)
            continue
        opts: dict[str, Any] = {}
        if parallel == "tp" and r.random() < 0.8:
            opts["mp_comm_recompute"] = r.random() < 0.5
        if parallel == "fsdp" and r.random() < 0.7:
            opts["parallel_optimizer_comm_recompute"] = r.random() < 0.5
        if r.random() < 0.3:
            opts["use_reentrant"] = True
        elif r.random() < 0.4:  # the saved-tensor-hooks engine only
            opts["output_recompute"] = True
        marks.append(opts)
    return marks


def make_case(seed: int) -> dict:
    r = random.Random(seed)
    n = r.randint(1, 4)
    parallel = r.choice(("tp", "tp", "fsdp"))
    kinds = [r.choice(tuple(KINDS)) for _ in range(n)]
    relus = [i for i in range(n) if r.random() < 0.15]
    return {
        "seed": seed, "parallel": parallel, "kinds": kinds, "relus": relus,
        "marks": _draw_marks(r, parallel, n), "marked_relus": [i for i in relus if r.random() < 0.7],
        "units": [i for i in range(n) if r.random() < 0.8],  # FSDP2 units (the root is one too)
    }


def _parallelize(model: Chain, case: dict) -> Chain:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if case["parallel"] == "tp":
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        for block in model.blocks:
            if block.tp_plan:
                parallelize_module(block, mesh, {n: styles[s]() for n, s in block.tp_plan.items()})
        return model
    from torch.distributed.fsdp import fully_shard

    for i in case["units"]:
        fully_shard(model.blocks[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _build(case: dict, marked: bool) -> Chain:
    torch.manual_seed(case["seed"])
    model = Chain(case["kinds"], case["relus"])
    if marked:
        for block, opts in zip(model.blocks, case["marks"], strict=True):
            if opts is not None:
                remat.recompute_module(block, **opts)
        for i in case["marked_relus"]:
            model.relus[str(i)].recompute()
    return _parallelize(model, case)


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to_local() if hasattr(t, "to_local") else t


def _train(model: Chain, x: torch.Tensor) -> list:
    """Two SGD steps: per step the loss, the collectives, local gradients and parameters."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        with remat.parallel.count_collectives() as counts:
            loss = model(x).sin().mean()
            loss.backward()
        grads = [_local(p.grad).clone() if p.grad is not None else None for p in model.parameters()]
        optimizer.step()
        steps.append((loss.detach().clone(), dict(counts.forward), dict(counts.backward), grads,
                      [_local(p.detach()).clone() for p in model.parameters()]))
    return steps


def run_case(seed: int) -> dict:
    """Return ``{"verdict": "ok" | "mismatch" | "error", ...}`` for one case on this rank."""
    case = make_case(seed)
    x = torch.randn(2, 4, D, generator=torch.Generator().manual_seed(seed)).requires_grad_()
    try:
        plain = _train(_build(case, marked=False), x)
        marked = _train(_build(case, marked=True), x)
    except Exception:  # noqa: BLE001 - every error is a verdict, reported with its case
        return {"case": case, "verdict": "error", "error": traceback.format_exc(limit=6)}
    for step, (p, m) in enumerate(zip(plain, marked, strict=True)):
        for what, i in (("loss", 0), ("gradients", 3), ("parameters", 4)):
            if not bitwise_equal(p[i], m[i]):
                return {"case": case, "verdict": "mismatch", "step": step, "what": what}
    return {"case": case, "verdict": "ok", "plain": [(f, b) for _, f, b, _, _ in plain],
            "marked": [(f, b) for _, f, b, _, _ in marked]}


def run_cases(seeds: range) -> list[dict]:
    return [run_case(seed) for seed in seeds]


if __name__ == "__main__":  # torchrun --nproc-per-node 2 -m tests.fuzz_parallel SEED
    import datetime

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    result = run_case(int(sys.argv[1]))
    if dist.get_rank() == 0:
        print(make_case(int(sys.argv[1])))
        print(result)
    dist.destroy_process_group()
